"""apt-get install as root inside (issue 13): a small .deb the test builds, from a
Debian-format repository the test serves in a network namespace of its own (``c13-*``;
nothing leaves the machine), reached through the sandbox's egress proxy.

The host image has the host's apt and dpkg in /usr but no package database (its /etc and
/var are a skeleton), so root first makes an empty one; the built ``base`` image has a
database but no apt (its recipe does not list it).

Cost: one sandbox with network="allow", ~4 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from corral import Sandbox
from corral.host import netns

from .egress_net import _free_subnet

PORT = 8080


def _deb(work: Path) -> Path:
    """c13-hello 1.0 (all): /usr/bin/c13-hello, built with dpkg-deb."""
    pkg = work / "c13-hello"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "bin").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: c13-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: corral tests <t@example.invalid>\n"
        "Description: a package for corral's root test\n")
    tool = pkg / "usr" / "bin" / "c13-hello"
    tool.write_text("#!/bin/sh\necho hello from c13-hello\n")
    tool.chmod(0o755)
    deb = work / "repo" / "c13-hello_1.0_all.deb"
    deb.parent.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(deb)], check=True,
                   capture_output=True)
    return deb


def _flat_repo(repo: Path) -> None:
    """A flat repository (``deb [trusted=yes] http://HOST/ ./``): Packages and an unsigned Release."""
    packages = subprocess.run(["dpkg-scanpackages", "--multiversion", "."], cwd=repo, check=True,
                              capture_output=True).stdout
    (repo / "Packages").write_bytes(packages)
    digest = hashlib.sha256(packages).hexdigest()
    (repo / "Release").write_text(f"Origin: c13\nLabel: c13\nSuite: c13\nCodename: c13\n"
                                  f"SHA256:\n {digest} {len(packages)} Packages\n")


@contextlib.contextmanager
def served(repo: Path) -> Iterator[str]:
    """Serve ``repo`` over HTTP from a new namespace (veth to the host); yields its address."""
    suffix = netns.new_suffix()
    ns, host_if, ns_if = f"c13-{suffix}", f"c13{suffix}h", f"c13{suffix}n"
    a, b = _free_subnet()
    addr = f"10.{a}.{b}.2"
    server: subprocess.Popen[bytes] | None = None
    try:
        netns.create_netns(ns)
        netns.create_veth(host_if, ns_if, ns, f"10.{a}.{b}.1/24", f"{addr}/24", ())
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "http.server", str(PORT),
                                   "--bind", addr, "--directory", str(repo)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((addr, PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.02)
        yield addr
    finally:
        if server is not None:
            server.kill()
            server.wait()
        netns.delete_netns(ns)
        netns.delete_link(host_if)
        assert not netns.netns_exists(ns) and not netns.link_exists(host_if)


def test_apt_get_install_as_root_from_a_repository_the_test_serves(tmp_path: Path) -> None:
    deb = _deb(tmp_path)
    _flat_repo(deb.parent)
    with served(deb.parent) as addr, Sandbox.create(user="root", network="allow", allow=[f"{addr}:{PORT}"],
                        unsafe_allow_ranges=[f"{addr}/32"], disk="256M") as sb:
        made = sb.commands.run(
            "mkdir -p /var/lib/dpkg/info /var/lib/dpkg/updates /var/lib/dpkg/triggers /var/lib/apt/lists/partial"
            " /var/cache/apt/archives/partial /etc/apt/apt.conf.d /etc/apt/preferences.d"
            " /etc/apt/sources.list.d /var/log/apt && touch /var/lib/dpkg/status /var/lib/dpkg/available"
            f" && echo 'deb [trusted=yes] http://{addr}:{PORT}/ ./' > /etc/apt/sources.list")
        assert made.exit_code == 0, made
        # the denied direction first: the sandbox user may not install
        refused = sb.commands.run("apt-get install -y c13-hello", user="user", timeout=60)
        assert refused.exit_code != 0 and "root" in refused.stderr, refused
        update = sb.commands.run("apt-get update", timeout=120)
        assert update.exit_code == 0, update
        install = sb.commands.run("apt-get install -y c13-hello", timeout=120)
        assert install.exit_code == 0, install
        ran = sb.commands.run("c13-hello; stat -c %U /usr/bin/c13-hello; dpkg -s c13-hello | grep Status",
                              user="user")
        assert ran.stdout == "hello from c13-hello\nroot\nStatus: install ok installed\n", ran
    assert not Path("/usr/bin/c13-hello").exists()
    with Sandbox.create() as sb:  # gone with the sandbox
        assert sb.commands.run("command -v c13-hello || test -e /var/lib/dpkg/status").exit_code != 0
