"""One rank of a job in a process of its own: a fake process group, a memory peak and a compile cache are per
process, so `plait fit --ranks` and `plait compile --ranks` run each rank they check this way.

Both sides are here: `rank_in_subprocess` (the parent) starts `python -m MODULE REQUEST OUT`, where MODULE is
the library module that does one rank's work (plait.planner.fit_rank, plait.engine.precompile_rank: never the
command line), and that module's `main` is `serve_rank(...)`, which reads the request (JSON), runs the rank and
writes its result (JSON) for the parent to read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

from plait.core.errors import PlaitError


def rank_in_subprocess(module: str, request: dict, rank: int) -> dict:
    """`python -m MODULE REQUEST OUT` in a new process, `request` with "rank" set: the result it wrote, or a
    PlaitError with its exit code and the end of its error output when it wrote none."""
    with tempfile.TemporaryDirectory(prefix="plait-rank-") as tmp:
        asked, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "rank.json")
        with open(asked, "w") as f:
            json.dump({**request, "rank": rank}, f)
        proc = subprocess.run([sys.executable, "-m", module, asked, out], capture_output=True, text=True)
        if not os.path.exists(out):
            raise PlaitError(f"rank {rank} ended with exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(out) as f:
            return json.load(f)[0]


def serve_rank(name: str, run: Callable[[dict], dict], argv: list[str] | None = None) -> int:
    """The child's side: `run(request)` on the request file argv[0], its result written to argv[1]; returns
    the exit code. A user error (PlaitError) is one line on stderr (`plait NAME: error: ...`, as the command
    says it) and its exit code, which the parent reports with that line."""
    asked, out = sys.argv[1:3] if argv is None else argv
    with open(asked) as f:
        request = json.load(f)
    try:
        result = run(request)
    except PlaitError as e:
        code = getattr(e, "exit_code", 2)
        print(f"plait {name}: {'error: ' if code == 2 else ''}{e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"plait {name}: interrupted", file=sys.stderr)
        return 130
    with open(out, "w") as f:
        json.dump([result], f, indent=1)
    return 0
