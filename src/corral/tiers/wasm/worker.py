"""The wasm tier's worker: one process per command, running one WASI guest.

Run as a script (``python -s -E worker.py zygote CACHE PARENT_PID SOCKET_FD``;
``run`` starts a single worker without a zygote).  It imports only the
standard library and wasmtime, so that it starts fast and its failure modes
are few.

Why a process per command, not a thread in the caller: a guest blocked in a
host call (``time.sleep`` is a blocking ``poll_oneoff``) cannot be interrupted
by an epoch tick, and a wasmtime crash or a runaway allocation must not take
the caller down.  A process can always be SIGKILLed and placed in a cgroup.

Life of a worker::

    zygote: import wasmtime, deserialize the cached module, leave the host's network and
            file system (an empty root: _enter_empty_root), wait for requests
    -> fork on request -> "ready" on the control socket -> (waits, as an idle worker)
    <- one job (argv, env, preopens, limits, uid, seccomp)  -> open its directories through
       the host's root, let go of that -> drop privileges
    -> "started" -> run the guest's _start -> "exit" with code/trap -> exit
    (a job with "wait": the guest starts and reads its command from stdin;
    the timeout clock starts on a later "go")

The guest's stdin, stdout and stderr are the worker's own fds 0, 1, 2:
pipes the host reads and writes directly, so output streams as produced.

``compile WASM OUT`` compiles a module and writes it serialized (atomically).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

#: changes whenever the engine configuration below changes: part of the cache key,
#: because a serialized module only loads into an engine configured the same way
ENGINE_CONFIG_ID = "fuel+epoch/v1"
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SYS_SECCOMP = 317 if os.uname().machine == "x86_64" else 277  # x86-64, else arm64
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _load_seccomp(program: bytes) -> None:
    """Load the BPF program Corral's other tiers use (a deny list of kernel attack
    surface: mount, ptrace, bpf, namespaces, ...) on every thread of this worker:
    if the guest ever broke out of wasmtime, it would still be held by it."""
    libc = ctypes.CDLL(None, use_errno=True)
    prog = _SockFprog(len(program) // 8, program)
    result = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog))
    if result != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter could not be loaded")


def make_engine() -> Any:
    import wasmtime

    config = wasmtime.Config()
    config.consume_fuel = True
    config.epoch_interruption = True
    # wasmtime's own on-disk cache stays off (its default): we keep the one cache
    return wasmtime.Engine(config)


def compile_module(wasm_path: str, out_path: str) -> None:
    import wasmtime

    module = wasmtime.Module.from_file(make_engine(), wasm_path)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(module.serialize())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _drop_privileges(uid: int | None, gid: int | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if uid is not None and gid is not None and os.geteuid() == 0:
        parent = os.getppid()
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # the change of ids cleared the parent-death signal: without it again, a guest whose
        # owner was killed ran on (a busy loop for good, a timeout nobody enforced) until gc
        _die_with_parent(parent)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _send(control: socket.socket, message: dict[str, Any]) -> None:
    control.sendall(json.dumps(message).encode() + b"\n")


def _read_message(reader: Any) -> dict[str, Any] | None:
    line = reader.readline()
    if not line.endswith(b"\n"):
        return None  # the host closed the socket: it gave up on this worker
    message: dict[str, Any] = json.loads(line)
    return message


def _arm_on_go(reader: Any, timer_for: Any, marks: dict[str, Any]) -> None:
    """A pre-started guest waits for its command; the timeout starts when the host says go."""
    message = _read_message(reader)
    if message is None:
        os._exit(0)
    marks["go"] = os.times()
    timer_for(float(message["go"])).start()


def _memory_size(instance: Any, store: Any) -> int:
    try:
        memory = instance.exports(store)["memory"]
        return int(memory.data_len(store))
    except Exception:
        return 0


def _load(cache_path: str) -> tuple[Any, Any, Any]:
    import wasmtime

    engine = make_engine()
    module = wasmtime.Module.deserialize_file(engine, cache_path)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    return engine, module, linker


#: unshare(2)'s flags for a new network and a new mount namespace
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REC, MS_PRIVATE = 0x4000, 0x40000
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155 if os.uname().machine == "x86_64" else 41
SYS_OPENAT2 = 437  # the same number on every architecture
RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 0x02, 0x10


def _leave_host_network() -> None:
    """Move into a network namespace of our own, empty (its loopback down), before any guest runs.

    A guest has no sockets (WASI preview 1), but a worker one took over through a flaw in
    wasmtime would otherwise reach what the host's namespace reaches: its loopback services, the
    metadata address, the LAN.  Workers get everything they use as descriptors.  Only root makes
    one here (the zygote and every worker it forks share it); unprivileged, the workers run as
    their owner, with their owner's reach, as before."""
    if os.geteuid() != 0:
        return
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "cannot leave the host's network namespace")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _open_in(root: int | None, path: str, flags: int) -> int:
    """Open ``path`` (absolute, a host path) as the host sees it.

    ``root`` is a descriptor of the host's root opened before this process left the host's mount
    namespace (see _enter_empty_root), or None in a worker that never left it.  RESOLVE_IN_ROOT
    makes an absolute symlink on the way resolve against the host's root, as it does for the host."""
    if root is None:
        return os.open(path, flags)
    libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = int(libc.syscall(SYS_OPENAT2, root, path.encode(), ctypes.byref(how), ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _enter_empty_root(anchor: str) -> int | None:
    """Leave the host's file system: a mount namespace of our own whose root is an empty, read-only
    tmpfs, with every host mount detached from it.  Returns a descriptor of the host's root.

    A guest has no path out of its preopened directories, but a worker taken over through a flaw
    in wasmtime would otherwise read whatever its uid may on the host: every world-readable file
    (other users' homes, /etc, the state directory's records, other owners' workspaces).  Nothing
    the worker does after a job arrives needs a path: wasmtime, Python's modules and the compiled
    module are mapped already, the guest's directories and the seccomp program are opened through
    the returned descriptor (a descriptor opened before unshare names the host's namespace, so new
    sandboxes' mounts are seen) and each worker closes it before it takes its sandbox's uid.  The
    zygote does this once (each worker only inherits it: no copy of the mount table per command),
    after loading everything, at ``anchor``: a directory that exists (the module cache's), hidden
    by the tmpfs in our namespace only.  Root only, as the network namespace."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        # glibc dlopens libgcc_s when a thread exits (a timer thread does): wasmtime has it mapped
        # already, and holding it here keeps that true after the files are gone
        ctypes.CDLL("libgcc_s.so.1")
    except OSError:
        pass
    # Rust's available_parallelism reads the CPU quota from /proc and /sys/fs/cgroup; without them
    # it answers the host's CPU count, and tokio (wasmtime's WASI stdio) would start a thread per
    # host CPU in every worker.  One serves a guest's stdio (a worker held 1-2 with the quota).
    os.environ["TOKIO_WORKER_THREADS"] = "1"
    host_root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def check(result: int, what: str) -> None:
        if result != 0:
            os.close(host_root)
            raise OSError(ctypes.get_errno(), f"cannot leave the host's file system: {what}")

    check(libc.unshare(CLONE_NEWNS), "unshare")
    # private: our mounts never reach the host, and the host's later ones never arrive here
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    check(libc.mount(b"corral-wasm", anchor.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                     b"size=4k,nr_inodes=1,mode=0555"), "tmpfs")
    os.chdir(anchor)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    # the old root is stacked under the new one: detaching it drops this namespace's copy of every
    # host mount (a copy kept would pin, say, an ended sandbox's tmpfs and its memory)
    check(libc.umount2(b".", MNT_DETACH), "detaching the host's mounts")
    os.chdir("/")
    return host_root


def run_zygote(cache_path: str, parent_pid: int, socket_fd: int) -> None:
    """Load wasmtime and the module once, then fork a worker per request.

    A fork costs ~1.5 ms; a fresh worker process (import wasmtime, map the
    module) 60-300 ms of CPU.  The zygote runs no wasm and starts no thread,
    so forking it is safe.  Each request carries the child's stdin, stdout,
    stderr and control socket (SCM_RIGHTS); the reply is the child's pid.
    Children are reaped automatically (SIGCHLD ignored): the host follows
    them with pidfds.
    """
    _die_with_parent(parent_pid)
    _leave_host_network()
    engine, module, linker = _load(cache_path)
    host_root = _enter_empty_root(os.path.dirname(cache_path))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    requests = socket.socket(fileno=socket_fd)
    requests.sendall(b"R")
    zygote_pid = os.getpid()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(requests, 16, 4)
        except OSError:
            os._exit(0)
        if not message or len(fds) != 4:
            os._exit(0)  # the host closed the socket: it is gone or done
        pid = os.fork()
        if pid == 0:
            try:
                requests.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                for target, fd in enumerate(fds[:3]):
                    os.dup2(fd, target)
                control_fd = os.dup(fds[3])
                for fd in fds:
                    os.close(fd)
                _die_with_parent(zygote_pid)
                serve(socket.socket(fileno=control_fd), engine, module, linker, host_root)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        requests.sendall(struct.pack("<i", pid))


def run_worker(cache_path: str, parent_pid: int, control_fd: int) -> None:
    _die_with_parent(parent_pid)
    _leave_host_network()
    engine, module, linker = _load(cache_path)
    host_root = _enter_empty_root(os.path.dirname(cache_path))
    serve(socket.socket(fileno=control_fd), engine, module, linker, host_root)


def _open_job_files(job: dict[str, Any], host_root: int | None) -> tuple[bytes, list[tuple[int, str, bool]]]:
    """The seccomp program and a descriptor of each preopened directory, opened through the host's
    root (while this worker still holds it and is allowed to)."""
    program = b""
    if job.get("seccomp"):
        fd = _open_in(host_root, job["seccomp"], os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            program = f.read()
    preopens = [(_open_in(host_root, host_dir, os.O_PATH | os.O_DIRECTORY), guest_dir, bool(mutable))
                for host_dir, guest_dir, mutable in job["preopens"]]
    return program, preopens


def serve(control: socket.socket, engine: Any, module: Any, linker: Any, host_root: int | None = None) -> None:
    """Run one job on this worker's guest, report how it ended, exit."""
    import wasmtime

    _send(control, {"ready": True, "pid": os.getpid()})
    reader = control.makefile("rb")
    job = _read_message(reader)
    if job is None:
        os._exit(0)
    cpu_before = os.times()
    seccomp_program, preopens = _open_job_files(job, host_root)
    if host_root is not None:
        os.close(host_root)  # from here this worker reaches no host path at all
    _drop_privileges(job.get("uid"), job.get("gid"))
    if seccomp_program:
        _load_seccomp(seccomp_program)

    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.argv = job["argv"]
    wasi.env = list(job["env"].items())
    for fd, guest_dir, mutable in preopens:
        # wasmtime takes a path, not a descriptor: "." after fchdir, as the sandbox's uid
        os.fchdir(fd)
        wasi.preopen_dir(".", guest_dir, mutable)
        os.close(fd)
    os.chdir("/")
    wasi.inherit_stdin()
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    store.set_wasi(wasi)
    store.set_limits(memory_size=int(job["memory"]))
    fuel = int(job["fuel"])
    store.set_fuel(fuel)
    # One engine per worker and one guest per engine: a single epoch tick at
    # the deadline interrupts the guest at its next loop back-edge or call.
    store.set_epoch_deadline(1)
    timers: list[threading.Timer] = []
    marks: dict[str, Any] = {}

    def timer_for(seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, engine.increment_epoch)
        timer.daemon = True
        timers.append(timer)
        return timer

    outcome: dict[str, Any] = {"exit": None, "trap": None, "message": ""}
    instance = None
    try:
        instance = linker.instantiate(store, module)
        _send(control, {"started": True})
        if job.get("wait"):
            threading.Thread(target=_arm_on_go, args=(reader, timer_for, marks), daemon=True).start()
        else:
            timer_for(float(job["timeout"])).start()
        start = instance.exports(store)["_start"]
        assert isinstance(start, wasmtime.Func)
        start(store)
        outcome["exit"] = 0
    except wasmtime.ExitTrap as exc:
        outcome["exit"] = exc.code
    except wasmtime.Trap as exc:
        code = exc.trap_code
        outcome["trap"] = code.name.lower() if code is not None else "trap"
        outcome["message"] = exc.message.splitlines()[0] if exc.message else ""
    except wasmtime.WasmtimeError as exc:
        outcome["trap"] = "error"
        outcome["message"] = str(exc).splitlines()[0] if str(exc) else ""
    finally:
        for timer in timers:
            timer.cancel()
    try:
        outcome["fuel_used"] = fuel - store.get_fuel()
    except wasmtime.WasmtimeError:
        outcome["fuel_used"] = fuel
    outcome["memory"] = _memory_size(instance, store) if instance is not None else 0
    cpu_after = os.times()
    cpu_before = marks.get("go", cpu_before)
    outcome["cpu_ms"] = round((cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) * 1000, 1)
    _send(control, outcome)
    # _exit: no interpreter teardown (wasmtime's stdin reader thread may block it)
    os._exit(0)


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "run":
        run_worker(argv[1], int(argv[2]), int(argv[3]))
    elif len(argv) == 4 and argv[0] == "zygote":
        run_zygote(argv[1], int(argv[2]), int(argv[3]))
    elif len(argv) == 3 and argv[0] == "compile":
        compile_module(argv[1], argv[2])
    else:
        sys.stderr.write("usage: worker.py run|zygote CACHE PARENT_PID FD | compile WASM OUT\n")
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
