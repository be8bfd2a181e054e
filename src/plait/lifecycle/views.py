"""Rendering the lineage registry: derivation trees, diffs and listings (rich)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from plait.lifecycle.lineage import Artifact, Registry, effective_status

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


def _short(h: str | None, n: int = 12) -> str:
    return h[:n] if h else "-"


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def label(reg: Registry, art: Artifact, target_id: str | None = None) -> str:
    style = _KIND_STYLE.get(art.kind, "white")
    name = art.name or (Path(art.path).name if art.path else "?")
    parts = [f"[{style}]{art.kind}[/] {escape(name)} [dim]{art.id[:8]}[/]"]
    status = effective_status(art)
    if status not in ("done", "finished"):
        parts.append(f"[{'red' if status in ('died', 'failed') else 'yellow'}]{status}[/]")
    if art.weights_hash:
        parts.append(f"weights {_short(art.weights_hash)}")
    if art.base_hash:
        base = reg.by_weights(art.base_hash)
        parts.append(f"base {_short(art.base_hash)}" + (f" = {base.id[:8]}" if base else " [red](unknown)[/]"))
    metrics = art.metrics or {}
    shown = [f"{k} {_fmt(metrics[k])}" for k in _METRIC_KEYS if k in metrics]
    if shown:
        parts.append(", ".join(shown))
    if art.kind == "run":
        if art.data and art.data.get("fingerprint"):
            parts.append(f"data {escape(str(art.data.get('source')))} ({_short(art.data['fingerprint'], 8)})")
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


# ---------------------------------------------------------------------------------------------------- diff


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _nearest(reg: Registry, art: Artifact, field: str) -> tuple[Any, Artifact | None]:
    """The artifact's own field, else the nearest ancestor's (a checkpoint's config is its run's)."""
    for a in reg.ancestors(art.id):
        value = getattr(a, field)
        if value:
            return value, a
    return None, None


def diff_rows(reg: Registry, a: Artifact, b: Artifact) -> list[tuple[str, str, str, str]]:
    """(aspect, key, A, B) for everything that differs."""
    rows: list[tuple[str, str, str, str]] = []
    for key in ("kind", "name", "path", "status", "weights_hash", "base_hash"):
        va, vb = getattr(a, key), getattr(b, key)
        if va != vb:
            rows.append(("artifact", key, str(va), str(vb)))
    chain_a, chain_b = reg.ancestors(a.id), reg.ancestors(b.id)
    ids_a, ids_b = [x.id for x in chain_a], [x.id for x in chain_b]
    common = next((x for x in chain_a if x.id in ids_b), None)
    if a.parent_id != b.parent_id:
        rows.append(("parents", "parent", _lbl(reg, a.parent_id), _lbl(reg, b.parent_id)))
    if b.id in ids_a:
        rows.append(("parents", "relation", f"descends from B ({ids_a.index(b.id)} generations)", ""))
    elif a.id in ids_b:
        rows.append(("parents", "relation", "", f"descends from A ({ids_b.index(a.id)} generations)"))
    elif common is not None:
        rows.append(
            ("parents", "common ancestor", common.label, f"{ids_a.index(common.id)} / {ids_b.index(common.id)} up")
        )
    else:
        rows.append(("parents", "common ancestor", "none", "none"))
    cfg_a, src_a = _nearest(reg, a, "config")
    cfg_b, src_b = _nearest(reg, b, "config")
    fa, fb = _flatten(cfg_a or {}), _flatten(cfg_b or {})
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            rows.append(("config", key, _fmt(fa.get(key, "-")), _fmt(fb.get(key, "-"))))
    data_a, _ = _nearest(reg, a, "data")
    data_b, _ = _nearest(reg, b, "data")
    rows.extend(_data_rows(data_a or {}, data_b or {}))
    code_a, _ = _nearest(reg, a, "code")
    code_b, _ = _nearest(reg, b, "code")
    for key in sorted(set(code_a or {}) | set(code_b or {})):
        va, vb = (code_a or {}).get(key), (code_b or {}).get(key)
        if va != vb:
            rows.append(("code", key, str(va), str(vb)))
    ma, mb = a.metrics or {}, b.metrics or {}
    for key in sorted(set(ma) | set(mb)):
        if ma.get(key) != mb.get(key):
            rows.append(("metrics", key, _fmt(ma.get(key, "-")), _fmt(mb.get(key, "-"))))
    return rows


def _lbl(reg: Registry, aid: str | None) -> str:
    return reg.get(aid).label if aid else "none"


def _data_rows(a: dict, b: dict) -> list[tuple[str, str, str, str]]:
    if a.get("fingerprint") == b.get("fingerprint"):
        return []
    rows = [("data", "fingerprint", _short(a.get("fingerprint")), _short(b.get("fingerprint")))]
    if a.get("source") != b.get("source"):
        rows.append(("data", "source", str(a.get("source")), str(b.get("source"))))
    if a.get("tokenizer_sha256") != b.get("tokenizer_sha256"):
        rows.append(("data", "tokenizer", _short(a.get("tokenizer_sha256")), _short(b.get("tokenizer_sha256"))))
    sa, sb = a.get("shards") or {}, b.get("shards") or {}
    only_a = sorted(k for k in sa if k not in sb)
    only_b = sorted(k for k in sb if k not in sa)
    changed = sorted(k for k in sa if k in sb and sa[k] != sb[k])
    if only_a or only_b:
        rows.append(("data", "shards only here", ", ".join(only_a[:4]) or "-", ", ".join(only_b[:4]) or "-"))
    if changed:
        rows.append(("data", "shards with other content", ", ".join(changed[:4]), ", ".join(changed[:4])))
    if a.get("num_tokens") != b.get("num_tokens"):
        rows.append(("data", "tokens", str(a.get("num_tokens")), str(b.get("num_tokens"))))
    return rows


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
            _short(art.weights_hash),
            _when(art.created),
        )
    console.print(table)
