"""Cells the interpreter's parser cannot take (a NUL byte, an expression nested thousands deep)
are that cell's error: the kernel lives on, later cells run, its variables are kept."""

from __future__ import annotations

from typing import Any

import pytest

HOSTILE_CELLS = {
    "nul": "x = 2\0",
    "nul in a string": "x = 'a\0b'",
    "unary": "x = " + "-" * 100_000 + "1",  # the parser's own stack: MemoryError
    "attributes": "x = x" + ".real" * 100_000,  # RecursionError building the tree
    "sum": "x = " + "+".join(["1"] * 100_000),
    "conditional": "x = " + "1 if 1 else " * 100_000 + "1",
    "parentheses": "x = " + "(" * 100_000 + ")" * 100_000,
}


@pytest.mark.parametrize("name", list(HOSTILE_CELLS))
def test_a_cell_the_parser_cannot_take_leaves_the_kernel_and_its_state(sandbox: Any, name: str) -> None:
    assert sandbox.run_code("x = 1").error is None
    refused = sandbox.run_code(HOSTILE_CELLS[name], timeout=60)
    assert refused.error is not None
    assert refused.error.name in ("SyntaxError", "RecursionError"), refused.error
    assert "died" not in refused.error.value
    # the same kernel answers: x is still 1, and a cell can change it
    assert sandbox.run_code("x").text == "1"
    assert sandbox.run_code("x += 1; x").text == "2"


@pytest.mark.parametrize("code", ["x = 2\0", "x = " + "-" * 100_000 + "1", "x = " + "[" * 100_000 + "]" * 100_000])
def test_the_javascript_kernel_lives_on_too(sandbox: Any, code: str) -> None:
    assert sandbox.run_code("var x = 1", language="javascript").error is None
    refused = sandbox.run_code(code, language="javascript", timeout=60)
    assert refused.error is not None and refused.error.name in ("SyntaxError", "RangeError"), refused.error
    assert sandbox.run_code("x", language="javascript").text == "1"
