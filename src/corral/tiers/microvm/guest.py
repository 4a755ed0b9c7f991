"""The guest's kernel and initramfs, built once per machine and cached.

The kernel comes from Debian's ``linux-image-amd64`` (the generic flavour:
the ``cloud`` flavour is built without 9p, which the guest needs to share the
image read-only).  ``apt-get download`` fetches the package without
installing it; we keep ``vmlinuz`` and the handful of modules the guest loads.

The initramfs is a plain ``newc`` cpio written here: ``/init`` is
``corral-guestinit`` (compiled from ``guestinit.c``), ``/corral-agent`` the
static agent, ``/modules`` the modules in load order.  Everything is keyed by
content hash so a changed agent or init makes a new initramfs (and so new
templates), never a stale one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ... import progress
from ...errors import HostNotSupported
from ..linux.agent_build import agent_binary

#: what the guest loads, in dependency order (checked against each module's depends=)
MODULES = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/char/virtio_console.ko",
    "drivers/block/virtio_blk.ko",
    "net/9p/9pnet.ko",
    "net/9p/9pnet_virtio.ko",
    "fs/netfs/netfs.ko",
    "fs/fscache/fscache.ko",
    "fs/9p/9p.ko",
    "fs/overlayfs/overlay.ko",
    # the image's disk (rootdisk): libcrc32c needs a crc32c implementation registered
    # first (its init would ask for one through modprobe, which the guest lacks)
    "crypto/crc32c_generic.ko",
    "lib/libcrc32c.ko",
    "fs/erofs/erofs.ko",
    # the virtio-net device every VM has (network="open" gives it a tap)
    "net/core/failover.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko",
)
KERNEL_META_PACKAGE = "linux-image-amd64"
INIT_SOURCE = Path(__file__).with_name("guestinit.c")
#: every file the guest init is built from (the initramfs key hashes them all)
INIT_SOURCES = tuple(INIT_SOURCE.with_name(name) for name in ("guestinit.c", "guest_root.c", "guest_start.c", "guestinit.h"))


def cache_dir() -> Path:
    """Machine-wide cache (kernel, initramfs, templates): shared by every state dir."""
    path = Path(os.environ.get("CORRAL_MICROVM_CACHE", "/var/cache/corral/microvm"))
    path.mkdir(parents=True, exist_ok=True, mode=0o755)
    return path


def sweep_stale_builds(directory: Path, max_age: float = 3600.0) -> None:
    """Remove ``.build-*`` directories a killed builder left (callers hold the cache lock)."""
    if not directory.is_dir():
        return
    for path in directory.glob(".build-*"):
        try:
            if time.time() - path.stat().st_mtime > max_age:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            continue


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Serialize builders across processes (parallel test runs build the same thing once)."""
    with open(cache_dir() / f".{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class GuestAssets:
    kernel: Path
    initrd: Path
    kernel_release: str

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for path in (self.kernel, self.initrd):
            h.update(path.name.encode())
            h.update(str(path.stat().st_size).encode())
        return h.hexdigest()[:16]


def _run(argv: list[str], cwd: Path | None = None) -> str:
    try:
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as exc:
        raise HostNotSupported(f"{argv[0]} is not installed (needed to build the microVM guest)") from exc
    if result.returncode != 0:
        raise HostNotSupported(f"`{' '.join(argv)}` failed: {result.stderr.strip()[-500:]}")
    return result.stdout


def _newest_kernel_package() -> str:
    out = _run(["apt-cache", "depends", KERNEL_META_PACKAGE])
    match = re.search(r"Depends:\s*(linux-image-\S+-amd64)", out)
    if match is None:
        raise HostNotSupported(f"apt knows no kernel behind {KERNEL_META_PACKAGE}; run apt-get update")
    return match.group(1)


def _module_depends(ko: Path) -> list[str]:
    match = re.search(rb"depends=([A-Za-z0-9_,-]*)\0", ko.read_bytes())
    return [d for d in match.group(1).decode().split(",") if d] if match else []


def _complete(kdir: Path) -> bool:
    return all((kdir / "modules" / Path(rel).name).is_file() for rel in MODULES)


def kernel_dir() -> Path:
    """Download and unpack the guest kernel once; returns the cache directory holding it.
    A cached kernel lacking a module MODULES now lists gets it added (modules are only
    ever added, each renamed into place: older code sharing the cache keeps working)."""
    root = cache_dir() / "kernels"
    existing = sorted(p for p in root.glob("*") if (p / "vmlinuz").is_file()) if root.is_dir() else []
    if existing and _complete(existing[-1]):
        return existing[-1]
    with progress.step("fetching the microVM guest kernel (apt-get download)", "first use"), cache_lock("kernel"):
        existing = sorted(p for p in root.glob("*") if (p / "vmlinuz").is_file()) if root.is_dir() else []
        if existing and _complete(existing[-1]):
            return existing[-1]
        package = _newest_kernel_package()
        root.mkdir(parents=True, exist_ok=True)
        sweep_stale_builds(root)
        work = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        try:
            os.chmod(work, 0o755)  # apt's download sandbox user must write here
            _run(["apt-get", "download", package], cwd=work)
            debs = list(work.glob("*.deb"))
            if len(debs) != 1:
                raise HostNotSupported(f"apt-get download {package} produced {len(debs)} packages")
            _run(["dpkg-deb", "-x", str(debs[0]), str(work / "x")])
            vmlinuz = next((work / "x" / "boot").glob("vmlinuz-*"))
            release = vmlinuz.name.removeprefix("vmlinuz-")
            target = work / "out"
            (target / "modules").mkdir(parents=True)
            shutil.copyfile(vmlinuz, target / "vmlinuz")
            module_root = work / "x" / "lib" / "modules" / release / "kernel"
            loaded: set[str] = set()
            for rel in MODULES:
                ko = module_root / rel
                if not ko.is_file():
                    raise HostNotSupported(f"kernel {release} has no module {rel}")
                missing = [d for d in _module_depends(ko) if d not in loaded]
                if missing:
                    raise HostNotSupported(f"module {rel} needs {missing} loaded first; update MODULES")
                shutil.copyfile(ko, target / "modules" / ko.name)
                loaded.add(ko.stem.replace("-", "_"))
                loaded.add(ko.stem)
            (target / "release").write_text(release + "\n")
            final = root / release
            if final.is_dir():
                for module in (target / "modules").iterdir():
                    if not (final / "modules" / module.name).is_file():
                        os.rename(module, final / "modules" / module.name)
            else:
                os.rename(target, final)
            return final
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _compile_init(out: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise HostNotSupported("no C compiler to build the microVM guest init; run `make install`")
    _run([cc, "-O2", "-Wall", "-static", "-o", str(out), *(str(src) for src in INIT_SOURCES if src.suffix == ".c")])


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc archive of (name, mode, data) entries; directories have empty data."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + encoded
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def assets() -> GuestAssets:
    """The kernel and initramfs for the guest, building whatever is missing."""
    kdir = kernel_dir()
    release = (kdir / "release").read_text().strip()
    agent = agent_binary()
    h = hashlib.sha256()
    for path in (agent, *INIT_SOURCES, *sorted((kdir / "modules").iterdir())):
        h.update(path.read_bytes())
    initrd = cache_dir() / "initrd" / f"initrd-{h.hexdigest()[:16]}.cpio"
    if initrd.is_file():
        try:
            os.utime(initrd)  # last use: template pruning keeps what is used
        except OSError:
            pass
        return GuestAssets(kdir / "vmlinuz", initrd, release)
    with progress.step("building the microVM initramfs", "first use, or Corral's guest code changed"), \
            cache_lock("initrd"):
        if initrd.is_file():
            return GuestAssets(kdir / "vmlinuz", initrd, release)
        initrd.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=initrd.parent) as tmp:
            init = Path(tmp) / "init"
            _compile_init(init)
            entries: list[tuple[str, int, bytes]] = [
                (d, 0o40755, b"") for d in ("dev", "proc", "sys", "newroot", "rw", "lower", "modules")
            ]
            entries.append(("init", 0o100755, init.read_bytes()))
            entries.append(("corral-agent", 0o100755, agent.read_bytes()))
            order = []
            for rel in MODULES:
                name = Path(rel).name
                entries.append((f"modules/{name}", 0o100644, (kdir / "modules" / name).read_bytes()))
                order.append(name)
            entries.append(("modules/order", 0o100644, ("\n".join(order) + "\n").encode()))
            staged = Path(tmp) / "initrd.cpio"
            staged.write_bytes(_cpio_newc(entries))
            os.chmod(staged, 0o644)
            os.rename(staged, initrd)
    return GuestAssets(kdir / "vmlinuz", initrd, release)


def cached_assets() -> GuestAssets | None:
    """The assets if already built (no download, no compile): for cheap probes."""
    root = Path(os.environ.get("CORRAL_MICROVM_CACHE", "/var/cache/corral/microvm"))
    kernels = sorted(p for p in (root / "kernels").glob("*") if (p / "vmlinuz").is_file())
    initrds = sorted((root / "initrd").glob("initrd-*.cpio"), key=lambda p: p.stat().st_mtime)
    if not kernels or not initrds:
        return None
    return GuestAssets(kernels[-1] / "vmlinuz", initrds[-1], (kernels[-1] / "release").read_text().strip())
