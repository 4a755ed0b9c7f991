from __future__ import annotations

from corral import Sandbox


def test_run_and_files() -> None:
    with Sandbox.create() as sb:
        result = sb.commands.run("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        sb.files.write("dir/hello.txt", "hi")
        assert sb.files.read("dir/hello.txt") == "hi"
        assert sb.commands.run("cat /workspace/dir/hello.txt").stdout == "hi"
