"""One rank of a plait command in a process of its own: a fake process group, a memory peak and a compile
cache are per process, so `plait fit --ranks` and `plait compile --ranks` run each rank they check this way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from plait.core.errors import PlaitError


def rank_in_subprocess(command: str, argv: list[str], rank: int, *extra: str) -> dict:
    """`plait COMMAND ARGV --rank RANK --json FILE EXTRA` in a new process: the first record of its JSON report,
    or a PlaitError with its exit code and the end of its error output when it wrote none."""
    with tempfile.TemporaryDirectory(prefix=f"plait-{command}-") as tmp:
        out = os.path.join(tmp, "rank.json")
        cmd = [sys.executable, "-m", "plait.cli", command, *argv, "--rank", str(rank), "--json", out, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if not os.path.exists(out):
            raise PlaitError(f"rank {rank} ended with exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(out) as f:
            return json.load(f)[0]
