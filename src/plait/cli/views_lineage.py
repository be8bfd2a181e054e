"""`plait lineage`'s views of the registry: the derivation tree around an artifact, the table of what differs
between two, and the listing of every artifact (rich markup; the registry and the diff's rows are
plait.lifecycle's)."""

from __future__ import annotations

import datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from plait.lifecycle.lineage import Artifact, Registry, effective_status
from plait.lifecycle.lineage_diff import diff_rows, format_value, short_hash

_KIND_STYLE = {
    "import": "magenta",
    "run": "bold blue",
    "checkpoint": "cyan",
    "adapter": "green",
    "eval": "yellow",
    "merged": "green",
    "export": "white",
    "quantized": "red",
    "pruned": "red",
    "distilled": "red",
}
_METRIC_KEYS = ("step", "loss", "val_loss", "perplexity", "passed", "failed", "perplexity_after", "size_mb_after")


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def label(reg: Registry, art: Artifact, target_id: str | None = None) -> str:
    style = _KIND_STYLE.get(art.kind, "white")
    name = art.name or (Path(art.path).name if art.path else "?")
    parts = [f"[{style}]{art.kind}[/] {escape(name)} [dim]{art.id[:8]}[/]"]
    status = effective_status(art)
    if status not in ("done", "finished"):
        parts.append(f"[{'red' if status in ('died', 'failed') else 'yellow'}]{status}[/]")
    if art.weights_hash:
        parts.append(f"weights {short_hash(art.weights_hash)}")
    if art.base_hash:
        base = reg.by_weights(art.base_hash)
        parts.append(f"base {short_hash(art.base_hash)}" + (f" = {base.id[:8]}" if base else " [red](unknown)[/]"))
    metrics = art.metrics or {}
    shown = [f"{k} {format_value(metrics[k])}" for k in _METRIC_KEYS if k in metrics]
    if shown:
        parts.append(", ".join(shown))
    if art.kind == "run":
        if art.data and art.data.get("fingerprint"):
            parts.append(f"data {escape(str(art.data.get('source')))} ({short_hash(art.data['fingerprint'], 8)})")
        monitors = reg.events(art.id, "monitor")
        if monitors:
            last = monitors[-1]["payload"] or {}
            parts.append(
                f"monitors x{len(monitors)}, last at step {monitors[-1]['step']}: "
                f"{last.get('passed', 0)} passed, {last.get('failed', 0)} failed"
            )
    if art.kind == "import" and art.extra and art.extra.get("imported_from"):
        parts.append(f"from {escape(str(art.extra['imported_from'].get('path')))}")
    if art.path and "://" not in art.path and art.kind not in ("eval", "run") and not Path(art.path).exists():
        parts.append("[dim](deleted)[/]")
    text = " · ".join(parts)
    return f"[reverse]{text}[/reverse] ◀" if art.id == target_id else text


def tree(reg: Registry, target: Artifact, *, max_children: int = 50) -> Tree:
    """The derivation tree from the target's root: its ancestors, siblings and descendants."""
    chain = reg.ancestors(target.id)
    root = chain[-1]
    out = Tree(label(reg, root, target.id))

    def grow(node: Tree, art: Artifact, seen: set[str]) -> None:
        kids = reg.children(art.id)
        for child in kids[:max_children]:
            if child.id in seen:
                continue
            grow(node.add(label(reg, child, target.id)), child, seen | {child.id})
        if len(kids) > max_children:
            node.add(f"[dim]... {len(kids) - max_children} more[/]")

    grow(out, root, {root.id})
    return out


def show(reg: Registry, target: Artifact, console: Console | None = None) -> None:
    console = console or Console(width=120)
    console.print(tree(reg, target))
    chain = reg.ancestors(target.id)
    console.print(
        f"[dim]{target.kind} {target.id} · {len(chain) - 1} ancestors · created {_when(target.created)} · "
        f"registry {reg.path}[/]"
    )


def diff(reg: Registry, a: Artifact, b: Artifact, console: Console | None = None) -> list[tuple[str, str, str, str]]:
    console = console or Console(width=120)
    rows = diff_rows(reg, a, b)
    table = Table(title=f"A = {a.label}   B = {b.label}", title_justify="left")
    for col in ("aspect", "key", "A", "B"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(escape(x) for x in row))
    console.print(table)
    counts: dict[str, int] = {}
    for aspect, *_ in rows:
        counts[aspect] = counts.get(aspect, 0) + 1
    same = [x for x in ("config", "data", "code") if x not in counts]
    console.print(
        "differences: "
        + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none")
        + (f"; same {', '.join(same)}" if same else "")
    )
    return rows


def listing(reg: Registry, kind: str | None, console: Console | None = None) -> None:
    console = console or Console(width=120)
    table = Table(title=f"lineage registry {reg.path}", title_justify="left")
    for col in ("id", "kind", "name", "status", "parent", "weights", "created"):
        table.add_column(col, overflow="fold")
    for art in reg.all(kind):
        table.add_row(
            art.id[:8],
            art.kind,
            escape(art.name or "-"),
            effective_status(art),
            (art.parent_id or "-")[:8],
            short_hash(art.weights_hash),
            _when(art.created),
        )
    console.print(table)
