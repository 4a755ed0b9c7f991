"""The MCP server behind ``corral mcp``: sandboxes as Model Context Protocol tools (official ``mcp`` SDK);
the command line (transport, port, idle timeout) is :mod:`corral.cli.mcp`.

Tools: ``create_sandbox``, ``run_command``, ``write_file``, ``read_file``,
``list_files``, ``destroy_sandbox`` and ``run_code``.  Sandboxes are embedded
(this process owns them) unless ``CORRAL_URL`` names a server.

No tool hands the model more than :data:`TEXT_CAP` characters of any one text
(a command's stdout or stderr, a file, a cell's output): past it the text is cut,
the answer's ``cut`` says how much there was, and ``note`` says how to read
the rest (``read_file`` pages through a file with ``offset``; redirect long output
to a file first).  ``run_code`` answers with MCP content: the execution as JSON
text, and each PNG/JPEG result as image content.

Every sandbox belongs to the MCP session that created it, and only that session
can use it (another session's id answers "no sandbox", like a missing one).  It
is destroyed when its session ends:

* stdio: one session, ending when stdin closes or the process is told to stop;
* streamable HTTP: one session per ``mcp-session-id``, ending when the client
  terminates it (``DELETE``), when it stays idle for the SDK's session idle
  timeout (no request in flight for that long: a long command keeps it), or when the server stops.

This module imports the MCP SDK at import time: only ``corral mcp`` imports it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

# at runtime, not under TYPE_CHECKING: the SDK finds a tool's Context parameter by its resolved annotation
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ImageContent, TextContent

from .errors import InvalidSpec, ResourceLimit, SandboxClosed, SandboxError, SandboxNotFound
from .interpreter import DEFAULT_TIMEOUT as CELL_TIMEOUT
from .mcp_limits import McpLimits
from .sandbox import Sandbox, check_fork_count
from .surface import build_spec

log = logging.getLogger(__name__)

#: sandboxes one MCP session may hold at once
MAX_SANDBOXES_PER_SESSION = 8
#: and all sessions of one server together (streamable HTTP serves many)
MAX_SANDBOXES = 64
#: the largest file read_file pages through
MAX_READ = 16 << 20
#: directory entries list_files hands the model at most
MAX_ENTRIES = 1000
#: read_file's whole-file reads under way at once, all sessions together: each holds up to
#: MAX_READ bytes and their text (up to 4x that) while a page is cut from it; 8 at once grew
#: the server by 250-310 MiB (and the 128 threads' worth would be GBs)
READS_AT_ONCE = 2
#: their threads: few, because what a thread frees of such a read its allocator keeps for that
#: thread's next (glibc's arena per thread), so each thread that ever read one holds its size
_whole_reads = ThreadPoolExecutor(max_workers=READS_AT_ONCE, thread_name_prefix="corral-mcp-read")
#: characters of one text a tool hands the model at most
TEXT_CAP = 20_000
#: bytes of each stream (and of a code cell's output) an MCP sandbox keeps for a result: the model sees
#: TEXT_CAP characters of it, and the rest only cost this server memory while the answer was made (8
#: commands of one session printing 100 MiB to stdout and stderr grew it by 1.2 GiB with the sandbox's
#: default 16 MiB); room enough for a code cell's plot images
MCP_MAX_OUTPUT = 2 << 20
CUT_NOTE = (f"texts over {TEXT_CAP} characters are cut (see 'cut'): redirect long output to a file "
            "(command > out.txt 2>&1) and page through it with read_file(path, offset=...)")
#: an HTTP session with no request in flight for this long is ended and its sandboxes destroyed (the SDK's default)
SESSION_IDLE_TIMEOUT = 30 * 60.0
SESSION_HEADER = "mcp-session-id"
#: threads for the sessions' blocking sandbox work (commands, files, creates), shared by all sessions
BLOCKING_THREADS = 128
#: of those, what one session's calls may hold at once; more of its calls wait their turn, so one
#: session's long commands never hold another's calls (asyncio's default pool has cpus + 4 threads:
#: 6 long commands of one session made every other session wait for them)
THREADS_PER_SESSION = MAX_SANDBOXES_PER_SESSION
_blocking = ThreadPoolExecutor(max_workers=BLOCKING_THREADS, thread_name_prefix="corral-mcp")

T = TypeVar("T")


class Session:
    """The sandboxes of one MCP session, destroyed together."""

    def __init__(self, sessions: Sessions | None = None) -> None:
        self.sandboxes: dict[str, Any] = {}
        #: when each was made (time.monotonic): destroyed at the operator's max_lifetime after it
        self.made: dict[str, float] = {}
        #: sandboxes being made for this session, and their memory limits: counted like the ones it holds
        self.pending = 0
        self.pending_memory = 0
        #: when a tool call of it began or one of its HTTP requests ended, whichever came last
        self.last_used = time.monotonic()
        self._sessions = sessions
        #: the session ended (client DELETE, idle, server stop): a sandbox made after it is destroyed
        self.closed = False
        self._lock = threading.Lock()
        self._share: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on a thread, within this session's share of them (THREADS_PER_SESSION)."""
        if self._share is None:
            self._share = asyncio.Semaphore(THREADS_PER_SESSION)
        async with self._share:
            return await asyncio.get_running_loop().run_in_executor(_blocking, functools.partial(fn, *args, **kwargs))

    def get(self, sandbox_id: str) -> Any:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in this session")
        return sb

    @contextlib.contextmanager
    def _room_for(self, count: int, memory_each: int) -> Iterator[None]:
        """Hold room for ``count`` sandboxes of ``memory_each`` bytes while they are made (concurrent
        calls of one session each found room before any was made: 14 at once made 14, past the 8).
        ``count`` is checked by the caller: a negative one made room for others (a fork of
        -1,000,000 waiting for a thread let a session make 13 past its 8, and other sessions past
        the server's 64)."""
        if count < 1:
            raise InvalidSpec(f"count: {count!r} must be at least 1")
        held = len(self.sandboxes) + self.pending
        if held + count > MAX_SANDBOXES_PER_SESSION:
            raise ResourceLimit(f"this session already has {held} of {MAX_SANDBOXES_PER_SESSION} "
                                "sandboxes; destroy one first")
        if self._sessions is not None:
            if self._sessions.sandbox_count() + count > MAX_SANDBOXES:
                raise ResourceLimit(f"this MCP server already holds {MAX_SANDBOXES} sandboxes; try again later")
            self._sessions.limits.check_total(self._sessions.memory_held(), count * memory_each)
        self.pending += count
        self.pending_memory += count * memory_each
        try:
            yield
        finally:
            self.pending -= count
            self.pending_memory -= count * memory_each

    async def _keep(self, made: list[Any], made_at: float | None = None) -> None:
        """Hold sandboxes just made (their life counted from ``made_at``, or now), unless the session
        ended while they were being made: then they are destroyed here (they lived on until the MCP
        server stopped)."""
        when = made_at if made_at is not None else time.monotonic()
        with self._lock:
            if not self.closed:
                self.sandboxes.update((sb.id, sb) for sb in made)
                self.made.update((sb.id, when) for sb in made)
                return
        for sb in made:
            await self.run(sb.kill)
        raise SandboxClosed("the MCP session ended while its sandbox was being made; it was destroyed")

    async def fork(self, sandbox_id: str, count: int) -> list[Any]:
        parent = self.get(sandbox_id)
        # a fork lives out its parent's lifetime, not one of its own: a chain of forks kept a
        # sandbox's files past --max-lifetime for ever (helper 96); read before the fork is made,
        # for the parent may be destroyed (or expire) meanwhile (helper 97: a destroy sent 8 ms
        # after the fork gave it a clock of its own)
        made_at = self.made.get(sandbox_id, time.monotonic())
        # a fork has its parent's limits
        with self._room_for(check_fork_count(count), parent.spec.limits.memory):
            forks: list[Any] = await self.run(parent.fork, count)
            await self._keep(forks, made_at=made_at)
        return forks

    async def create(self, **kwargs: Any) -> Any:
        spec = build_spec(None, **kwargs)
        (self._sessions.limits if self._sessions is not None else McpLimits()).check_spec(spec)
        with self._room_for(1, spec.limits.memory):
            if os.environ.get("CORRAL_URL"):
                sb: Any = await self.run(Sandbox.create, **kwargs)
            else:
                sb = await self.run(Sandbox.create, spec)
            await self._keep([sb])
        return sb

    async def destroy(self, sandbox_id: str) -> None:
        with self._lock:
            sb = self.sandboxes.pop(sandbox_id, None)
            self.made.pop(sandbox_id, None)
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in this session")
        await self.run(sb.kill)

    def end_expired(self, now: float, lifetime: float) -> None:
        """Destroy the sandboxes made ``lifetime`` seconds ago or more."""
        with self._lock:
            expired = [sid for sid, made in self.made.items() if now - made >= lifetime]
            gone = [self.sandboxes.pop(sid) for sid in expired if sid in self.sandboxes]
            for sid in expired:
                del self.made[sid]
        _kill_each(gone)

    def memory_held(self) -> int:
        """The memory limits of this session's sandboxes, held and being made, summed."""
        return sum(int(sb.spec.limits.memory) for sb in list(self.sandboxes.values())) + self.pending_memory

    def close(self) -> None:
        with self._lock:
            self.closed = True
            held, self.sandboxes, self.made = list(self.sandboxes.values()), {}, {}
        _kill_each(held)


def _kill_each(sandboxes: list[Any]) -> None:
    """Destroy each of ``sandboxes``, whatever one's destroy raises (one that raised left the rest
    running and untracked, and ended the reaper: helper 96); a failure is logged (a local
    sandbox's leftovers are ``corral gc``'s, a remote one's its server's)."""
    for sb in sandboxes:
        try:
            sb.kill()
        except Exception as exc:  # (the next ones are destroyed all the same)
            log.warning("destroying MCP sandbox %s failed: %s", getattr(sb, "id", "?"), exc)


class Sessions:
    """Every live MCP session's sandboxes, keyed by the transport's session id (``None`` on stdio)."""

    def __init__(self, idle_timeout: float = SESSION_IDLE_TIMEOUT, limits: McpLimits | None = None) -> None:
        self.idle_timeout = idle_timeout
        self.limits = limits if limits is not None else McpLimits()
        self._by_id: dict[str | None, Session] = {}
        #: HTTP requests being served per session id: a session is never idle while one is (the SDK's own
        #: rule: a 12 s command in a session with a 6 s idle timeout lost its sandbox mid-command)
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def of(self, ctx: Context) -> Session:
        """The session a tool call belongs to (the SDK has already checked the id names a live session)."""
        request = ctx.request_context.request
        headers = getattr(request, "headers", None)
        key = headers.get(SESSION_HEADER) if headers is not None else None
        with self._lock:
            session = self._by_id.get(key)
            if session is None:
                session = self._by_id[key] = Session(self)
        session.last_used = time.monotonic()
        return session

    def sandbox_count(self) -> int:
        with self._lock:
            return sum(len(s.sandboxes) + s.pending for s in self._by_id.values())

    def memory_held(self) -> int:
        """The memory limits of every session's sandboxes, made or being made, summed."""
        with self._lock:
            return sum(s.memory_held() for s in self._by_id.values())

    def end(self, key: str | None) -> None:
        """The session is over: destroy its sandboxes."""
        with self._lock:
            session = self._by_id.pop(key, None)
        if session is not None:
            session.close()

    def request_started(self, key: str) -> None:
        with self._lock:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def request_ended(self, key: str) -> None:
        """An HTTP request of session ``key`` was answered, or its client went away: the idle clock
        restarts (a client gone mid-command leaves its session idle from then on)."""
        with self._lock:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)
            session = self._by_id.get(key)
            if session is not None:
                session.last_used = time.monotonic()

    def end_idle(self, now: float) -> None:
        with self._lock:
            idle = [k for k, s in self._by_id.items()
                    if k is not None and k not in self._in_flight and now - s.last_used >= self.idle_timeout]
        for key in idle:
            self.end(key)

    def end_expired(self, now: float) -> None:
        """Destroy every session's sandboxes past the operator's ``max_lifetime``."""
        with self._lock:
            sessions = list(self._by_id.values())
        for session in sessions:
            session.end_expired(now, self.limits.max_lifetime)

    def close(self) -> None:
        with self._lock:
            keys = list(self._by_id)
        for key in keys:
            self.end(key)


def session_key(scope: Any) -> str | None:
    """The session id a request names: its first ``mcp-session-id`` header, the one the SDK reads (the last
    one of several let a DELETE terminate one session for the SDK and end another's sandboxes here)."""
    name = SESSION_HEADER.encode()
    for header, value in scope.get("headers") or []:
        if header.lower() == name:
            return bytes(value).decode("latin-1") or None
    return None


def track_sessions(app: Any, sessions: Sessions) -> Any:
    """ASGI wrapper: a session's requests in flight keep it from idling (see :meth:`Sessions.end_idle`),
    and a client's ``DELETE`` that terminated its HTTP session ends its sandboxes too."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await app(scope, receive, send)
            return
        key = session_key(scope)
        if scope.get("method") != "DELETE":
            # a GET is the session's stream of server messages, which a client keeps open for as
            # long as it is connected: counted, a connected client that called nothing held its
            # sandboxes past the idle timeout for ever
            if key is None or scope.get("method") == "GET":
                await app(scope, receive, send)
                return
            sessions.request_started(key)
            try:
                await app(scope, receive, send)
            finally:
                sessions.request_ended(key)
            return
        status: list[int] = []

        async def watch(message: Any) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await app(scope, receive, watch)
        if key is not None and status and status[0] < 300:
            await asyncio.to_thread(sessions.end, key)

    return wrapped


#: said with a listing that holds a name that is not UTF-8 (JSON cannot carry its bytes as they are)
NOT_UTF8_NOTE = ("entries with not_utf8 have names that are not UTF-8, shown with \\xNN for each such byte; "
                 "no path here names them: reach them with run_command (e.g. ls -b, or a glob)")


def _listed(entry: Any) -> dict[str, Any]:
    """One directory entry as list_files shows it (a listing with one odd name failed whole)."""
    shown: dict[str, Any] = {"name": entry.name, "type": entry.type, "size": entry.size}
    try:
        entry.name.encode()
    except UnicodeEncodeError:
        shown["name"] = entry.name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        shown["not_utf8"] = True
    return shown


def capped(fields: dict[str, Any], *names: str) -> dict[str, Any]:
    """``fields`` with each text among ``names`` cut to :data:`TEXT_CAP` characters; says what was cut."""
    out = dict(fields)
    cut: dict[str, int] = {}
    for name in names:
        text = out.get(name)
        if isinstance(text, str) and len(text) > TEXT_CAP:
            out[name] = text[:TEXT_CAP]
            cut[name] = len(text)
    if cut:
        out["cut"] = {name: {"total_chars": total, "shown_chars": TEXT_CAP} for name, total in cut.items()}
        out["note"] = CUT_NOTE
    return out


def code_content(execution: Any) -> list[TextContent | ImageContent]:
    """A cell's execution as MCP content: its JSON (texts capped, images left out) and each image."""
    data = execution.to_dict()
    images: list[ImageContent] = []
    results = []
    for result in data.get("results", []):
        for fmt in ("png", "jpeg"):
            if isinstance(result.get(fmt), str):
                images.append(ImageContent(type="image", data=result.pop(fmt), mime_type=f"image/{fmt}"))
                result[fmt] = "(image content below)"
        shown = {k: v for k, v in result.items() if v not in (None, {})}
        for name in ("json", "extra"):  # a long JSON value is cut as its text (a 500k one went whole)
            if name in shown and not isinstance(shown[name], str) and len(as_json := json.dumps(shown[name])) > TEXT_CAP:
                shown[name] = as_json
        results.append(capped(shown, "text", "html", "markdown", "svg", "latex", "javascript", "json", "extra"))
    logs = data.get("logs", {})
    error = data.get("error")
    if isinstance(error, dict):  # an exception's message and traceback are capped like any text
        error = capped(error, "value", "traceback")
    answer = capped({"stdout": "".join(logs.get("stdout", [])), "stderr": "".join(logs.get("stderr", [])),
                     "error": error, "results": results, "text": execution.text,
                     **{k: data.get(k) for k in ("execution_count", "timed_out", "restarted", "truncated")}},
                    "stdout", "stderr", "text")
    return [TextContent(type="text", text=json.dumps(answer)), *images]


def _anticipated(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Report Corral's own errors to the model as tool errors with their message (not as crashes)."""
    from mcp.server.mcpserver.exceptions import ToolError

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except SandboxError as exc:
            raise ToolError(f"{exc.code}: {exc}") from exc

    return wrapper


def _read_page(sb: Sandbox, path: str, offset: int) -> tuple[str, int]:
    """TEXT_CAP characters of a text file (at most MAX_READ bytes) from ``offset``, and its length
    in characters: the file is read whole on one of READS_AT_ONCE threads of their own, and only
    the page leaves that thread."""
    def read() -> tuple[str, int]:
        content = sb.files.read(path, "text", MAX_READ)
        return content[offset:offset + TEXT_CAP], len(content)

    return _whole_reads.submit(read).result()


def build_server(sessions: Sessions | None = None) -> MCPServer[Sessions]:
    sessions = sessions if sessions is not None else Sessions()

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[Sessions]:
        async def reap_idle() -> None:
            while True:
                await asyncio.sleep(min(60.0, sessions.idle_timeout / 4, sessions.limits.max_lifetime / 8))
                for reap in (sessions.end_idle, sessions.end_expired):
                    try:
                        await asyncio.to_thread(reap, time.monotonic())
                    except Exception as exc:  # (a reaper that stopped would reap nothing more)
                        log.warning("MCP reaper: %s", exc)

        reaper = asyncio.get_running_loop().create_task(reap_idle())
        try:
            yield sessions
        finally:
            reaper.cancel()
            await asyncio.to_thread(sessions.close)

    server: MCPServer[Sessions] = MCPServer("corral", instructions=(
        "Isolated, ephemeral Linux sandboxes. Create one, run shell commands and move files in it, destroy it "
        "when done. Every sandbox of this session is destroyed when the session ends. "
        + sessions.limits.described()), lifespan=lifespan)

    @server.tool()
    @_anticipated
    async def create_sandbox(ctx: Context, image: str = "host", memory: str | None = None, cpus: float | None = None,
                             timeout: float | None = None, env: dict[str, str] | None = None,
                             allow: list[str] | None = None, user: str = "user") -> dict[str, Any]:
        """Create a sandbox; returns its id. memory like 512M (default), cpus (default 1), timeout =
        default seconds per command (default 60); each default lowered to this server's bound if over it.
        No network unless ``allow`` lists destinations (host, *.domain, IP or CIDR, optional :port)
        within what this server's operator allows (see the server's instructions).
        user: "user" (uid 1000, default) or "root" (root inside the sandbox only, e.g. to install
        packages; no privilege on the host)."""
        # secrets are deliberately not offered: the model would choose where they may be sent
        fallback = sessions.limits.defaults()
        sb = await sessions.of(ctx).create(image=image, memory=fallback["memory"] if memory is None else memory,
                                           cpus=fallback["cpus"] if cpus is None else cpus,
                                           timeout=fallback["timeout"] if timeout is None else timeout,
                                           env=env,
                                           allow=allow or None, user=user, max_output=MCP_MAX_OUTPUT)
        return {"sandbox_id": sb.id}

    @server.tool()
    @_anticipated
    async def run_command(ctx: Context, sandbox_id: str, command: str, timeout: float | None = None,
                          cwd: str | None = None, user: str | None = None) -> dict[str, Any]:
        """Run a shell command to completion; returns exit_code, stdout, stderr, timed_out, oom_killed.
        user: "root" or "user" for this command (default: the sandbox's).
        stdout and stderr are cut at 20000 characters each ('cut' says so): redirect long output to a
        file and page through it with read_file."""
        sessions.limits.check_timeout(timeout)
        session = sessions.of(ctx)
        sb = session.get(sandbox_id)
        result = await session.run(sb.commands.run, command, timeout=timeout, cwd=cwd, user=user)
        return capped(dict(result.to_dict()), "stdout", "stderr")

    @server.tool()
    @_anticipated
    async def write_file(ctx: Context, sandbox_id: str, path: str, content: str) -> dict[str, Any]:
        """Write a text file (relative paths are under /workspace)."""
        session = sessions.of(ctx)
        await session.run(session.get(sandbox_id).files.write, path, content)
        return {"path": path, "bytes": len(content.encode())}

    @server.tool()
    @_anticipated
    async def read_file(ctx: Context, sandbox_id: str, path: str, offset: int = 0) -> dict[str, Any]:
        """Read a text file (at most 16 MiB), 20000 characters from ``offset`` at a time; 'next_offset'
        is where the rest starts (null at the end)."""
        if offset < 0:
            raise InvalidSpec(f"offset {offset} must be 0 or more")
        session = sessions.of(ctx)
        page, total = await session.run(_read_page, session.get(sandbox_id), path, offset)
        end = offset + len(page)
        return {"path": path, "content": page, "offset": offset, "total_chars": total,
                "next_offset": end if end < total else None}

    @server.tool()
    @_anticipated
    async def list_files(ctx: Context, sandbox_id: str, path: str = ".") -> dict[str, Any]:
        """List a directory: name, type, size of each entry (the first 1000)."""
        session = sessions.of(ctx)
        entries = await session.run(session.get(sandbox_id).files.list, path)
        shown = [_listed(e) for e in entries[:MAX_ENTRIES]]
        answer: dict[str, Any] = {"path": path, "entries": shown}
        if any("not_utf8" in e for e in shown):
            answer["names_note"] = NOT_UTF8_NOTE
        if len(entries) <= MAX_ENTRIES:
            return answer
        return {**answer, "cut": {"entries": {"total": len(entries), "shown": MAX_ENTRIES}},
                "note": f"only the first {MAX_ENTRIES} entries: list a subdirectory, or run_command 'ls' with a filter"}

    @server.tool()
    @_anticipated
    async def fork_sandbox(ctx: Context, sandbox_id: str, count: int = 1) -> dict[str, Any]:
        """Make ``count`` new sandboxes that start with this sandbox's files as they are now (fresh
        processes, no network); this one runs on unchanged. Returns their ids."""
        forks = await sessions.of(ctx).fork(sandbox_id, count)
        return {"sandbox_ids": [sb.id for sb in forks]}

    @server.tool()
    @_anticipated
    async def destroy_sandbox(ctx: Context, sandbox_id: str) -> dict[str, Any]:
        """Destroy a sandbox and everything in it."""
        await sessions.of(ctx).destroy(sandbox_id)
        return {"destroyed": sandbox_id}

    # the code interpreter (corral.interpreter)
    @server.tool()
    @_anticipated
    async def run_code(ctx: Context, sandbox_id: str, code: str, language: str = "python",
                       timeout: float | None = None) -> list[TextContent | ImageContent]:
        """Run code in the sandbox's interpreter (python or javascript; variables persist between calls),
        for at most ``timeout`` seconds (default 60, or less if the server allows less).
        Answers the execution as JSON (stdout, stderr, error, results, text; texts cut at 20000 characters)
        and each image result (matplotlib figures, PNG/JPEG reprs) as image content."""
        sessions.limits.check_timeout(timeout)
        if timeout is None:  # the interpreter's own default is 60 s, over a lower --max-timeout
            timeout = min(CELL_TIMEOUT, sessions.limits.max_timeout)
        session = sessions.of(ctx)
        return code_content(await session.run(session.get(sandbox_id).run_code, code, language=language,
                                               timeout=timeout))

    return server


def _end_at_stop_signals(sessions: Sessions) -> None:
    """SIGTERM and SIGHUP end a stdio server: its sessions' sandboxes are destroyed and the process
    exits at 128 + the signal.  Not by unwinding its event loop: the SDK reads stdin on a worker
    thread (anyio's, not a daemon) that stays blocked in its read while the client holds the pipe
    open, and the loop's shutdown, then the interpreter's, waited for it for ever (SIGHUP's default
    action killed the server with its sandboxes left for the janitor)."""

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=_end, args=(sessions, signum), name="corral-mcp-stop", daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


_ending = threading.Lock()


def _end(sessions: Sessions, signum: int) -> None:
    with _ending:  # (a second signal waits here for the first one's exit)
        try:
            sessions.close()
            atexit._run_exitfuncs()  # what the interpreter's exit would run
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        finally:
            os._exit(128 + signum)


def main(transport: str = "stdio", host: str = "127.0.0.1", port: int = 7334,
         session_idle_timeout: float = SESSION_IDLE_TIMEOUT, limits: McpLimits | None = None) -> None:
    sessions = Sessions(session_idle_timeout, limits)
    server = build_server(sessions)
    if transport == "stdio":
        _end_at_stop_signals(sessions)
        server.run("stdio")
    elif transport == "http":
        import uvicorn

        from .server.config import is_loopback
        from .server.host_guard import LoopbackCallersOnly

        if not is_loopback(host):
            raise InvalidSpec("corral mcp --http listens on loopback only (it has no authentication)")
        app = server.streamable_http_app(host=host, session_idle_timeout=session_idle_timeout)
        # no key: the SDK refuses web pages (Host, Origin), the guard other users of the host too
        uvicorn.run(LoopbackCallersOnly(track_sessions(app, sessions)), host=host, port=port, log_level="warning",
                    lifespan="on",
                    proxy_headers=False)  # the client address is the connection's (host_guard)
    else:
        raise InvalidSpec(f"transport {transport!r}: use stdio or http")
