"""No run of 10 or more duplicated lines in src/ (issue 15): scripts/check_duplicates.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_duplicates", ROOT / "scripts" / "check_duplicates.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_src_has_no_duplicated_run_of_ten_lines() -> None:
    found = _checker().duplicates([ROOT / "src"])
    assert found == [], "\n".join(f"{a}:{a0}-{a1} = {b}:{b0}-{b1}" for (a, a0, a1), (b, b0, b1) in found)


def test_the_check_finds_a_copy(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(10))
    (tmp_path / "a.py").write_text("def f():\n" + body)
    (tmp_path / "b.py").write_text("def g():\n    pass\n\n\n" + body.replace("    ", "        "))
    found = _checker().duplicates([tmp_path])
    assert [(a.name, a0, a1, b.name, b0, b1) for (a, a0, a1), (b, b0, b1) in found] == [
        ("a.py", 2, 11, "b.py", 5, 14)]
