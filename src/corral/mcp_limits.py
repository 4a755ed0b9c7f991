"""What the operator of ``corral mcp`` lets the model ask for.

An MCP client is a model, and a model reads what it is shown: a web page or a file can tell it
what to ask for.  So the model chooses a sandbox's size and reach only within bounds the operator
set on the command line.  Before these existed, one ``create_sandbox`` call got ``memory="1T"``
(on a host of 24 GiB, a sandbox held back only by the limit on all sandboxes together, the host's
memory less a tenth: one model's memory bomb squeezed every other sandbox and the host's page
cache), ``cpus=1024`` (no CPU quota), a week per command, and ``allow=["0.0.0.0/0"]`` (every
public address: a page that steers the model had a sandbox send what it holds, or attack, anywhere).

* ``max_memory``: one sandbox's memory, at most (default 4 GiB);
* ``max_total_memory``: all sandboxes of the server together, their limits summed, made or being
  made (default: half the host's memory, at most 16 GiB, the HTTP server's quota per tenant);
* ``max_cpus``: one sandbox's CPUs (default: the host's);
* ``max_timeout``: a command's timeout, a sandbox's default one included (default 3600 s, the
  HTTP server's ``max_lifetime``);
* ``allow``: the destinations sandboxes may be given; the model's ``allow`` must name only
  destinations these cover (a host, a ``*.domain`` under one, a CIDR within one, the same port or
  any port).  None by default: sandboxes get no network unless the operator says where to.

Nothing here imports the MCP SDK: it is tested, and used, without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidSpec, ResourceLimit
from .netrules import AllowRule
from .spec import GiB, MiB, SandboxSpec, format_size


def host_memory() -> int:
    """Bytes of memory the host has (MemTotal)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def default_total_memory() -> int:
    return min(16 * GiB, host_memory() // 2 // MiB * MiB)


@dataclass(frozen=True)
class McpLimits:
    """The operator's bounds on what the model asks for (module docstring)."""

    max_memory: int = 4 * GiB
    max_total_memory: int = field(default_factory=default_total_memory)
    max_cpus: float = float(os.cpu_count() or 1)
    max_timeout: float = 3600.0
    #: a sandbox's life from its making (its commands' timeouts bound each command, not what one
    #: left running: `nohup ... &` ran on for the session's whole life; helper 95)
    max_lifetime: float = 3600.0
    allow: tuple[AllowRule, ...] = ()

    @classmethod
    def build(cls, max_memory: int | None = None, max_total_memory: int | None = None,
              max_cpus: float | None = None, max_timeout: float | None = None,
              allow: Sequence[str] = (), max_lifetime: float | None = None) -> McpLimits:
        """From the command line's values (sizes already parsed); ``None`` keeps a default."""
        given = {"max_memory": max_memory, "max_total_memory": max_total_memory,
                 "max_cpus": max_cpus, "max_timeout": max_timeout, "max_lifetime": max_lifetime}
        for name, value in given.items():
            if value is not None and not value > 0:
                raise InvalidSpec(f"--{name.replace('_', '-')}: {value!r} must be more than 0")
        kept = {name: value for name, value in given.items() if value is not None}
        return cls(**kept, allow=tuple(AllowRule.parse(text) for text in allow))  # type: ignore[arg-type]

    def defaults(self) -> dict[str, Any]:
        """A sandbox's defaults (512 MiB, 1 CPU, 60 s), each lowered to its bound if over it."""
        spec = SandboxSpec().limits
        return {"memory": min(spec.memory, self.max_memory), "cpus": min(spec.cpus, self.max_cpus),
                "timeout": min(spec.timeout, self.max_timeout)}

    def check_spec(self, spec: SandboxSpec) -> None:
        """Refuse a sandbox the model asked for past the operator's bounds (``InvalidSpec``: asking
        again the same way cannot succeed, so the model is told which flag holds it back)."""
        limits = spec.limits
        if limits.memory > self.max_memory:
            raise InvalidSpec(f"memory: {format_size(limits.memory)} is over this MCP server's "
                              f"{format_size(self.max_memory)} per sandbox (corral mcp --max-memory)")
        if limits.cpus > self.max_cpus:
            raise InvalidSpec(f"cpus: {limits.cpus:g} is over this MCP server's {self.max_cpus:g} per sandbox "
                              "(corral mcp --max-cpus)")
        self.check_timeout(limits.timeout)
        for text in spec.allow:
            asked = AllowRule.parse(text)
            if not any(operator.covers(asked) for operator in self.allow):
                offered = ", ".join(rule.text for rule in self.allow) or "none"
                raise InvalidSpec(f"allow {text!r}: this MCP server's sandboxes may reach only what its operator "
                                  f"listed with corral mcp --allow ({offered})")

    def check_timeout(self, timeout: float | None) -> None:
        if timeout is not None and timeout > self.max_timeout:
            raise InvalidSpec(f"timeout: {timeout:g} s is over this MCP server's {self.max_timeout:g} s "
                              "(corral mcp --max-timeout)")

    def check_total(self, held: int, more: int) -> None:
        """``held`` bytes of sandboxes' memory limits are made or being made; room for ``more``?"""
        if held + more > self.max_total_memory:
            raise ResourceLimit(f"this MCP server's sandboxes already hold {format_size(held)} of "
                                f"{format_size(self.max_total_memory)} memory in all (corral mcp --max-total-memory); "
                                f"{format_size(more)} more does not fit: destroy a sandbox first")

    def described(self) -> str:
        """The bounds in words, for the model (the server's instructions)."""
        reach = ", ".join(rule.text for rule in self.allow)
        return (f"Each sandbox: memory up to {format_size(self.max_memory)}, cpus up to {self.max_cpus:g}, "
                f"timeouts up to {self.max_timeout:g} s, destroyed {self.max_lifetime:g} s after it is made; "
                "all sandboxes together up to "
                f"{format_size(self.max_total_memory)} of memory. "
                + (f"Network: allow may name only destinations within: {reach}." if reach
                   else "Network: none (this server's operator allows no destination)."))
