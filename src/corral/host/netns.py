"""Network namespaces, veth pairs and nftables tables, each named ``crl...`` with a random suffix.

Everything here is created by name and deleted by that same name: nothing is
ever swept by prefix, so parallel runs (and other people's ``crl`` objects)
are never touched.  Our nftables rules live in tables of our own; other tables
are never listed, changed or flushed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import secrets
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import HostNotSupported
from . import mounts
from .rtnl import Rtnl

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def new_suffix() -> str:
    """8 random hex digits: short enough for interface names (15 characters max)."""
    return secrets.token_hex(4)


def _run(argv: list[str], stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise HostNotSupported(f"{argv[0]} is not installed: apt-get install iproute2 nftables") from None
    if proc.returncode != 0:
        raise HostNotSupported(f"`{' '.join(argv[:6])}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def create_netns(name: str) -> None:
    _run(["ip", "netns", "add", name])
    _run(["ip", "-n", name, "link", "set", "lo", "up"])


def delete_netns(name: str) -> None:
    """Delete a namespace (its end of any veth pair goes with it, and so does the host end).

    What ``ip netns delete`` does, without its fork and exec: detach the bind
    mount that names the namespace, then remove the file.  The kernel frees
    the namespace once its last process is gone."""
    path = NETNS_DIR / name
    if not path.exists():
        return
    try:
        mounts.umount(path, lazy=True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: not a mount point any more (a crash between the two steps)
            raise
    path.unlink(missing_ok=True)


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def delete_link(name: str) -> None:
    """Delete a host interface by name, if it exists (rtnetlink: no ``ip`` run)."""
    if link_exists(name):
        with Rtnl() as rtnl:
            rtnl.delete_link(name)


def create_veth(host_if: str, ns_if: str, netns: str, host_addr: str, ns_addr: str,
                extra_ns_addrs: tuple[str, ...] = ()) -> None:
    """A veth pair: ``host_if`` stays on the host with ``host_addr``, ``ns_if`` moves into ``netns``."""
    _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", netns])
    _run(["ip", "addr", "add", host_addr, "dev", host_if])
    _run(["ip", "link", "set", host_if, "up"])
    _run(["ip", "-n", netns, "addr", "add", ns_addr, "dev", ns_if])
    for addr in extra_ns_addrs:
        _run(["ip", "-n", netns, "addr", "add", addr, "dev", ns_if])
    _run(["ip", "-n", netns, "link", "set", ns_if, "up"])


def add_default_route(netns: str, via: str) -> None:
    _run(["ip", "-n", netns, "route", "add", "default", "via", via])


class _LibNftables:
    """libnftables, the library the ``nft`` command is built on, called in-process.

    An ``nft`` run costs 4-7 ms of fork and exec on this loaded host; a library
    call about 0.3 ms, and every ``allow`` and ``open`` sandbox loads a table.
    Calls are serialized: the library keeps some global state.  Like ``nft``
    itself, a call acts in the calling thread's network namespace.
    """

    JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

    def run(self, command: str, as_json: bool = False) -> tuple[int, str, str]:
        with self._lock:
            ctx = self._lib.nft_ctx_new(0)
            if not ctx:
                raise OSError("nft_ctx_new failed")
            try:
                if as_json:
                    self._lib.nft_ctx_output_set_flags(ctx, self.JSON)
                self._lib.nft_ctx_buffer_output(ctx)
                self._lib.nft_ctx_buffer_error(ctx)
                rc = self._lib.nft_run_cmd_from_buffer(ctx, command.encode())
                out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
                err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
            finally:
                self._lib.nft_ctx_free(ctx)
        return rc, out, err


@functools.cache
def _libnftables() -> _LibNftables | None:
    # loaded on first use, not at import: every sandbox imports this module, few need nftables
    try:
        return _LibNftables(ctypes.CDLL("libnftables.so.1"))
    except (OSError, AttributeError):
        return None  # no library: the ``nft`` command does the same, slower


def _low_descriptors_free(count: int = 8) -> bool:
    """True if ``count`` descriptors below 1024 are free now.  libnftables (1.0.6) waits for the
    kernel's answer with ``select(2)``: were its netlink socket numbered 1024 or above, its
    fortified ``FD_SET`` would abort this process -- the whole server, once it holds that many
    (a test owner with 1,100 open descriptors died making an ``allow`` sandbox).  A new socket
    takes the lowest free number, so several free below 1024 leave it room even if other
    threads open a few meanwhile."""
    taken: list[int] = []
    try:
        for _ in range(count):
            taken.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        return max(taken) < 1024
    except OSError:
        return False
    finally:
        for fd in taken:
            os.close(fd)


def nft(command: str, as_json: bool = False) -> tuple[int, str, str]:
    """(return code, output, errors) of nft commands, in the calling thread's namespace."""
    lib = _libnftables()
    if lib is not None and _low_descriptors_free():
        return lib.run(command, as_json)
    try:
        proc = subprocess.run(["nft", *(["-j"] if as_json else []), "-f", "-"], input=command,
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise HostNotSupported("nft is not installed: apt-get install nftables") from None
    return proc.returncode, proc.stdout, proc.stderr


def nft_table_exists(family: str, name: str) -> bool:
    return nft(f"list table {family} {name}")[0] == 0


def nft_load(ruleset: str) -> None:
    rc, out, err = nft(ruleset)
    if rc != 0:
        raise HostNotSupported(f"loading an nftables table failed: {err.strip() or out.strip()}")


def nft_counters(family: str, table: str) -> dict[str, int]:
    """Packets counted per rule comment in one of our tables (summed over rules sharing a comment)."""
    out = nft(f"list table {family} {table}", as_json=True)[1]
    counts: dict[str, int] = {}
    try:
        for item in json.loads(out or "{}").get("nftables", []):
            rule = item.get("rule")
            if not rule or "comment" not in rule:
                continue
            for expr in rule.get("expr", []):
                if "counter" in expr:
                    counts[rule["comment"]] = counts.get(rule["comment"], 0) + int(expr["counter"]["packets"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
    return counts


def nft_delete_table(family: str, name: str) -> None:
    """Delete one of our tables if it exists (no error if it does not)."""
    nft(f"delete table {family} {name}")


def enter_netns(name: str) -> None:
    """Move the calling thread into a named namespace (not safe between fork and exec: loads libc lazily)."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mounts.check(mounts.libc().setns(fd, CLONE_NEWNET), f"entering network namespace {name}")
    finally:
        os.close(fd)


def in_netns(name: str, work: Callable[[], T]) -> T:
    """Run ``work`` in a thread that has entered the named namespace, and return its result.

    Namespaces are per thread, and whatever that thread creates stays in the
    namespace: sockets (an NFLOG socket binds that namespace's groups), and the
    children it starts (``nft``, ``ip``: no ``ip netns exec`` needed).  The
    thread ends afterwards, so no thread of this process is left in a foreign
    namespace.
    """
    return _in_thread(f"netns-{name}", lambda: enter_netns(name), work)


def new_netns(name: str, work: Callable[[], T]) -> T:
    """Create a named namespace and run ``work`` in it, like :func:`in_netns`.

    What ``ip netns add`` does, without its fork and exec (2-3 ms here): a thread
    unshares its network namespace and bind-mounts it on ``/run/netns/NAME``.  If
    ``work`` fails, the namespace stays: delete it by name (:func:`delete_netns`).
    """
    path = NETNS_DIR / name

    def create() -> None:
        NETNS_DIR.mkdir(mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
        try:
            mounts.check(mounts.libc().unshare(CLONE_NEWNET), f"creating network namespace {name}")
            mounts.mount("/proc/thread-self/ns/net", path, None, mounts.MS_BIND)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    return _in_thread(f"netns-{name}", create, work)


def _in_thread(label: str, enter: Callable[[], None], work: Callable[[], T]) -> T:
    box: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            enter()
            box.append(work())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=label)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return box[0]
