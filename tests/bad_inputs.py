"""The one judge of every bad-input table: a command met with malformed input exits 2 with one clear line.

Each table (tests/test_malformed*.py) builds its argv and the words its message must contain; `judge` runs the
real command in this process (`plait.cli.main`, in `root` as the working directory, so anything written by
default lands where it is seen) and checks the exit status, that no traceback escapes, that the message names
the problem, and that nothing under `root` changed (every file hashed before and after)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from plait.cli import main


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def run_cli(argv: list[str], cwd: Path) -> int:
    """`plait ARGV` in this process, in `cwd`; argparse's usage errors give their exit status too."""
    before = os.getcwd()
    os.chdir(cwd)
    try:
        try:
            return main(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(before)


def judge(name: str, argv: list[str], words: str, root: Path, capsys, *, protected: Path | None = None) -> str:
    """Assert `plait ARGV` exits 2 with one clear line containing `words`, no traceback, and nothing under
    `root` (and `protected`, where given) changed. Returns what it printed on stderr."""
    roots = [root] + ([protected] if protected is not None else [])
    before = [snapshot(r) for r in roots]
    code = run_cli(argv, root)
    err = capsys.readouterr().err
    assert code == 2, (name, code, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert words in err, (name, words, err[-2000:])
    assert [snapshot(r) for r in roots] == before, f"{name}: files changed on disk"
    return err
