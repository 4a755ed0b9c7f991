"""Whether a process's network namespace reaches a service on the host's loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _probe(port: int) -> str:
    return ("import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5); print('reached')\n"
            "except OSError as e:\n"
            "    print('failed', e.errno)\n")


def assert_cannot_reach_the_hosts_loopback(pid: int) -> None:
    """``pid``'s network namespace is not the host's, and a service on the host's loopback that
    the host reaches (so the check can fail) is ``ENETUNREACH`` from it."""
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    with socket.create_server(("127.0.0.1", 0)) as service:
        probe = _probe(service.getsockname()[1])
        host = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert host.stdout == "reached\n", host
        inside = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", probe],
                                capture_output=True, text=True, timeout=30)
        assert inside.stdout == "failed 101\n", inside  # ENETUNREACH
