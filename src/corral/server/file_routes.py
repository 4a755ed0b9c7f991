"""``/v1/sandboxes/{sandbox_id}/files``: list, describe, download, upload, remove, make a directory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.types import Receive, Scope, Send

from ..tiers.base import MAX_LIST_ENTRIES, MAX_LIST_PATH_CHARS, json_text
from .context import Context, Tenant
from .output_shares import Rendering, render_json, send_in_pieces
from .wire import path_of_query

#: the largest file a download returns
MAX_DOWNLOAD = 64 << 20
FILES = "/v1/sandboxes/{sandbox_id}/files"

router = APIRouter()

#: the two ways a query names a sandbox path
PATH_DOC = "the sandbox path (text)"
PATH_B64_DOC = "the sandbox path's bytes, base64, instead of path: a name that is not UTF-8 (as a listing's path_b64)"


def _path(request: Request, path: Annotated[str | None, Query(description=PATH_DOC)] = None,
          path_b64: Annotated[str | None, Query(description=PATH_B64_DOC)] = None) -> str:
    return path_of_query(request.scope.get("query_string", b""), path, path_b64)


def _listed(request: Request, path: Annotated[str | None, Query(description=PATH_DOC + "; /workspace if none")] = None,
            path_b64: Annotated[str | None, Query(description=PATH_B64_DOC)] = None) -> str:
    return path_of_query(request.scope.get("query_string", b""), path, path_b64, "/workspace")


#: a route's sandbox path, checked (``path`` or ``path_b64``)
SandboxPath = Annotated[str, Depends(_path)]


class Download(Response):
    """A file's bytes, counted against the tenant's downloads in flight until they are sent.

    The bytes are the sandbox's, on the server's own origin: a browser is told to save them, never
    to sniff them into a page (an HTML file shown here would be same-origin with the API), and a
    page it renders anyway is sandboxed (see ``port_routes``)."""

    media_type = "application/octet-stream"
    #: what a browser may do with them
    SAFE_HEADERS = {"content-disposition": "attachment", "x-content-type-options": "nosniff",
                    "content-security-policy": "sandbox"}

    def __init__(self, data: bytes, release: Callable[[], None]) -> None:
        super().__init__(data, headers=self.SAFE_HEADERS)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the bytes are counted for as long as the server holds them
        try:
            await send_in_pieces(send, self.status_code, self.raw_headers, bytes(self.body))
        finally:
            self._release()


#: what a listing is held at while it is made: its entries' paths at most (MAX_LIST_PATH_CHARS),
#: their names again, and the JSON around them
LISTING_HOLD = 2 * MAX_LIST_PATH_CHARS + MAX_LIST_ENTRIES * 256


@router.get(FILES, summary="List a directory")
async def list_files(sandbox_id: str, who: Tenant, ctx: Context, path: Annotated[str, Depends(_listed)]) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    # up to 100,000 entries: counted with the tenant's output until its client has taken it; a
    # name that is not UTF-8 is text with U+FFFD and its bytes in name_b64 / path_b64 (it made the
    # whole listing a 400); rendered on the tenant's thread, not on the loop (output_shares.render_json)
    def list_and_render() -> Rendering:
        entries = entry.sandbox.files.list(path)
        return render_json({**json_text("path", path), "entries": [e.to_json() for e in entries]})

    # held against the tenant's output bound while it is made, as a command is (at the most a listing
    # takes); made answers that no client reads count there too, so the next waits its turn: 6
    # unread listings held 2 GiB of the server
    hold = await ctx.output_shares.hold(who, LISTING_HOLD)
    try:
        answer = await ctx.run_for(who, list_and_render)
    except BaseException:
        hold()
        raise
    return ctx.answer(who, answer, hold)


@router.get(FILES + "/stat", summary="Describe one file")
async def stat_file(sandbox_id: str, who: Tenant, ctx: Context, path: SandboxPath) -> dict[str, Any]:
    entry = ctx.manager.get(who, sandbox_id)
    return (await ctx.run_for(who, entry.sandbox.files.stat, path)).to_json()


@router.get(FILES + "/content", summary="Download a file", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def download(sandbox_id: str, who: Tenant, ctx: Context, path: SandboxPath,
                   max_bytes: Annotated[int, Query(ge=0)] = MAX_DOWNLOAD) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    # the caller's limit, within the server's own (which bounds what it holds in memory)
    wanted, limit = path, min(max_bytes, MAX_DOWNLOAD)
    data = await ctx.run_for(who, lambda: entry.sandbox.files.read(wanted, format="bytes", max_bytes=limit))
    # held until the client has it all: a client that does not read keeps it in the server
    return Download(data, ctx.hold_download(who, len(data)))


@router.put(FILES + "/content", status_code=204, summary="Upload a file (raw body)",
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def upload(sandbox_id: str, request: Request, who: Tenant, ctx: Context, path: SandboxPath,
                 mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    data = await request.body()
    await ctx.run_for(who, entry.sandbox.files.write, path, data, mode)
    return Response(status_code=204)


@router.delete(FILES, status_code=204, summary="Remove a file or directory")
async def remove_file(sandbox_id: str, who: Tenant, ctx: Context, path: SandboxPath,
                      recursive: bool = False) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    await ctx.run_for(who, entry.sandbox.files.remove, path, recursive)
    return Response(status_code=204)


@router.post(FILES + "/dir", status_code=204, summary="Make a directory (and its parents)")
async def make_dir(sandbox_id: str, who: Tenant, ctx: Context, path: SandboxPath,
                   mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o755) -> Response:
    entry = ctx.manager.get(who, sandbox_id)
    await ctx.run_for(who, entry.sandbox.files.make_dir, path, mode)
    return Response(status_code=204)
