"""The README is a manual and conf/ comments stay short: the form both keep.

README.md: at most 400 lines, no table cell over 300 characters, no commit hash (a 7-40 character
hex word with at least one digit and one letter a-f), no date (YYYY-MM-DD). Measurements and their
history belong in docs/results.md.

conf/**/*.yaml: a file carries at most three comment lines (what it trains, its measured result,
where docs/results.md has it), and across conf/ the comment lines total at most a third of the
setting lines. ``# @package _global_`` is a Hydra directive, not a comment.

textrl/: no comment or docstring cites a result file.
"""

from __future__ import annotations

import re

import pytest

from textrl.config import CONF_DIR

ROOT = CONF_DIR.parent
README = ROOT / "README.md"
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
DIRECTIVE = re.compile(r"^#\s*@package\b")
CONF_FILES = sorted(CONF_DIR.rglob("*.yaml"))


def _commit_hashes(text: str) -> list[str]:
    return [w for w in HEX.findall(text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]


def _table_cells(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("|"):
            for cell in line.strip().strip("|").split("|"):
                yield number, cell.strip()


def test_the_readme_is_at_most_400_lines():
    assert len(README.read_text().splitlines()) <= 400


def test_no_readme_table_cell_is_over_300_characters():
    long = [(n, len(c)) for n, c in _table_cells(README.read_text()) if len(c) > 300]
    assert not long, f"README.md table cells over 300 characters (line, length): {long}"


def test_the_readme_names_no_commit_and_no_date():
    text = README.read_text()
    assert not _commit_hashes(text), f"README.md names commits: {_commit_hashes(text)}"
    assert not DATE.findall(text), f"README.md names dates: {DATE.findall(text)}"


def test_the_checks_recognise_what_they_refuse():
    # the patterns themselves: a hash needs a digit and a letter a-f, a word like "defaced" is no hash
    assert _commit_hashes("at 68aee23, then 9cff628") == ["68aee23", "9cff628"]
    assert _commit_hashes("defaced 1234567 cafebabe") == []
    assert DATE.findall("until 2026-11-28") == ["2026-11-28"]


def _comment_and_setting_lines(path) -> tuple[int, int]:
    comments = settings = 0
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or DIRECTIVE.match(stripped):
            continue
        if stripped.startswith("#"):
            comments += 1
        else:
            settings += 1
    return comments, settings


@pytest.mark.parametrize("path", CONF_FILES, ids=[str(p.relative_to(CONF_DIR)) for p in CONF_FILES])
def test_a_conf_file_carries_at_most_three_comment_lines(path):
    comments, _ = _comment_and_setting_lines(path)
    assert comments <= 3, f"{path.relative_to(ROOT)} has {comments} comment lines (at most 3)"


def test_conf_comment_lines_are_at_most_a_third_of_its_setting_lines():
    counts = [_comment_and_setting_lines(p) for p in CONF_FILES]
    comments, settings = sum(c for c, _ in counts), sum(s for _, s in counts)
    assert comments * 3 <= settings, f"conf/ has {comments} comment lines against {settings} setting lines"


RESULT_FILE = re.compile(r"bench/results|\b\w+_(?:ab|default|seed\d)\w*\.json\b|\blearn_\w+\.json\b")


def test_no_comment_in_textrl_cites_a_result_file():
    """Code says why; what a run measured lives in bench/results/ and docs/results.md."""
    package = ROOT / "textrl"
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if RESULT_FILE.search(line)]
    assert not cited, "comments citing result files:\n" + "\n".join(cited)
