"""Bodies for the secret-echo tests, shared by the echoing target and the tests that judge what
the sandbox received: one line per encoding a server may apply to a value it echoes back."""

from __future__ import annotations

import base64
import html
import json
import random
from urllib.parse import quote, unquote

# prefixes put the value at byte offset 0, 1 and 2 (mod 3) inside a larger base64 blob
_ALIGN = (b"", b"\xfb", b"\xfb\xff")


def _b64(encode: object, k: int) -> tuple[object, object]:
    def enc(v: bytes) -> bytes:
        return encode(_ALIGN[k] + v + b"!tail")  # type: ignore[operator, no-any-return]

    return enc, lambda p: base64.b64decode(p, altchars=b"-_" if encode is base64.urlsafe_b64encode else None)


FORMS: dict[str, tuple[object, object]] = {
    "raw": (lambda v: v, lambda p: p),
    **{f"base64-{k}": _b64(base64.b64encode, k) for k in range(3)},
    **{f"base64url-{k}": _b64(base64.urlsafe_b64encode, k) for k in range(3)},
    "hex": (lambda v: v.hex().encode(), lambda p: bytes.fromhex(p.decode())),
    "HEX": (lambda v: v.hex().upper().encode(), lambda p: bytes.fromhex(p.decode())),
    "url": (lambda v: quote(v, safe="").encode(), lambda p: unquote(p.decode()).encode()),
    "url-full": (lambda v: "".join(f"%{b:02x}" for b in v).encode(), lambda p: unquote(p.decode()).encode()),
    "json": (lambda v: json.dumps({"echo": v.decode()}).encode(), lambda p: json.loads(p)["echo"].encode()),
    "json-full": (lambda v: ('{"echo": "' + "".join(f"\\u{b:04X}" for b in v) + '"}').encode(),
                  lambda p: json.loads(p)["echo"].encode()),
    "html": (lambda v: b"<p>" + html.escape(v.decode()).encode() + b"</p>", lambda p: html.unescape(p.decode()).encode()),
    "html-dec": (lambda v: "".join(f"&#{b};" for b in v).encode(), lambda p: html.unescape(p.decode()).encode()),
    "html-hex": (lambda v: "".join(f"&#x{b:x};" for b in v).encode(), lambda p: html.unescape(p.decode()).encode()),
}


def echo_body(value: str) -> bytes:
    """The value once per form, one ``name: payload`` line each."""
    raw = value.encode()
    return b"".join(name.encode() + b": " + enc(raw) + b"\n" for name, (enc, _) in FORMS.items())  # type: ignore[operator]


def decode_echo(body: bytes) -> dict[str, bytes]:
    """What each line of an echo body decodes to, as the sandbox's program would decode it."""
    out: dict[str, bytes] = {}
    for line in body.splitlines():
        name, _, payload = line.partition(b": ")
        _, dec = FORMS[name.decode()]
        out[name.decode()] = dec(payload)  # type: ignore[operator]
    return out


def ordinary_body() -> bytes:
    """Ordinary data that a scanner must not touch: random bytes, base64, hex, JSON and HTML."""
    rng = random.Random(19)
    blob = rng.randbytes(96 * 1024)
    text = b"".join(b"line %d: %s %s {\"k\": \"\\u00e9%d\"} &#233; %%41\n" % (
        i, base64.b64encode(rng.randbytes(30)), rng.randbytes(12).hex().encode(), i) for i in range(2000))
    return blob + text + base64.b64encode(blob)
