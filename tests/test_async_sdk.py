"""``AsyncSandbox`` has the whole surface, embedded and through a real ``corral serve``; over
HTTP it is native asyncio (no worker thread), and ``async def`` callbacks are awaited."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import AsyncSandbox, InvalidSpec

from .server_fixtures import KEYS, ServerProcess


@pytest.fixture(scope="module")
def server(state_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(state_dir / "srv-async", keys=KEYS) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def where(request: pytest.FixtureRequest, server: ServerProcess) -> dict[str, Any]:
    return {"url": server.url, "api_key": KEYS["alice"]} if request.param == "remote" else {}


def test_the_whole_surface_with_async_callbacks(where: dict[str, Any], tmp_path: Path) -> None:
    async def main() -> list[Any]:
        said: list[Any] = []
        seen: list[str] = []

        async def on_stdout(text: str) -> None:
            await asyncio.sleep(0)  # a real coroutine: awaited before run() returns
            seen.append(text)

        async with await AsyncSandbox.create(metadata={"suite": "async"}, **where) as sb:
            result = await sb.commands.run("echo one; sleep 0.1; echo two", on_stdout=on_stdout)
            said.append([result.stdout, "".join(seen)])
            handle = await sb.commands.run("read x; echo got $x; exec sleep 60", background=True)
            await sb.commands.send_stdin(handle.pid, "hi\n")
            said.append([[c.pid == handle.pid for c in await sb.commands.list()]])
            said.append([await sb.commands.kill(handle.pid), (await handle.wait()).exit_code])
            started = await sb.commands.start(["cat"])
            await started.send_stdin(b"\x00\xff")
            await started.close_stdin()
            said.append([(await started.wait()).stdout == "\x00\ufffd"])
            await sb.files.write("dir/a.txt", "alpha")
            said.append([await sb.files.read("dir/a.txt"), [e.name for e in await sb.files.list("dir")],
                         await sb.files.exists("dir/nope")])
            (tmp_path / "up").mkdir()
            (tmp_path / "up" / "b.txt").write_text("beta")
            said.append([await sb.files.upload_dir(tmp_path / "up", "/tmp/up"),
                         await sb.files.download_dir("/tmp/up", tmp_path / "down"),
                         (tmp_path / "down" / "b.txt").read_text()])
            results: list[Any] = []

            async def on_result(value: Any) -> None:
                results.append(value.text)

            context = await sb.create_code_context()
            await sb.run_code("v = 6", context=context)
            said.append([(await sb.run_code("v * 7", context=context, on_result=on_result)).text, results])
            listed = [c.id for c in await sb.list_code_contexts()]
            await sb.remove_code_context(context)
            said.append([listed == [context.id], await sb.list_code_contexts()])
            said.append([(await sb.run_code("'js'.toUpperCase()", language="js")).text])
            info = await sb.get_info()
            said.append([info.metadata, [i.sandbox_id for i in await AsyncSandbox.list({"suite": "async"}, **where)]
                         == [sb.sandbox_id]])
            other = await AsyncSandbox.connect(sb.id, **where)
            said.append([(await other.commands.run("echo again")).stdout, await sb.is_running()])
            await sb.set_timeout(600)
            with pytest.raises(InvalidSpec, match="memroy"):
                await AsyncSandbox.create(memroy="1G", **where)
            said.append([await AsyncSandbox.kill(sb.id, **where), await sb.is_running()])
        return said

    assert asyncio.run(main()) == [
        ["one\ntwo\n", "one\ntwo\n"], [[True]], [True, 137], [True], ["alpha", ["a.txt"], False],
        [1, 1, "beta"], ["42", ["42"]], [True, []], ["JS"], [{"suite": "async"}, True], ["again\n", True],
        [True, False]]


def test_over_http_no_call_takes_a_thread(server: ServerProcess) -> None:
    async def main() -> tuple[int, int, list[str]]:
        async with await AsyncSandbox.create(url=server.url, api_key=KEYS["alice"]) as sb:
            before = threading.active_count()
            # 8 commands: the server's per-sandbox limit on commands at once (12 overlapped under
            # load and the server refused the 9th, rightly); files calls are not commands
            outputs = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(8)),
                                           *(sb.files.exists("/tmp") for _ in range(12)))
            return before, threading.active_count(), [r.stdout for r in outputs[:8]]

    before, after, outputs = asyncio.run(main())
    assert outputs == [f"{i}\n" for i in range(8)]
    assert after == before, "a worker thread was started for an HTTP call"
