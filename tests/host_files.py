"""What a process's mount namespace shows of the host's files, seen from inside it as a given uid."""

from __future__ import annotations

import json
import subprocess
import sys

# Entering a mount namespace (setns) moves the caller's root and working directory to that
# namespace's root, so everything the probe needs is imported before it goes in.
_PROBE = """
import ctypes, json, os, sys
pid, uid, paths = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
os.setgroups([])
os.setresgid(uid, uid, -1)

def look():
    seen = {}
    for path in paths:
        try:
            os.close(os.open(path, os.O_RDONLY))
            seen[path] = "opened"
        except OSError as e:
            seen[path] = e.errno
    try:
        seen["/ lists"] = sorted(os.listdir("/"))
    except OSError as e:
        seen["/ lists"] = e.errno
    return seen

os.seteuid(uid)
host = look()
os.seteuid(0)
if ctypes.CDLL(None, use_errno=True).setns(ns, 0x20000) != 0:  # CLONE_NEWNS
    sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
os.setresuid(uid, uid, uid)
print(json.dumps({"host": host, "inside": look()}))
"""


def files_seen(pid: int, uid: int, paths: list[str]) -> dict[str, dict[str, object]]:
    """For each of ``paths`` (and ``/ lists``, the root's listing): what uid ``uid`` gets on the host
    (``host``), and in ``pid``'s mount namespace (``inside``): "opened", or the errno."""
    result = subprocess.run([sys.executable, "-c", _PROBE, str(pid), str(uid), json.dumps(paths)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    seen: dict[str, dict[str, object]] = json.loads(result.stdout)
    return seen
