"""Template VMs: boot once, snapshot, restore many times.

A template is a guest booted to the point where ``corral-guestinit`` waits
for its configuration, saved with QEMU's migration machinery.  Its RAM lives
in a file mapped ``share=on`` while booting, and migration runs with the
``x-ignore-shared`` capability, so the saved device state is tiny and the RAM
file *is* the memory image.  A restored VM maps that file ``share=off``
(``MAP_PRIVATE``): pages are shared with the page cache until the guest
writes them, copy-on-write — no copy of the memory is made.

Templates are immutable, shared by every sandbox on the machine and keyed by
everything that must match for a restore to load: QEMU version, kernel,
initramfs, accelerator, RAM size, machine and device layout — and the image:
the template's guest has the image's disk (rootdisk) mounted under its root
overlay, so there is one template per image and RAM size.

QEMU 7.2 opens a ``share=off`` memory file read-write (it maps it privately,
but the descriptor could write): a QEMU that a guest took over could change
the template every later VM of it starts from.  So a template records its
files' stamps when it is saved (size, inode, change time -- the change time
moves with any write, truncate, chmod or utime, and no unprivileged process
can set it) and :func:`get_template` checks them before every restore: a
template that changed is removed and built again, never restored from.

A template's boot runs the image's own programs (its shell, ``true`` and Python, to fill the page
cache: ``guest_root.c``), and an image's recipe may have installed anything: its QEMU runs as a
VM's does (:func:`confined`), root of a user namespace of a uid range reserved for the boot, in
an empty network namespace, under QEMU's own filter, killed with its builder -- not as host
root, as it did before.  The KVM probe boots no image and stays as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ... import progress
from ...errors import HostNotSupported, SandboxError
from ...host.seccomp import bpf_path
from ...host.uids import allocate_range, process_owner, release_range, release_ranges_of_dead_processes
from ...host.userns import make_userns
from ..linux.agent_build import agent_binary
from . import qemu, vmm
from .guest import GuestAssets, cache_dir, cache_lock, sweep_stale_builds
from .rootdisk import ImageDisk

log = logging.getLogger(__name__)

READY_MARKER = b"corral-guest-ready\n"
#: bump when guestinit's pre-snapshot behaviour or the device layout changes
TEMPLATE_VERSION = "12"  # 8: the egress port "corral-net", loopback up, the relay pre-started; 9: + the image disk;
# 10: + a virtio-net device (network="open"); 11: /home/user is uid 1000's, the agent's default user is told at "go"; 12: files' stamps in meta.json
#: a TCG boot takes ~2 s on an idle core; a loaded shared machine needs slack
BOOT_DEADLINE = 120.0
KVM_PROBE_DEADLINE = 10.0
PR_SET_PDEATHSIG = 1
#: a template nobody restored for this long is deleted when another is built
#: (running VMs keep their private mapping of a deleted RAM file)
UNUSED_TTL = 3600.0


@dataclass(frozen=True)
class Template:
    directory: Path
    ram_mb: int
    accel: str
    boot_ms: float

    @property
    def ram(self) -> Path:
        return self.directory / "ram"

    @property
    def state(self) -> Path:
        return self.directory / "state"


def _key(assets: GuestAssets, accel: str, ram_mb: int, disk: ImageDisk) -> str:
    parts = [TEMPLATE_VERSION, qemu.qemu_version(), assets.digest, accel, str(ram_mb), qemu.MACHINE,
             qemu.kernel_args(accel), disk.key, qemu.cpu_model(accel)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


#: what a template boot's uid range is reserved for (``uids.process_owner``): a builder killed
#: mid-boot leaves it to the next builder or ``gc`` to release
BUILDER_KIND = "microvm-template"


@dataclass(frozen=True)
class Confinement:
    """How a template boot's QEMU runs: root of a user namespace of its own uid range, not host
    root (:func:`confined`)."""

    launcher: list[str]
    #: descriptors QEMU inherits: the namespace's, the image disk's
    fds: tuple[int, ...]
    #: the image disk as QEMU opens it (its inherited descriptor), or None without one
    disk: Path | None


@contextlib.contextmanager
def confined(state_dir: Path, work: Path, accel: str, disk: ImageDisk | None) -> Iterator[Confinement]:
    """A template boot runs the image's shell, ``true`` and Python (``guest_root.c``'s
    warm_page_cache: an image's recipe may have installed anything), under a QEMU that parses all
    the guest's devices send: that QEMU runs as a VM's does (vmm.py) -- root of a user namespace
    of a uid range reserved for the boot, only ``VMM_CAPS`` over it, an empty network namespace,
    QEMU's own seccomp filter, killed with its parent -- never as host root.  ``work`` is its
    while it boots, host root's again after."""
    release_ranges_of_dead_processes(state_dir)
    owner = process_owner(BUILDER_KIND)
    ids = allocate_range(state_dir, owner)
    try:
        agent = agent_binary(state_dir)
        userns = make_userns(agent, ids)
        image = os.open(disk.path, os.O_PATH | os.O_CLOEXEC) if disk is not None else None
        try:
            for path in (work, work / "empty"):
                os.chown(path, ids.base, ids.base)
            yield Confinement(vmm.launcher(agent, userns, accel, bpf_path(state_dir), die_with_parent=True),
                              (userns, *([image] if image is not None else [])),
                              vmm.fd_path(image) if image is not None else None)
        finally:
            for fd in (userns, image):
                if fd is not None:
                    os.close(fd)
            for path in (work, *work.iterdir()):
                os.lchown(path, 0, 0)
    finally:
        release_range(state_dir, ids.base, owner=owner)


def _boot(work: Path, assets: GuestAssets, accel: str, ram_mb: int, deadline: float, disk: ImageDisk | None,
          confinement: Confinement | None = None) -> tuple[subprocess.Popen[bytes], qemu.QMP, float]:
    """Boot a guest to its ready marker with RAM in ``work/ram`` (shared); returns (proc, qmp, boot seconds).
    Without a disk (the KVM probe) the guest skips its root and only says it is ready."""
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    paths = qemu.VMPaths(work / "agent.sock", work / "qmp.sock", work / "console.log", work / "egress.sock")
    image = confinement.disk if confinement is not None else (disk.path if disk else None)
    argv = qemu.command_line(
        accel=accel, ram_mb=ram_mb, mem_path=work / "ram", share=True, assets=assets, paths=paths,
        disk=image, workspace=empty, workspace_readonly=False, confined=confinement is not None,
    )
    if confinement is not None:
        argv = [*confinement.launcher, *argv]
    start = time.monotonic()
    with open(work / "qemu.log", "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                pass_fds=confinement.fds if confinement is not None else (),
                                preexec_fn=_die_with_parent)
    try:
        qmp = qemu.QMP(qemu.connect_unix(paths.qmp_socket, deadline, proc), timeout=30)
        agent = qemu.connect_unix(paths.agent_socket, deadline, proc)
        seen = b""
        agent.settimeout(0.2)
        while READY_MARKER not in seen:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SandboxError("the guest did not reach its ready marker: " + _tail(work))
            try:
                chunk = agent.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                time.sleep(0.01)
            seen += chunk
        agent.close()
        return proc, qmp, time.monotonic() - start
    except OSError as exc:
        proc.kill()
        proc.wait()
        raise SandboxError(f"QEMU failed while booting the guest ({exc}): " + _tail(work)) from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _die_with_parent() -> None:
    # a builder killed mid-boot must not leave its QEMU running: this VM is in no
    # sandbox's cgroup, so no janitor would find it (the calling thread waits for
    # the boot, so it cannot end first)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(work: Path) -> str:
    return qemu.log_tail(work / "qemu.log", work / "console.log", limit=600)


def get_template(assets: GuestAssets, accel: str, ram_mb: int, disk: ImageDisk, state_dir: Path) -> Template:
    """The template for this configuration and image, booting and saving it the first time."""
    root = cache_dir() / "templates"
    final = root / _key(assets, accel, ram_mb, disk)
    meta = final / "meta.json"
    if not meta.is_file():
        with progress.step(f"booting a microVM template ({ram_mb} MiB, {accel})",
                           "first use of this image and memory size; saved for later restores"), \
                cache_lock("template"):
            if not meta.is_file():
                _build(final, assets, accel, ram_mb, disk, state_dir)
    info = json.loads(meta.read_text())
    changed = tampered(final, info)
    if changed:
        with cache_lock("template"):
            info = json.loads(meta.read_text()) if meta.is_file() else {}
            if not info or tampered(final, info):  # not already rebuilt by another process
                log.warning("microVM template %s changed since it was saved (%s): removed, built again",
                            final.name, changed)
                shutil.rmtree(final)  # VMs running from it keep their private mapping
                with progress.step(f"booting a microVM template ({ram_mb} MiB, {accel})",
                                   "the saved one changed on disk"):
                    _build(final, assets, accel, ram_mb, disk, state_dir)
                info = json.loads(meta.read_text())
    try:
        os.utime(meta)  # last use, for pruning
    except OSError:
        pass
    return Template(final, ram_mb, accel, float(info["boot_ms"]))


#: a template's files whose stamps it records (the RAM is what QEMU holds writable)
STAMPED = ("ram", "state")


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_ctime_ns]


def tampered(directory: Path, info: dict[str, object]) -> str | None:
    """What changed in a saved template's files since it was saved (None: nothing)."""
    stamps = info.get("stamps")
    if not isinstance(stamps, dict):
        return "no stamps recorded"
    for name in STAMPED:
        try:
            now = _stamp(directory / name)
        except OSError as exc:
            return f"{name}: {exc.strerror}"
        if stamps.get(name) != now:
            return f"{name}: size, inode or change time differs"
    return None


def _prune(root: Path, keep: Path, initrd: Path) -> None:
    """Delete templates (and initramfs images none of them uses) unused for UNUSED_TTL."""
    now = time.time()
    in_use = {initrd.name}
    for directory in root.iterdir():
        if directory.name.startswith(".") or directory == keep:
            continue
        meta = directory / "meta.json"
        try:
            if now - meta.stat().st_mtime > UNUSED_TTL:
                shutil.rmtree(directory, ignore_errors=True)
                continue
            in_use.add(json.loads(meta.read_text()).get("initrd", ""))
        except (OSError, ValueError):
            continue
    initrds = cache_dir() / "initrd"
    for image in initrds.glob("initrd-*.cpio"):
        try:
            if image.name not in in_use and now - image.stat().st_mtime > UNUSED_TTL:
                image.unlink()
        except OSError:
            continue


def _build(final: Path, assets: GuestAssets, accel: str, ram_mb: int, disk: ImageDisk, state_dir: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_builds(final.parent)
    _prune(final.parent, keep=final, initrd=assets.initrd)
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    try:
        (work / "empty").mkdir()
        with confined(state_dir, work, accel, disk) as confinement:
            proc, qmp, boot_seconds = _boot(work, assets, accel, ram_mb, time.monotonic() + BOOT_DEADLINE, disk,
                                            confinement)
            state = os.open(work / "state", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                qmp.command("stop")
                qmp.command("migrate-set-capabilities",
                            capabilities=[{"capability": "x-ignore-shared", "state": True}])
                qmp.send_fd("state", state)  # QEMU may spawn nothing (its filter): no exec: URI
                qmp.command("migrate", uri="fd:state")
                qmp.wait_migration(time.monotonic() + 60)
                qmp.command("quit")
                proc.wait(timeout=30)
            finally:
                os.close(state)
                qmp.close()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for name in ("agent.sock", "qmp.sock", "egress.sock", "qemu.log", "console.log"):
            (work / name).unlink(missing_ok=True)
        (work / "empty").rmdir()
        for path in work.iterdir():
            os.chmod(path, 0o644)
        # stamped after the last chmod (a chmod moves the change time); a rename of the directory does not
        (work / "meta.json").write_text(json.dumps({
            "boot_ms": round(boot_seconds * 1000, 1), "accel": accel, "ram_mb": ram_mb,
            "qemu": qemu.qemu_version(), "kernel": assets.kernel_release, "initrd": assets.initrd.name,
            "disk": disk.key, "stamps": {name: _stamp(work / name) for name in STAMPED},
        }))
        os.chmod(work / "meta.json", 0o644)
        os.chmod(work, 0o755)
        os.rename(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def probe_kvm(assets: GuestAssets) -> tuple[bool, str]:
    """Can this host really run a guest under KVM?  Boots one to its marker (cached per host boot)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    cache = cache_dir() / "kvm-probe.json"
    key = f"{TEMPLATE_VERSION} {boot_id} {qemu.qemu_version()} {assets.digest} {qemu.MACHINE} {qemu.kernel_args('kvm')}"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return bool(cached["ok"]), str(cached["reason"])
    except (OSError, ValueError, KeyError):
        pass
    with cache_lock("kvm-probe"), tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".kvm-probe-") as tmp:
        work = Path(tmp)
        try:
            proc, qmp, seconds = _boot(work, assets, "kvm", 128, time.monotonic() + KVM_PROBE_DEADLINE, None)
        except (SandboxError, HostNotSupported) as exc:
            detail = _tail(work).splitlines()
            first = next((line for line in detail if "KVM" in line or "kvm" in line), detail[0] if detail else "")
            ok, reason = False, f"a KVM guest did not boot ({first.strip()[:160] or exc})"
        else:
            qmp.close()
            proc.kill()
            proc.wait()
            ok, reason = True, f"a KVM guest booted to its marker in {seconds * 1000:.0f} ms"
    cache.write_text(json.dumps({"key": key, "ok": ok, "reason": reason}))
    return ok, reason
