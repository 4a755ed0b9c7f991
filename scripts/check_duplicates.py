#!/usr/bin/env python3
"""Fail if ``src/`` holds a run of WINDOW (10) or more duplicated lines.

Lines are compared stripped of indentation and trailing comments' surrounding
space, with blank and comment-only lines left out (so re-indenting or
re-spacing a copy does not hide it); every window of WINDOW consecutive such
lines is hashed, and a hash seen at two places (in one file or in two) is a
duplicate run.  Overlapping windows of one run are reported once, as the run.

Usage: python scripts/check_duplicates.py [--window 10] [ROOT ...]   (default: src)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import defaultdict
from pathlib import Path

WINDOW = 10


def normalized(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines that count: stripped, no blank or comment-only lines."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text and not text.startswith("#"):
            lines.append((number, text))
    return lines


def duplicates(roots: list[Path], window: int = WINDOW) -> list[tuple[tuple[Path, int, int], tuple[Path, int, int]]]:
    """Pairs of places ((file, first line, last line), ...) holding the same run of >= ``window`` lines."""
    files = {path: normalized(path) for root in roots for path in sorted(root.rglob("*.py"))}
    seen: dict[bytes, list[tuple[Path, int]]] = defaultdict(list)
    for path, lines in files.items():
        for i in range(len(lines) - window + 1):
            digest = hashlib.sha1("\n".join(text for _, text in lines[i:i + window]).encode()).digest()
            seen[digest].append((path, i))
    # a window at (a, i) equal to one at (b, j): grow it into the longest run, report each run once
    found = []
    covered: set[tuple[Path, int, Path, int]] = set()
    for places in seen.values():
        for k, (a, i) in enumerate(places):
            for b, j in places[k + 1:]:
                if (a, i, b, j) in covered or (a == b and abs(i - j) < window):
                    continue
                length = window
                la, lb = files[a], files[b]
                while i + length < len(la) and j + length < len(lb) and la[i + length][1] == lb[j + length][1]:
                    length += 1
                for step in range(length - window + 1):
                    covered.add((a, i + step, b, j + step))
                found.append(((a, la[i][0], la[i + length - 1][0]), (b, lb[j][0], lb[j + length - 1][0])))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("roots", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1] / "src"])
    args = parser.parse_args()
    found = duplicates(args.roots, args.window)
    for (a, a0, a1), (b, b0, b1) in found:
        print(f"{a}:{a0}-{a1} duplicates {b}:{b0}-{b1}")
    print(f"{len(found)} duplicated run(s) of {args.window}+ lines", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
