"""docs/reading.md answers each of its questions in at most eight files, in order, and names only files and code that
exist: a rename that leaves the guide behind fails here."""

from __future__ import annotations

import re

from tests.paths import PACKAGE

GUIDE = PACKAGE.parent / "docs" / "reading.md"
MAX_FILES = 8
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?$")


def _sections() -> dict[str, list[str]]:
    """Question -> its numbered steps (each step's lines joined)."""
    out: dict[str, list[str]] = {}
    question = None
    for line in GUIDE.read_text().splitlines():
        if line.startswith("## "):
            question = line[3:].strip()
            out[question] = []
        elif question and re.match(r"^\d+\. ", line):
            out[question].append(line)
        elif question and out[question] and line.startswith("   ") and line.strip():
            out[question][-1] += " " + line.strip()
    return out


def _package_words() -> set[str]:
    words: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
    return words


def test_the_guide_asks_three_questions_each_in_at_most_eight_files():
    sections = _sections()
    assert len(sections) == 3, sorted(sections)
    for question, steps in sections.items():
        assert 1 <= len(steps) <= MAX_FILES, f"{question!r} takes {len(steps)} steps"
        files = [re.search(r"`(flexorch/[^`]+\.py)`", step) for step in steps]
        assert all(files), f"{question!r}: every step opens with the file it reads"


def test_every_file_and_name_the_guide_points_at_exists():
    words = _package_words()
    root = PACKAGE.parent
    missing = []
    for question, steps in _sections().items():
        for step in steps:
            for token in re.findall(r"`([^`]+)`", step):
                if token.endswith((".py", ".md")) or "/" in token:
                    if not (root / token).exists():
                        missing.append(f"{question}: file {token}")
                elif NAME.match(token):
                    if not set(token.removesuffix("()").split(".")) <= words:
                        missing.append(f"{question}: name {token}")
    assert not missing, "docs/reading.md points at what is not there:\n" + "\n".join(missing)
