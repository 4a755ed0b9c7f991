"""The process tier's launcher is placed in its sandbox's cgroups before it execs bwrap
(issue 16: a cold create no longer moves a starting bwrap, which waited 1.5-2.5 ms), and a
launcher that cannot be placed fails the create with nothing left (bwrap never starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import Sandbox, SandboxError
from corral.host import cgroups
from corral.host.mountns import MountNamespace
from corral.tiers.process import ProcessSandbox

from .leaks import all_leftovers
from .test_session_containment import misplaced, process_tier_pids
from .tier_probe import skip_unless_tier


def test_the_launcher_sits_in_every_group_of_its_sandbox_before_it_execs_bwrap(
        monkeypatch: pytest.MonkeyPatch, state_dir: Path) -> None:
    """The holder of the sandbox's mount namespace joins its cgroups while idle, before it
    becomes bwrap: bwrap and all it forks are born inside (no move of a starting process)."""
    skip_unless_tier("process", state_dir)
    seen: dict[int, str] = {}
    original = MountNamespace.exec

    def spy(self: MountNamespace, *args: object, **kwargs: object) -> object:
        seen[self.pid] = Path(f"/proc/{self.pid}/cgroup").read_text()  # still the holder here
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MountNamespace, "exec", spy)
    with Sandbox.create() as sb:
        inner = sb._inner
        assert isinstance(inner, ProcessSandbox) and inner._proc is not None
        assert list(seen) == [inner._proc.pid], "the holder became bwrap"
        group = f"/{cgroups.PARENT}/{sb.id}"
        lines = {c: path for line in seen[inner._proc.pid].splitlines()
                 for _, controllers, path in [line.split(":", 2)]
                 for c in (controllers.split(",") if controllers else [""])}
        layout = cgroups.detect()
        for controller in (["memory", "pids", "cpu"] if layout.version == 1 else []):
            assert lines.get(controller) == group, f"{controller}: {lines.get(controller)}"
        kill_key = "freezer" if layout.kill_mode == "freezer" else ""
        assert lines.get(kill_key, "").startswith(group + "/"), lines.get(kill_key)
        # and every process of the sandbox is still inside all of them
        assert [p for p in map(lambda pid: misplaced(pid, sb.id), process_tier_pids(sb)) if p] == []
        assert sb.commands.run(["true"]).exit_code == 0


def test_a_launcher_that_cannot_join_its_cgroups_fails_the_create_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, state_dir: Path) -> None:
    """Fail closed: if the holder cannot be placed, bwrap never starts and nothing is left."""
    skip_unless_tier("process", state_dir)

    def refuse(procs_files: object, pid: int) -> None:
        raise OSError(16, f"injected: cannot move {pid}")

    execs: list[int] = []
    original = MountNamespace.exec
    monkeypatch.setattr(MountNamespace, "exec",
                        lambda self, *a, **k: execs.append(self.pid) or original(self, *a, **k))  # type: ignore[func-returns-value]
    before = set(all_leftovers(state_dir))
    monkeypatch.setattr(cgroups, "join", refuse)  # the tier calls cgroups.join
    with pytest.raises((OSError, SandboxError)):
        Sandbox.create()
    assert execs == [], "bwrap was started in no cgroup of the sandbox"
    assert set(all_leftovers(state_dir)) - before == set()
    monkeypatch.undo()
    with Sandbox.create() as sb:  # the allowed direction: a create works again
        assert sb.commands.run(["true"]).exit_code == 0
