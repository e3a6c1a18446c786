"""The README and docs/ are user documentation: what it does, how to run it, current figures with
their commands. Session history (what did not land, issue and stop numbers, CI anecdotes, commit
hashes, "not done" lists) belongs in commit messages, not here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

HISTORY = re.compile(
    r"did not land|\bissue \d+|\(issue|\bstop \d+|\bstop-\d+|not done|\bCI run|"
    r"\bcommit [0-9a-f]{7}|`(?=[0-9]*[a-f])[0-9a-f]{7,12}`",
    re.IGNORECASE,
)


def test_docs_hold_no_session_history() -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert found == []


def test_the_history_pattern_finds_what_it_is_for() -> None:
    for text in (
        "measured on commits of a session that did not land",
        "(issue 12, item 3)",
        "the stop-16 figures",
        "## Not done yet",
        "a CI run failed",
        "gateway at `d6e00ac`",
    ):
        assert HISTORY.search(text), text
    for text in ("`1073741824`", "`33554432`", "sha256_cbor", "a session's next turn"):
        assert not HISTORY.search(text), text


def test_the_benchmark_pages_stay_short() -> None:
    """The user-facing benchmark pages say what runs, the command and the current figures, in
    under 800 lines together; the history of every figure is in docs/lab/."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    pages = [docs / "benchmarks.md", docs / "benchmarks_live.md", docs / "benchmarks_sim.md"]
    total = sum(len(p.read_text().splitlines()) for p in pages)
    assert total < 800, total
