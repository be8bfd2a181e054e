"""How every command ends: a user error (PlaitError) is one line on stderr and its exit code (2, or 75 for a
stop), never a traceback; in a worker of `plait train --nproc` the launcher prints it, once for all ranks."""

from __future__ import annotations

import os
import sys

from plait.core.errors import PlaitError
from plait.core.stop import EXIT_STOPPED


def run_command(name: str, command, argv: list[str]) -> int:
    """command(argv), its exit code, with the errors a user can fix said in one line."""
    from plait.engine.metrics import use_console

    use_console()
    try:
        return command(argv)
    except PlaitError as e:
        code = getattr(e, "exit_code", 2)
        told = code in (2, EXIT_STOPPED) and _told_launcher(str(e), code)
        if str(e) and not told:  # a rank may end silently: the main one says it
            print(f"plait {name}: {'error: ' if code == 2 else ''}{e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"plait {name}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # argparse's --help (0) and usage errors (2): a code for Python callers too
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def run_worker(name: str, command, argv: list[str]) -> None:
    """A process started by `plait train|doctor --nproc`: the command, exiting with its code."""
    code = run_command(name, command, argv)
    if code:
        sys.exit(code)


def _told_launcher(message: str, code: int) -> bool:
    """In a worker of `plait train --nproc`: the launcher prints the error, once for all ranks."""
    if "PLAIT_WORKER_ERRORS" not in os.environ:
        return False
    from plait.cli.launch import report_to_launcher

    return report_to_launcher(message, code)
