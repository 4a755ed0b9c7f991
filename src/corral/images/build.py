"""Build an image from a recipe, all or nothing.

Steps, each with its own log:

1. ``bootstrap``: mmdebstrap installs the suite's essential set and the apt
   packages from Debian (signed archives, maintainer scripts in a chroot in a
   private mount namespace) — or ``copy``: a copy of the ``from`` image;
2. ``pip download`` / ``npm fetch`` on the host, fetching only (wheels only,
   ``--ignore-scripts``): no package code runs on the host;
3. ``files``: the recipe's files are copied in;
4. ``pip install`` and each ``run`` command, inside a build sandbox
   (:mod:`.buildbox`) with no network: they install what step 2 fetched.

Everything happens in a staging directory that is renamed to the image's
digest only when every step succeeded; on any failure or interrupt the
staging directory is removed and the failing step's log is kept under
``failed/``.  A build killed outright leaves a staging directory that the
next build or ``corral image prune`` removes (its owner lock is free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ImageBuildFailed, InvalidSpec
from ..host import logs
from ..host.openat2 import UnsafeFile, read_in_tree
from . import aptplan, image_id_files, layering, store
from .buildbox import BuildBox
from .copyin import CopyIn
from .recipe import Recipe, builtin_path
from .recipe import load as load_recipe

WHEELS_POINT = "/.corral-build/wheels"
DEBS_POINT = "/.corral-build/debs"
#: the most of an image's dpkg database read on the host (Debian's full desktop: ~10 MiB)
DPKG_STATUS_LIMIT = 64 << 20
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
_DPKG_EXCLUDES = ["/usr/share/man/*", "/usr/share/doc/*", "/usr/share/info/*", "/usr/share/locale/*",
                  "/usr/share/lintian/*"]


@dataclass
class BuildEvent:
    """Progress of a build, for progress bars."""

    step: str
    index: int
    total: int
    packages: int = 0
    bytes: int = 0
    done: bool = False
    message: str = ""
    #: the image being built (a built-in parent is built first, reporting its own name)
    image: str = ""


ProgressCallback = Callable[[BuildEvent], None]


@dataclass(frozen=True)
class BuildResult:
    record: store.ImageRecord
    #: False when an image with this digest already existed (nothing was built)
    built: bool
    seconds: float


def parent_digest(recipe: Recipe, root: Path) -> str:
    if not recipe.base_image:
        return ""
    parent = store.lookup(recipe.base_image, root)
    if parent is None:
        raise InvalidSpec(f"recipe {recipe.name!r} starts from image {recipe.base_image!r}, which is not built; "
                          f"run `corral image build {recipe.base_image}` first")
    return parent.digest


def build(recipe: Recipe, state_dir: Path, *, force: bool = False, progress: ProgressCallback | None = None,
          root: Path | None = None) -> BuildResult:
    """Build ``recipe`` unless an image with its digest exists; tag it with the recipe's name."""
    started = time.monotonic()
    root = root or store.image_dir()
    mode = root.stat().st_mode
    if mode & 0o011 != 0o011:  # build steps run as an unprivileged uid that must reach <root>/.build-*/rootfs
        os.chmod(root, (mode & 0o7777) | 0o011)
    if recipe.base_image and store.lookup(recipe.base_image, root) is None and builtin_path(recipe.base_image):
        build(load_recipe(recipe.base_image), state_dir, progress=progress, root=root)  # a built-in parent
    digest = recipe.digest(parent_digest(recipe, root))
    existing = store.record(root, digest)
    if existing is not None and not force:
        store.set_name(root, recipe.name, digest)
        return BuildResult(store.record(root, digest) or existing, False, time.monotonic() - started)
    with store.digest_lock(root, digest):
        store.remove_leftovers(root, digest)
        # and what killed builds of other images left (a staging dir can hold a whole rootfs)
        store.remove_leftovers(root, min_age=store.STALE_BUILD_AGE)
        existing = store.record(root, digest)
        if existing is not None and force:
            store.delete_image(root, existing, locked=True)
        elif existing is not None:
            store.set_name(root, recipe.name, digest)
            return BuildResult(existing, False, time.monotonic() - started)
        _Builder(recipe, digest, root, state_dir, progress).run()
    store.set_name(root, recipe.name, digest)
    rec = store.record(root, digest)
    assert rec is not None
    return BuildResult(rec, True, time.monotonic() - started)


class _Builder:
    def __init__(self, recipe: Recipe, digest: str, root: Path, state_dir: Path,
                 progress: ProgressCallback | None) -> None:
        self.recipe, self.digest, self.root, self.state_dir = recipe, digest, root, state_dir
        self.progress = progress or (lambda event: None)
        self.steps = self._plan()
        self.staging = Path(tempfile.mkdtemp(dir=root, prefix=f".build-{store.hex_of(digest)[:12]}-"))
        self.rootfs = self.staging / "rootfs"
        self.logs = self.staging / "logs"
        self.step_index = 0
        self.started = time.monotonic()
        self.box: BuildBox | None = None
        self.parent_rootfs: Path | None = None  # set while building on an overlay over the parent
        self._apt_plan: list[aptplan.Action] = []  # set by the apt download step

    def _plan(self) -> list[str]:
        r = self.recipe
        steps = ["layer" if r.base_image else "bootstrap"]
        steps += ["apt download", "apt install"] if r.base_image and r.apt else []
        steps += ["pip download"] if r.pip else []
        steps += ["npm fetch"] if r.npm else []
        steps += ["files"] if r.files else []
        steps += ["pip install"] if r.pip else []
        steps += [f"run {i + 1}" for i in range(len(r.run))]
        return [*steps, "finalize"]

    def run(self) -> None:
        owner = os.open(self.staging / "owner.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(owner, fcntl.LOCK_EX)
        current = "setup"
        try:
            os.chmod(self.staging, 0o711)  # the build uid must reach rootfs/
            self.logs.mkdir()
            for step in self.steps:
                current = step
                if step == "finalize":
                    self._close_box()
                self._step(step)
            # only root (and mounts root makes) reaches a built image: nothing of a build's, such as a
            # set-id file a step made, is ever run from the store by another host user
            os.chmod(self.staging, 0o700)
            os.rename(self.staging, self.root / store.hex_of(self.digest))
        except BaseException as exc:
            self._close_box()
            log = self._keep_log(current)
            store.remove_tree(self.staging)
            if isinstance(exc, ImageBuildFailed):
                raise
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise ImageBuildFailed(f"image {self.recipe.name!r}: step {current!r} failed: {exc}"
                                   + (f" (log: {log})" if log else ""), current, log) from exc
        finally:
            os.close(owner)
        (self.root / store.hex_of(self.digest) / "owner.lock").unlink(missing_ok=True)

    def _close_box(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            box.close()  # kills what is left, hands the image back to root

    def _keep_log(self, step: str) -> str:
        log = self.logs / f"{_slug(step)}.log"
        if not log.is_file():
            return ""
        failed = self.root / "failed"
        failed.mkdir(mode=0o700, exist_ok=True)
        kept = failed / f"{self.recipe.name}-{store.hex_of(self.digest)[:12]}-{_slug(step)}.log"
        shutil.copyfile(log, kept)  # (bounded: a step's log is, buildbox.STEP_LOG_MOST)
        return str(kept)

    def _event(self, step: str, **kw: object) -> None:
        self.progress(BuildEvent(step, self.step_index, len(self.steps), image=self.recipe.name,
                                 **kw))  # type: ignore[arg-type]

    def _step(self, step: str) -> None:
        self.step_index += 1
        self._event(step)
        log = self.logs / f"{_slug(step)}.log"
        if step == "bootstrap":
            self._bootstrap(log)
        elif step == "layer":
            self._layer_on_parent(log)
        elif step == "apt download":
            self._apt_download(log)
        elif step == "apt install":
            # dpkg as uid 0 of the build's user namespace; maintainer scripts run confined like any
            # step, in the order apt planned on the host (see aptplan)
            self._in_sandbox(step, log, aptplan.dpkg_script(self._apt_plan, DEBS_POINT))
        elif step == "pip download":
            self._host_command(step, log, [sys.executable, "-P", "-m", "pip", "download", "--only-binary=:all:",
                                           "--dest", str(self.staging / "wheels"), "--no-cache-dir",
                                           "--progress-bar", "off", "pip", *self.recipe.pip])
        elif step == "npm fetch":
            self._npm_fetch(log)
        elif step == "files":
            self._copy_files()
        elif step == "pip install":
            self._in_sandbox(step, log, _pip_install_command(self.recipe.pip))
        elif step.startswith("run "):
            self._in_sandbox(step, log, self.recipe.run[int(step.split()[1]) - 1])
        elif step == "finalize":
            self._finalize()
        self._event(step, done=True, bytes=_tree_size(self.rootfs) if step == "finalize" else 0)

    # -- steps -------------------------------------------------------------
    def _bootstrap(self, log: Path) -> None:
        mmdebstrap = shutil.which("mmdebstrap")
        if mmdebstrap is None:
            raise ImageBuildFailed("mmdebstrap is not installed: apt-get install mmdebstrap (or `make install`)",
                                   "bootstrap")
        cache = self.root / "apt-cache"
        cache.mkdir(mode=0o700, exist_ok=True)
        argv = ["unshare", "--mount", "--propagation", "private", "--", mmdebstrap, "--mode=root",
                "--variant=essential", "--verbose", "--skip=essential/unlink",
                "--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives && "
                f"cp -a {cache}/. \"$1\"/var/cache/apt/archives/",
                f"--customize-hook=cp -a \"$1\"/var/cache/apt/archives/. {cache}/ && rm -f {cache}/lock",
                "--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/lib/apt/lists/*"]
        for pattern in _DPKG_EXCLUDES:
            argv.append(f"--dpkgopt=path-exclude={pattern}")
        argv.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
        if self.recipe.apt:
            argv.append("--include=" + ",".join(self.recipe.apt))
        argv += [self.recipe.suite, str(self.rootfs), self.recipe.mirror]
        counted: set[str] = set()

        def on_line(line: str) -> None:
            if line.startswith("Setting up "):
                counted.add(line.split()[2])
                self._event("bootstrap", packages=len(counted), bytes=_dir_bytes_cached(self.rootfs))

        self._host_command("bootstrap", log, argv, on_line)

    def _layer_on_parent(self, log: Path) -> None:
        parent = store.lookup(self.recipe.base_image or "", self.root)
        if parent is None or parent.digest != parent_digest(self.recipe, self.root):
            raise ImageBuildFailed(f"image {self.recipe.base_image!r} changed or vanished during the build", "layer")
        meta = store.read_meta(parent.path)
        if self.recipe.apt and meta.get("suite", self.recipe.suite) != self.recipe.suite:
            raise ImageBuildFailed(f"image {parent.names} is {meta.get('suite')}, apt packages are resolved "
                                   f"against {self.recipe.suite}", "layer")
        self.recipe = dataclasses.replace(self.recipe, mirror=str(meta.get("mirror", self.recipe.mirror)))
        try:
            layering.mount_derived(parent.rootfs, self.staging / "upper", self.staging / "work", self.rootfs)
            self.parent_rootfs = parent.rootfs
            log.write_text(f"overlay on {parent.rootfs} (metacopy); unchanged files will be hard links\n")
        except OSError as exc:  # no metacopy here: a full copy does the same, slower
            for sub in ("upper", "work", "rootfs"):
                shutil.rmtree(self.staging / sub, ignore_errors=True)
            log.write_text(f"overlay unavailable ({exc}); copying the parent\n")
            self._host_command("layer", log, ["cp", "-a", "--reflink=auto", str(parent.rootfs), str(self.rootfs)])

    def _apt_download(self, log: Path) -> None:
        """Resolve the packages against the parent's dpkg database and download them (nothing runs)."""
        if not DEBIAN_KEYRING.is_file():
            raise ImageBuildFailed(f"{DEBIAN_KEYRING} is missing: apt-get install debian-archive-keyring", "apt download")
        work = self.staging / "apt"
        for sub in ("lists/partial", "archives/partial", "parts", "prefs"):
            (work / sub).mkdir(parents=True)
        os.chmod(work, 0o755)
        os.chmod(work / "archives", 0o755)
        (work / "sources.list").write_text(
            f"deb [signed-by={DEBIAN_KEYRING}] {self.recipe.mirror} {self.recipe.suite} main\n")
        # apt reads a copy: the parent's own file, read by host apt as root, could be a link or a fifo
        (work / "status").write_bytes(self._dpkg_status("apt download"))
        options = {
            "Dir::State::status": str(work / "status"),
            "Dir::State::Lists": str(work / "lists"),
            "Dir::Cache::archives": str(work / "archives"),
            "Dir::Cache::pkgcache": "", "Dir::Cache::srcpkgcache": "",
            "Dir::Etc::SourceList": str(work / "sources.list"), "Dir::Etc::SourceParts": str(work / "parts"),
            "Dir::Etc::Preferences": "/dev/null", "Dir::Etc::PreferencesParts": str(work / "prefs"),
            "Dir::Log": str(work), "APT::Install-Recommends": "false", "Debug::NoLocking": "true",
            "APT::Sandbox::User": "root", "Acquire::Languages": "none",
        }
        argv = ["apt-get", "-q"] + [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]
        self._host_command("apt download", log, [*argv, "update"])
        counted: list[str] = []

        def on_line(line: str) -> None:
            if line.startswith("Get:"):
                counted.append(line)
                self._event("apt download", packages=len(counted))

        self._host_command("apt download", log, [*argv, "-y", "--download-only", "install", *self.recipe.apt],
                           on_line)
        # the order dpkg must follow: one `dpkg -i` of every file breaks Pre-Depends (systemd-sysv
        # pre-depends on systemd, which chromium pulls in through libpam-systemd)
        simulated = subprocess.run([*argv, "-s", "install", *self.recipe.apt], stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        with open(log, "a") as out:
            out.write(simulated.stdout + simulated.stderr)
        if simulated.returncode != 0:
            message, kept = self._failure("apt download", f"apt-get -s exited with {simulated.returncode}", log)
            raise ImageBuildFailed(message, "apt download", kept)
        self._apt_plan = aptplan.plan(simulated.stdout, work / "archives")

    def _npm_fetch(self, log: Path) -> None:
        npm = shutil.which("npm")
        if npm is None:
            raise ImageBuildFailed("npm packages need npm on the host to fetch them: apt-get install npm", "npm fetch")
        prefix = self.staging / "npm"
        prefix.mkdir()
        # --ignore-scripts: fetch and unpack only, no package code runs on the host
        self._host_command("npm fetch", log, [npm, "install", "--global", "--prefix", str(prefix), "--ignore-scripts",
                                              "--no-audit", "--no-fund", "--no-update-notifier",
                                              *self.recipe.npm])
        with self._copy_in("npm fetch") as copy_in:
            for src_sub in ("lib/node_modules", "bin"):
                if (prefix / src_sub).is_dir():
                    copy_in.tree(prefix / src_sub, f"usr/local/{src_sub}")

    def _copy_files(self) -> None:
        with self._copy_in("files") as copy_in:
            for copy in self.recipe.files:
                if copy.src.is_dir():
                    copy_in.tree(copy.src, copy.dest)
                else:
                    copy_in.file(copy.src, copy.dest,
                                 copy.mode if copy.mode is not None else copy.src.stat().st_mode & 0o755)

    @contextlib.contextmanager
    def _copy_in(self, step: str) -> Iterator[CopyIn]:
        """Writes into the image from the host (:mod:`.copyin`); a link there that leads nowhere in
        the image, or something else where a directory is needed, fails the step naming it."""
        try:
            with CopyIn(self.rootfs) as copy_in:
                yield copy_in
        except UnsafeFile as exc:
            raise ImageBuildFailed(f"image {self.recipe.name!r}: step {step!r}: its /{exc.filename} is "
                                   f"{exc.strerror}; nothing is written outside the image", step) from None

    def _in_sandbox(self, step: str, log: Path, command: str) -> None:
        if self.box is None:  # one box for every sandboxed step: the image is handed over once
            binds = {WHEELS_POINT: self.staging / "wheels"} if self.recipe.pip else {}
            if self.recipe.base_image and self.recipe.apt:
                binds[DEBS_POINT] = self.staging / "apt" / "archives"
            self.box = BuildBox(self.rootfs, self.state_dir, self.recipe.build_memory, binds)
        code, stopped = self.box.run(command, log, self.recipe.build_timeout)
        if code != 0 or stopped:
            why = stopped or f"exited with {code}"
            message, kept = self._failure(step, why, log)
            raise ImageBuildFailed(message, step, kept)

    def _host_command(self, step: str, log: Path, argv: list[str],
                      on_line: Callable[[str], None] | None = None) -> None:
        with open(log, "ab") as out:
            out.write(("$ " + " ".join(argv) + "\n").encode())
            out.flush()
            # in the build's own directory, not the caller's (a module there could shadow pip's)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=self.staging,
                                    env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            assert proc.stdout is not None
            timer = threading.Timer(self.recipe.build_timeout, _kill_group, (proc,))
            timer.start()
            try:
                for raw in proc.stdout:
                    out.write(raw)
                    if on_line is not None:
                        on_line(raw.decode(errors="replace"))
                code = proc.wait()
            except BaseException:
                _kill_group(proc)
                proc.wait()
                raise
            finally:
                timer.cancel()
        if code != 0:
            message, kept = self._failure(step, f"exited with {code}", log)
            raise ImageBuildFailed(message, step, kept)

    def _failure(self, step: str, why: str, log: Path) -> tuple[str, str]:
        """The error message (with the log's tail) and the path of the kept log."""
        kept = self._keep_log(step)
        tail = _tail_lines(log, 15)
        return (f"image {self.recipe.name!r}: step {step!r} {why}; log: {kept or log}\n"
                + "\n".join("    " + line for line in tail)), kept

    def _dpkg_status(self, step: str) -> bytes:
        """The image's dpkg database (empty if it has none), read on the host from a tree build
        commands wrote (:func:`corral.host.openat2.read_in_tree`): by name, a fifo there hung the
        build past its ``build_timeout`` (which bounds only sandboxed steps), and a link read
        whatever host file it named."""
        try:
            return read_in_tree(self.rootfs, "var/lib/dpkg/status", DPKG_STATUS_LIMIT)
        except FileNotFoundError:
            return b""
        except UnsafeFile as exc:
            raise ImageBuildFailed(f"image {self.recipe.name!r}: its /var/lib/dpkg/status is {exc.strerror}",
                                   step) from None

    def _finalize(self) -> None:
        shutil.rmtree(self.staging / "wheels", ignore_errors=True)
        shutil.rmtree(self.staging / "npm", ignore_errors=True)
        for sub in ("dev", "proc", "sys", "run", "tmp"):
            path = self.rootfs / sub
            if path.is_dir() and not path.is_symlink():
                for entry in path.iterdir():  # mmdebstrap leaves device nodes; sandboxes get their own
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
        if self.parent_rootfs is not None:
            final = self.staging / "rootfs.final"
            layering.materialize(self.rootfs, self.staging / "upper", self.parent_rootfs, final)
            for sub in ("upper", "work"):
                shutil.rmtree(self.staging / sub)
            self.rootfs.rmdir()
            os.rename(final, self.rootfs)
        os.chmod(self.rootfs, 0o755)
        status = self._dpkg_status("finalize").decode(errors="replace")
        packages = status.count("\nStatus: install ok installed") + status.startswith("Status: install ok installed")
        try:  # every create reads these on the host: refused here, the image is never stored
            image_id_files(self.rootfs)
        except UnsafeFile as exc:
            raise ImageBuildFailed(f"image {self.recipe.name!r}: its /{exc.filename} is {exc.strerror}; "
                                   "the identity files must be regular files", "finalize") from None
        store.write_json_atomic(self.staging / "image.json", {
            "digest": self.digest,
            "recipe": str(self.recipe.source or self.recipe.name),
            "name": self.recipe.name,
            "created": time.time(),
            "size": _tree_size(self.rootfs),
            "packages": packages,
            "suite": self.recipe.suite,
            "mirror": self.recipe.mirror,
            "build_seconds": round(time.monotonic() - self.started, 1),
        })


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a host step's whole process group (it was started in a new session), so apt and dpkg
    under mmdebstrap die with it. Only called before ``proc`` is reaped: its pid, hence the group id,
    cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pip_install_command(requirements: tuple[str, ...]) -> str:
    import shlex

    # pip runs from its own wheel: the image needs no python3-pip, and nothing is fetched
    return (f"set -e; PIP=$(ls {WHEELS_POINT}/pip-*.whl | head -n1); "
            f"python3 \"$PIP/pip\" install --no-index --find-links {WHEELS_POINT} --break-system-packages "
            f"--root-user-action=ignore --no-cache-dir --no-warn-script-location "
            + " ".join(shlex.quote(r) for r in requirements))


def _tail_lines(log: Path, count: int, limit: int = 8192, width: int = 400) -> list[str]:
    """The last ``count`` lines of ``log`` for an error message, from its last ``limit`` bytes,
    each cut at ``width`` characters: read whole, a failed step's 500 MB took the builder to 4.9 GB
    and its one long line went into the message (helper 91)."""
    lines = logs.tail(log, limit).strip().splitlines()[-count:]
    return [line if len(line) <= width else line[:width] + " ..." for line in lines]


def _slug(step: str) -> str:
    return step.replace(" ", "-")


def _tree_size(path: Path) -> int:
    total = 0
    seen: set[int] = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


_size_cache: dict[Path, tuple[float, int]] = {}


def _dir_bytes_cached(path: Path) -> int:
    """The size of a growing tree, recomputed at most every 2 s (progress only)."""
    now = time.monotonic()
    last = _size_cache.get(path)
    if last is None or now - last[0] > 2.0:
        try:
            size = _tree_size(path) if path.is_dir() else 0
        except OSError:
            size = last[1] if last else 0
        last = (now, size)
        _size_cache[path] = last
    return last[1]
