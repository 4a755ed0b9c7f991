"""Named code contexts, the JavaScript kernel, rich results and per-cell envs (issue 14, part 4),
embedded and through a real ``corral serve``: the same calls, the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidSpec, ResourceLimit, Sandbox

from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-contexts", keys=KEYS) as srv:
        yield srv


@pytest.fixture(scope="module", params=["embedded", "remote"])
def sandbox(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[Sandbox]:
    where: dict[str, Any] = {"url": server.url, "api_key": KEYS["alice"]} if request.param == "remote" else {}
    with Sandbox.create(memory="512M", **where) as sb:
        yield sb


def test_two_python_contexts_keep_their_own_variables(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/tmp/elsewhere")
    first = sandbox.create_code_context()
    second = sandbox.create_code_context(language="python", cwd="/tmp/elsewhere")
    assert first.id != second.id and first.language == "python"
    sandbox.run_code("x = 'first'", context=first)
    sandbox.run_code("x = 'second'", context=second)
    assert sandbox.run_code("x", context=first).text == "'first'"
    assert sandbox.run_code("x", context=second.id).text == "'second'"  # by name too
    assert sandbox.run_code("import os; os.getcwd()", context=second).text == "'/tmp/elsewhere'"
    missing = sandbox.run_code("x")  # the default interpreter is a third one
    assert missing.error is not None and missing.error.name == "NameError"
    with pytest.raises(InvalidSpec, match="no code context"):
        sandbox.run_code("1", context="ctx-000000000000")


def test_javascript_keeps_state_prints_and_raises(sandbox: Sandbox) -> None:
    first = sandbox.run_code("let total = 20; total + 1", language="js")
    assert first.text == "21" and first.error is None
    seen: list[str] = []
    second = sandbox.run_code("console.log('twice', total * 2); ({ok: true})", language="javascript",
                              on_stdout=seen.append)
    assert second.logs.stdout == ["twice 40\n"] == seen and second.text == "{ ok: true }"
    failed = sandbox.run_code("null.x", language="javascript")
    assert failed.error is not None and failed.error.name == "TypeError" and "<cell-" in failed.error.traceback
    context = sandbox.create_code_context(language="javascript")
    assert sandbox.run_code("typeof total", context=context).text == "undefined"  # its own globals
    assert sandbox.run_code("typeof total", language="javascript").text == "number"


def test_a_javascript_cell_past_its_timeout_is_interrupted_and_state_kept(sandbox: Sandbox) -> None:
    sandbox.run_code("var kept = 'yes'", language="javascript")
    looped = sandbox.run_code("while (true) {}", language="javascript", timeout=1)
    assert looped.timed_out and looped.error is not None and looped.error.name == "TimeoutError"
    assert not looped.restarted
    assert sandbox.run_code("kept", language="javascript").text == "yes"


def test_rich_results_and_envs_per_cell(sandbox: Sandbox) -> None:
    code = ("class Bundle:\n"
            "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
            "        return {'text/html': '<b>bold</b>', 'image/svg+xml': '<svg/>', 'text/plain': 'Bundle!'}\n"
            "Bundle()")
    rich = sandbox.run_code(code)
    main = rich.results[0]
    assert (main.html, main.svg, main.text, rich.text) == ("<b>bold</b>", "<svg/>", "Bundle!", "Bundle!")
    assert set(main.formats()) >= {"html", "svg", "text"}
    assert sandbox.run_code("import os; os.environ.get('CELL_ONLY')", envs={"CELL_ONLY": "here"}).text == "'here'"
    assert sandbox.run_code("os.environ.get('CELL_ONLY')").text is None  # gone after the cell
    js = sandbox.run_code("process.env.CELL_ONLY", language="javascript", envs={"CELL_ONLY": "js"})
    assert js.text == "js"


def _kernels(sandbox: Sandbox) -> int:
    """Interpreter processes running in the sandbox (kernels are not listed as commands)."""
    listing = sandbox.commands.run("ps -eo args").stdout
    return sum("Corral's" in line and "kernel" in line for line in listing.splitlines())


def test_a_removed_context_ends_its_interpreter_and_frees_its_room(sandbox: Sandbox) -> None:
    """A long session makes and removes contexts: a removed one is gone from the list, its variables
    and its kernel with it, and its room counts again (16 a sandbox); removing it twice, or running
    in it, is InvalidSpec, embedded and remote alike."""
    from corral.interpreter import MAX_CODE_CONTEXTS

    for old in sandbox.list_code_contexts():
        sandbox.remove_code_context(old)
    kernels = _kernels(sandbox)
    first = sandbox.create_code_context()
    sandbox.run_code("kept = 41", context=first)
    assert [c.id for c in sandbox.list_code_contexts()] == [first.id]
    assert _kernels(sandbox) == kernels + 1
    sandbox.remove_code_context(first)
    assert sandbox.list_code_contexts() == [] and _kernels(sandbox) == kernels
    with pytest.raises(InvalidSpec):
        sandbox.run_code("kept", context=first)
    with pytest.raises(InvalidSpec):
        sandbox.remove_code_context(first.id)

    made = [sandbox.create_code_context() for _ in range(MAX_CODE_CONTEXTS)]
    with pytest.raises(ResourceLimit):
        sandbox.create_code_context()
    sandbox.remove_code_context(made.pop())
    made.append(sandbox.create_code_context(language="javascript"))
    assert sandbox.run_code("1 + 1", context=made[-1]).text == "2"
    assert {c.id for c in sandbox.list_code_contexts()} == {c.id for c in made}
    for context in made:
        sandbox.remove_code_context(context)


def test_removing_a_context_ends_its_running_cell_at_once_and_holds_its_room_until_the_kernel_ended(
        sandbox: Sandbox) -> None:
    """Removing a context waited for its running cell (18 s for a 20 s cell, a 7-day cell 7 days),
    which then went on to its end, and gave its room back before that: 48 kernels ran cells at once
    against a bound of 16.  Now the kernel is killed at once, the cell says ContextRemoved, and a
    context made meanwhile waits for the room, so the kernels never outnumber the bound."""
    import threading
    import time

    from corral.interpreter import MAX_CODE_CONTEXTS

    for old in sandbox.list_code_contexts():
        sandbox.remove_code_context(old)
    kernels = _kernels(sandbox)
    made = [sandbox.create_code_context() for _ in range(MAX_CODE_CONTEXTS)]
    for context in made:
        sandbox.run_code("1", context=context)
    answers: dict[str, Any] = {}
    running = threading.Thread(target=lambda: answers.update(cell=sandbox.run_code(
        "import time\ntime.sleep(60)\nprint('cell finished')", context=made[0], timeout=120)))
    running.start()
    time.sleep(2)  # (the cell runs)
    removing = threading.Thread(target=lambda: answers.update(took=_timed(sandbox.remove_code_context, made[0])))
    removing.start()
    deadline = time.monotonic() + 30
    while True:  # a new context is refused until the removed one's kernel has ended
        try:
            made[0] = sandbox.create_code_context()
            break
        except ResourceLimit:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sandbox.run_code("1", context=made[0])
    assert _kernels(sandbox) <= kernels + MAX_CODE_CONTEXTS
    removing.join(30)
    running.join(30)
    assert not running.is_alive() and answers["took"] < 10, answers
    cell = answers["cell"]
    assert cell.error is not None and cell.error.name == "ContextRemoved" and cell.logs.stdout == [], cell
    for context in made:
        sandbox.remove_code_context(context)
    assert _kernels(sandbox) == kernels


def _timed(call: Any, *args: Any) -> float:
    import time

    began = time.monotonic()
    call(*args)
    return time.monotonic() - began


def test_a_cell_sent_to_a_context_as_it_is_removed_is_refused_and_starts_no_kernel() -> None:
    """A run_code that had looked its context's interpreter up when the context was removed took the
    interpreter after the removal closed it and started a new kernel nobody held (2 in 60 rounds):
    now it is refused (InvalidSpec, as for a removed context) and no kernel starts."""
    from corral.interpreter import interpreter_in

    with Sandbox.create() as sb:
        context = sb.create_code_context()
        sb.run_code("1", context=context)
        kernels = _kernels(sb)
        interpreter = interpreter_in(sb._backend, sb, None, context.id)  # type: ignore[attr-defined]
        sb.remove_code_context(context)
        with pytest.raises(InvalidSpec):
            interpreter.run("x = 1")
        assert _kernels(sb) == kernels - 1
        with pytest.raises(InvalidSpec):
            interpreter_in(sb._backend, sb, None, context.id)  # type: ignore[attr-defined]
