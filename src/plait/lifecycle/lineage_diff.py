"""How two lineage artifacts differ: their fields, parents, config keys, data, code and metrics, as rows of
(aspect, key, A, B) that `plait lineage diff` shows as a table. A checkpoint has no config of its own: the
nearest ancestor's (its run's) is compared."""

from __future__ import annotations

from typing import Any

from plait.lifecycle.lineage import Artifact, Registry


def short_hash(h: str | None, n: int = 12) -> str:
    """The first `n` characters of a hash, or "-" where there is none."""
    return h[:n] if h else "-"


def format_value(value: Any) -> str:
    """A metric or config value as a table shows it: floats to 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


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
            rows.append(("config", key, format_value(fa.get(key, "-")), format_value(fb.get(key, "-"))))
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
            rows.append(("metrics", key, format_value(ma.get(key, "-")), format_value(mb.get(key, "-"))))
    return rows


def _lbl(reg: Registry, aid: str | None) -> str:
    return reg.get(aid).label if aid else "none"


def _data_rows(a: dict, b: dict) -> list[tuple[str, str, str, str]]:
    if a.get("fingerprint") == b.get("fingerprint"):
        return []
    rows = [("data", "fingerprint", short_hash(a.get("fingerprint")), short_hash(b.get("fingerprint")))]
    if a.get("source") != b.get("source"):
        rows.append(("data", "source", str(a.get("source")), str(b.get("source"))))
    if a.get("tokenizer_sha256") != b.get("tokenizer_sha256"):
        rows.append(("data", "tokenizer", short_hash(a.get("tokenizer_sha256")), short_hash(b.get("tokenizer_sha256"))))
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
