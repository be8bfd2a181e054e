"""The README's knowledge walk-through runs verbatim: make the facts, build the database of everyone's
biographies, train a retrieval model (with the pointer) on the training text whose neighbours are found in it,
ask, swap the database for one where every fact is changed, ask again. Each line of the README's block runs
as written, in order, in a fresh directory (bench/ linked in). The answers are checked, not only the exit
codes: on people who exist only in the database the model answers far above chance, and after the swap it
gives the new facts and not the old ones, with no training in between."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- the knowledge walk-through: run verbatim by tests/e2e/test_knowledge_walkthrough.py -->"
CHANCE = 0.02
"""Above the chance of a database-only answer: the plain model, which can only guess from the pools, scores
0.005-0.009 on them in bench/knowledge.py (3 seeds)."""
FLOOR = 0.2
"""The least exact-match rate on database-only people, with the database and with the swapped one (the bench's
pointer model: 0.42-0.46 on seed 0; this run is one seed, so well below that)."""


def walkthrough() -> list[str]:
    """The README's walk-through block: its lines, continuation lines joined, comments cut."""
    text = (ROOT / "README.md").read_text()
    assert MARK in text, "the README lost its knowledge walk-through"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARK) :], flags=re.S)
    assert block is not None
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block[1].replace("\\\n", " ").splitlines()]
    return [re.sub(r"\s+", " ", line) for line in lines if line]


def rates(printed: str) -> dict[str, float]:
    """`plait eval --qa`'s lines: split -> exact-match rate."""
    return {m[1]: float(m[2]) for m in re.finditer(r"qa (\S+): exact match ([0-9.]+)", printed)}


@pytest.mark.slow
def test_the_knowledge_walkthrough_answers_from_the_database_and_follows_the_swap(tmp_path):
    (tmp_path / "bench").symlink_to(ROOT / "bench")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    asked = []
    for line in walkthrough():
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, env=env,
                              timeout=900)  # fmt: skip
        assert done.returncode == 0, f"{line}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        if " --qa " in line:
            asked.append((line, rates(done.stdout + done.stderr)))
    assert len(asked) == 3, asked
    (_, before), (_, new), (_, old) = asked
    assert before["database_only"] >= FLOOR > CHANCE, before
    assert new["database_only"] >= FLOOR and new["read"] >= FLOOR, new  # the answers follow the new facts
    assert old["database_only"] <= CHANCE and old["read"] <= CHANCE, old  # and leave the old ones
