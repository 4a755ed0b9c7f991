"""What a code cell produced (:class:`Execution`): its results, logs and error, in E2B's shape.

Everything here was sent by a kernel in the sandbox, which a cell can replace or write for: a
result is taken as text (``json`` as parsed JSON of bounded depth) and turned back into a dict
without a deep copy (:mod:`corral.interpreter` charges each result and container to its cell).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

_FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript")
#: levels a result's ``json`` may nest; a deeper value is kept as its JSON text (600 levels made
#: the answer's rendering raise RecursionError: a bare 500 over REST)
MAX_RESULT_DEPTH = 32


def _depth_within(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests at most ``limit`` levels, walked without recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return "(a value that is not text)"


@dataclass
class Result:
    """One rich output of a cell: the last expression's value, a figure, or ``display(obj)``."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def formats(self) -> list[str]:
        return [name for name in _FORMATS if getattr(self, name) is not None]

    @classmethod
    def from_data(cls, data: dict[str, Any], main: bool) -> Result:
        """A result from what the kernel sent, which a cell can forge: every format but ``json``
        is text (a list for ``text/plain`` passed MCP's cap whole: 1.6 million characters), and
        ``json`` nests at most MAX_RESULT_DEPTH levels, else it is kept as its text."""
        known: dict[str, Any] = {k: _as_text(v) for k, v in data.items() if k in _FORMATS and k != "json"}
        if "json" in data:
            value = data["json"]
            known["json"] = value if _depth_within(value, MAX_RESULT_DEPTH) else _as_text(value)
        extra = {str(k): _as_text(v) for k, v in data.items() if k not in _FORMATS}
        return cls(**known, is_main_result=main, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """Its fields, shallow (``asdict`` copied every nested value again)."""
        answer = {name: getattr(self, name) for name in _FORMATS}
        return {**answer, "is_main_result": self.is_main_result, "extra": dict(self.extra)}


@dataclass
class Logs:
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass
class ExecutionError:
    name: str
    value: str
    traceback: str


@dataclass
class Execution:
    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int = 0
    #: the cell hit its timeout and was interrupted
    timed_out: bool = False
    #: the kernel was restarted during this cell: variables and imports are gone
    restarted: bool = False
    #: output beyond the sandbox's max_output was dropped
    truncated: bool = False

    @property
    def text(self) -> str | None:
        """The text of the main result (the last expression's value), if any."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [result.to_dict() for result in self.results],
            "logs": {"stdout": list(self.logs.stdout), "stderr": list(self.logs.stderr)},
            "error": asdict(self.error) if self.error is not None else None,
            "execution_count": self.execution_count, "timed_out": self.timed_out,
            "restarted": self.restarted, "truncated": self.truncated,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Execution:
        """The inverse of :meth:`to_dict` (what the server's ``POST /code`` returns)."""
        error = data.get("error")
        return cls(
            results=[Result(**r) for r in data.get("results", [])],
            logs=Logs(**data.get("logs", {})),
            error=ExecutionError(**error) if error else None,
            execution_count=data.get("execution_count", 0),
            timed_out=data.get("timed_out", False),
            restarted=data.get("restarted", False),
            truncated=data.get("truncated", False),
        )
