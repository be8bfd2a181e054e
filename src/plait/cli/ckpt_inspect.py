"""`plait ckpt inspect PATH`: a checkpoint's step, model, size, data position, config and tensors, as tables.

Everything is read from plait.json and DCP's metadata (never unpickled): no tensor is loaded."""

from __future__ import annotations

import re
from typing import Any, cast

import torch
from rich.console import Console, JustifyMethod
from rich.table import Table

from plait.config import Config
from plait.core.storage import DCP_METADATA, Location, file_sizes, parse_metadata, read_bytes
from plait.engine.checkpoint import list_checkpoints, local_file, read_config, read_meta, resolve_checkpoint
from plait.interop.hf import param_shapes
from plait.model import ModelArgs


def _param_summary(m) -> str:
    total = m.num_params()
    line = f"{total:,} ({total / 1e6:.2f}M; {m.num_params(exclude_embeddings=True):,} non-embedding"
    if m.moe_experts:
        line += f"; {m.num_params(active=True):,} active per token"
    return line + ")"


def inspect_checkpoint(path: str) -> int:
    """`plait ckpt inspect PATH`: the checkpoint's summary table, then its tensors."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = read_config(ckpt)
    m = cfg.model
    shapes = param_shapes(m)
    numel = sum(_prod(s) for s in shapes.values())  # parameters and persistent buffers (MoE routing biases)
    files = file_sizes(ckpt)
    state = meta.get("train_state", {})
    rows: list[tuple[str, str]] = [
        ("checkpoint", str(ckpt)),
        ("format", f"{meta.get('format', '?')}{', weights only' if meta.get('weights_only') else ''}"),
    ]
    if "imported_from" in meta:
        src = meta["imported_from"]
        rows.append(("imported from", f"{src.get('path')} ({src.get('model_type')})"))
    rows += [
        ("step", f"{state.get('step', '?'):,}" if isinstance(state.get("step"), int) else "?"),
        ("tokens", f"{state['tokens']:,}" if isinstance(state.get("tokens"), int) else "?"),
        ("model", _shape_summary(m)),
        ("rotary", _rope_summary(m)),
        ("parameters", _param_summary(m)),
        ("model tensors", f"{len(shapes)} tensors, {_bytes(4 * numel)} in fp32"),
        ("optimizer state", _optim_summary(meta)),
        ("files", f"{len(files)} files, {_bytes(sum(files.values()))} on disk"),
        ("data position", _data_summary(meta)),
        ("tokenizer", _tokenizer_summary(ckpt)),
        ("config", _config_summary(cfg)),
    ]
    others = list_checkpoints(ckpt.parent)
    if len(others) > 1:
        rows.append(("checkpoints here", ", ".join(p.name for p in others)))
    table = Table(title=f"plait checkpoint {ckpt.name}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    console = Console(width=120)
    console.print(table)
    console.print(_tensor_table(ckpt))
    return 0


def _tensor_table(ckpt) -> Table:
    """Every tensor of the checkpoint from DCP's metadata (read without unpickling): name, shape, dtype.
    Names that differ only in the layer index are one row (`layers.*`, with the count); each group (model,
    optimizer state, RNG) ends with its total count and bytes."""
    md = parse_metadata(read_bytes(ckpt / DCP_METADATA))
    rows: dict[tuple[str, str, tuple, str], list[int]] = {}
    for key, entry in md.state_dict_metadata.items():
        size, dtype = getattr(entry, "size", None), getattr(getattr(entry, "properties", None), "dtype", None)
        if size is None:
            continue
        group, _, name = key.partition(".")
        folded = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name)
        dtype_name = str(dtype).removeprefix("torch.")
        nbytes = _prod(tuple(size)) * (_dtype_bytes(dtype) if dtype is not None else 0)
        row = rows.setdefault((group, folded, tuple(size), dtype_name), [0, 0])
        row[0] += 1
        row[1] += nbytes
    table = Table(title="tensors", title_justify="left")
    for col, justify in (
        ("group", "left"),
        ("name", "left"),
        ("count", "right"),
        ("shape", "left"),
        ("dtype", "left"),
        ("bytes", "right"),
    ):
        table.add_column(col, justify=cast(JustifyMethod, justify), overflow="fold")
    titles = {"model": "model", "optim": "optimizer", "rng": "rng"}
    for group in sorted({g for g, *_ in rows}, key=lambda g: list(titles).index(g) if g in titles else 9):
        mine = [(k, v) for k, v in rows.items() if k[0] == group]
        for (_, name, size, dtype), (count, nbytes) in mine:
            table.add_row(
                titles.get(group, group), name, str(count), "x".join(map(str, size)) or "scalar", dtype, _bytes(nbytes)
            )
        count = sum(v[0] for _, v in mine)
        table.add_row(
            "",
            f"[bold]{titles.get(group, group)} total",
            f"[bold]{count}",
            "",
            "",
            f"[bold]{_bytes(sum(v[1] for _, v in mine))}",
            end_section=True,
        )
    return table


def _dtype_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _shape_summary(m: ModelArgs) -> str:
    text = (
        f"dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.n_kv_heads} kv, head_dim {m.head_dim}), "
        f"ffn {m.hidden_dim}, vocab {m.vocab_size}, max_seq_len {m.max_seq_len}, "
        f"tied embeddings {'yes' if m.tie_embeddings else 'no'}"
    )
    if m.sliding_window:
        text += f", sliding window {m.sliding_window}"
    return text + (", q/k/v biases" if m.qkv_bias else "")


def _rope_summary(m: ModelArgs) -> str:
    text = f"theta {m.rope_theta:g}"
    if m.rope_scaling_factor:
        text += (
            f", llama3 scaling x{m.rope_scaling_factor:g} (original context {m.rope_original_max_seq_len}, "
            f"low/high freq factors {m.rope_low_freq_factor:g}/{m.rope_high_freq_factor:g})"
        )
    return text


def _optim_summary(meta: dict[str, Any]) -> str:
    groups = meta.get("param_groups")
    if not groups:
        return "none (weights only: training starts a fresh optimizer)"
    g = groups[0]
    return f"AdamW, {len(groups)} parameter groups (lr {g.get('lr', 0):.3g}, betas {g.get('betas')})"


def _data_summary(meta: dict[str, Any]) -> str:
    loader = meta.get("loader")
    if not loader:
        return "none (no training data consumed)"
    samples, batch, seq = loader["samples_consumed"], loader["global_batch_size"], loader["seq_len"]
    return (
        f"{samples:,} samples consumed ({samples // max(1, batch):,} batches of {batch} x {seq} tokens), "
        f"data seed {loader.get('seed')}"
    )


def _tokenizer_summary(ckpt: Location) -> str:
    path = local_file(ckpt / "tokenizer.json")
    if path is None:
        return "none (plait generate needs a tokenizer.json here)"
    from plait.data import load_tokenizer

    return f"tokenizer.json, vocabulary {load_tokenizer(path).get_vocab_size():,}"


def _config_summary(cfg: Config) -> str:
    t, o, d = cfg.train, cfg.optim, cfg.data
    return (
        f"data {d.source} (seq_len {d.seq_len}), {t.steps} steps x batch {t.global_batch_size}, "
        f"lr {o.lr:g} {o.schedule} (warm-up {o.warmup_steps}), precision {t.mixed_precision}, "
        f"seed {cfg.run.seed}"
    )


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
