"""`plait lineage show REF | diff A B | pins | list [--kind K] [--registry FILE]`: where models came from, and
which checkpoints are kept for what is made from them."""

from __future__ import annotations

from pathlib import Path

from plait.cli.args import PlaitParser
from plait.cli.lifecycle import console, open_registry_near, registry_arg
from plait.core.errors import PlaitError


def cmd_lineage(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait lineage", description="Where models came from.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("show", help="Draw the derivation tree around an artifact, back to its root.")
    p.add_argument("ref", help="An id (prefix), a path, a run name or a weights hash (prefix).")
    registry_arg(p)
    p = sub.add_parser("diff", help="What differs between two artifacts: config keys, data, parents, code.")
    p.add_argument("a")
    p.add_argument("b")
    registry_arg(p)
    p = sub.add_parser(
        "pins", help="Checkpoints kept by their run's retention because something is made from them, and what."
    )
    registry_arg(p)
    p = sub.add_parser("list", help="Every artifact, oldest first.")
    p.add_argument("--kind", help="Only this kind (run, checkpoint, adapter, eval, ...).")
    registry_arg(p)
    a = parser.parse_args(argv)
    near = getattr(a, "ref", None) or getattr(a, "a", None)
    reg = open_registry_near(a.registry, near if near and Path(near).exists() else None)
    if reg is None:
        raise PlaitError("no lineage registry found (looked in and above the path, and ./runs); pass --registry FILE")
    from plait.cli import views_lineage as views

    if a.action == "show":
        views.show(reg, reg.find(a.ref), console)
    elif a.action == "diff":
        views.diff(reg, reg.find(a.a), reg.find(a.b), console)
    elif a.action == "pins":
        pins = reg.pins()
        for ckpt, pin_file, what in pins:
            console.print(f"{ckpt}: kept for {what} ({pin_file}; delete it once that is gone)", highlight=False)
        if not pins:
            console.print("no pinned checkpoints", highlight=False)
    else:
        views.listing(reg, a.kind, console)
    return 0
