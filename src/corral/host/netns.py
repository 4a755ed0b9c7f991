"""Network namespaces, veth pairs and nftables tables, each named ``crl...`` with a random suffix.

Everything here is created by name and deleted by that same name: nothing is
ever swept by prefix, so parallel runs (and other people's ``crl`` objects)
are never touched.  Our nftables rules live in tables of our own; other tables
are never listed, changed or flushed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import secrets
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import HostNotSupported

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
PREFIX = "crl"
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
    """Delete a namespace (its end of any veth pair goes with it, and so does the host end)."""
    if netns_exists(name):
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def delete_link(name: str) -> None:
    if link_exists(name):
        subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=30)


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


def nft_table_exists(family: str, name: str) -> bool:
    return subprocess.run(["nft", "list", "table", family, name], capture_output=True, timeout=30).returncode == 0


def nft_load(ruleset: str) -> None:
    _run(["nft", "-f", "-"], stdin=ruleset)


def ip_batch(commands: str) -> None:
    """Several ``ip`` commands in one process (in the calling thread's namespace)."""
    _run(["ip", "-batch", "-"], stdin=commands)


def nft_counters(family: str, table: str) -> dict[str, int]:
    """Packets counted per rule comment in one of our tables (summed over rules sharing a comment)."""
    out = subprocess.run(["nft", "-j", "list", "table", family, table],
                         capture_output=True, text=True, timeout=30).stdout
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
    if nft_table_exists(family, name):
        subprocess.run(["nft", "delete", "table", family, name], capture_output=True, timeout=30)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def enter_netns(name: str) -> None:
    """Move the calling thread into a named namespace (used between fork and exec)."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
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
    box: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            enter_netns(name)
            box.append(work())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return box[0]
