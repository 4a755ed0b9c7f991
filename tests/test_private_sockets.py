"""Unix sockets only their owner may connect to, bound without touching the process's umask.

The owner link, the CLI daemon and port forwards on Unix sockets bind 0600 sockets while other
threads of the same process build sandboxes.  They once did it with ``umask(0o177)`` around
``bind``; the umask is the process's, so a root being built meanwhile got 0600 directories, and
a sandbox of a burst of first creates could not enter ``/`` (a CI failure of ``test_cluster``).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from corral.host.sockets import bind_private


def test_a_private_socket_is_0600_and_only_root_reaches_it(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bind_private(listener, tmp_path / "s")
    listener.listen(1)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["s"]  # the staging directory is gone

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as root_client:
        root_client.connect(str(tmp_path / "s"))
    pid = os.fork()
    if pid == 0:  # as nobody: refused
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
                other.connect(str(tmp_path / "s"))
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0, "an unprivileged user connected to a private socket"

    # like bind: a path that exists is EADDRINUSE, and is left as it was
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError, match="exists"):
        bind_private(second, tmp_path / "s")
    assert sorted(os.listdir(tmp_path)) == ["s"]
    listener.close()
    second.close()


def test_binding_private_sockets_never_changes_what_other_threads_create(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        stop = threading.Event()
        sockets_dir = tmp_path / "sockets"
        sockets_dir.mkdir()

        def bind_many() -> None:
            for n in range(400):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    bind_private(sock, sockets_dir / f"{n}")
            stop.set()

        binder = threading.Thread(target=bind_many)
        binder.start()
        made = 0
        while not stop.is_set() and made < 20000:
            (tmp_path / f"d{made}").mkdir()
            made += 1
        binder.join()
        modes = {stat.S_IMODE(os.stat(tmp_path / f"d{n}").st_mode) for n in range(made)}
        assert modes == {0o755}, f"directories made while sockets were bound got modes {sorted(map(oct, modes))}"
    finally:
        os.umask(old)


def test_a_socket_whose_path_fits_is_bound_however_long_its_staging_path_would_be(tmp_path: Path) -> None:
    # the final path fits in the 107 bytes a socket's path holds; its staging path (+ "/.bind-XXXXXXXX") does not
    directory = tmp_path / ("d" * max(1, 107 - len(str(tmp_path)) - len("/x/s")))
    directory.mkdir()
    path = directory / "s"
    assert len(str(path)) <= 107
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        bind_private(listener, path)
        listener.listen(1)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            conn, _ = listener.accept()
            client.sendall(b"ok")
            assert conn.recv(2) == b"ok"
            conn.close()
    assert sorted(p.name for p in directory.iterdir()) == ["s"]  # no staging directory left
