"""The tests README and docs/ name as a guarantee's enforcement exist: a renamed or removed test
otherwise leaves the guarantee's row pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: `test_name`, `file.py::test_name`, `test_name[param]` inside backticks
CITED = re.compile(r"`(?:[\w/]+\.py::)?(test_\w+)(?:\[[^\]`]*\])?`")
#: names the docs cite that are not Corral's (CPython's own test suite, in docs/root.md)
NOT_OURS = {"test_os", "test_posix", "test_shutil", "test_subprocess", "test_chown", "test_fchown", "test_lchown", "test_chown_with_root", "test_sched_priority",
            "test_sched_rr_get_interval", "test_setscheduler_only_param"}


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def test_every_test_the_docs_cite_exists() -> None:
    defined = defined_tests()
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for name in CITED.findall(line):
                if name not in defined and name not in NOT_OURS:
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "\n".join(missing)
