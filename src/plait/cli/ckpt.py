"""`plait ckpt`: inspect a checkpoint, export it (Hugging Face / safetensors), import a Hugging Face model.

    plait ckpt inspect PATH
    plait ckpt export PATH --format hf|safetensors --out DIR [--dtype fp32|bf16] [--max-shard-size 5GB] [--overwrite]
    plait ckpt import HF_DIR --out RUN_DIR_OR_CKPT_DIR [--overwrite]

PATH is a checkpoint directory (``.../checkpoints/step_<N>``) or a run directory (its newest checkpoint).
An import writes a weights-only checkpoint ``step_00000000`` (model tensors + plait.json, no optimizer
state) and, for a run directory, the run's ``config.toml`` to fine-tune from.

Import and Hugging Face export stream (``plait.interop.streaming``): one tensor at a time is read, converted
and written, so their memory is bounded by the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console, JustifyMethod
from rich.table import Table
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from plait.cli.args import PlaitParser
from plait.config import Config, to_dict, to_toml, validate
from plait.core.errors import ConfigError, PlaitError
from plait.core.progress import phase
from plait.core.storage import Location, dcp_writer, file_sizes
from plait.data.chat import chat_files
from plait.engine.checkpoint import (
    META,
    checkpoint_model,
    list_checkpoints,
    local_file,
    read_config,
    read_meta,
    resolve_checkpoint,
)
from plait.engine.runlock import RunLock
from plait.interop.hf import (
    HFWeights,
    export_safetensors,
    hf_export,
    open_hf,
    param_shapes,
)
from plait.interop.hf.names import ARCHITECTURES
from plait.interop.shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size
from plait.interop.streaming import CheckpointTensors, StreamedHash, checkpoint_sources, save_streamed
from plait.model import ModelArgs, Transformer
from plait.model.lora import merge_lora

CHECKPOINT_FORMAT = "plait-checkpoint-v1"
_STEP_DIR = re.compile(r"^step_\d+$")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cmd_ckpt(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait ckpt", description="Inspect, export and import model checkpoints.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("inspect", help="Show a checkpoint's step, model, size, data position and config.")
    p.add_argument("path", help="A checkpoint directory, or a run directory (its newest checkpoint).")
    p = sub.add_parser("export", help="Write a checkpoint's model as a Hugging Face directory or safetensors.")
    p.add_argument("path", help="A checkpoint directory, or a run directory (its newest checkpoint).")
    p.add_argument(
        "--format",
        choices=["hf", "safetensors", "peft"],
        default="hf",
        help="'hf': a transformers directory, of the family that computes what the model does ("
        f"{', '.join(ARCHITECTURES.values())}); 'safetensors': one file with plait's names; 'peft': a LoRA "
        "run's adapter (PATH: the run, one of its checkpoints or an adapter file) as a PEFT adapter directory.",
    )
    p.add_argument(
        "--base",
        help="peft: the transformers directory of the adapter's base, for adapter_config.json's "
        "base_model_name_or_path (default: the base the adapter recorded).",
    )
    p.add_argument("--out", required=True, help="Output directory (for safetensors also a path ending .safetensors).")
    p.add_argument("--dtype", choices=list(_DTYPES), default="fp32", help="Data type of the written weights.")
    p.add_argument(
        "--max-shard-size",
        help="hf: the largest weight file, as transformers' save_pretrained(max_shard_size=...): bytes or a "
        "number with KB/MB/GB/TB (powers of 10). Past it the weights are split into "
        "model-0000i-of-0000N.safetensors with model.safetensors.index.json; a tensor larger than it gets a "
        f"file of its own. Default: {DEFAULT_MAX_SHARD_SIZE}.",
    )
    p.add_argument("--overwrite", action="store_true", help="Replace an existing output.")
    p.add_argument(
        "--registry", help="Lineage registry to record the export in; default: lineage.sqlite in or above PATH."
    )
    p = sub.add_parser("import", help="Make a plait checkpoint from a Hugging Face model directory.")
    p.add_argument(
        "hf_dir", help=f"A transformers directory ({', '.join(ARCHITECTURES.values())}): config.json and safetensors."
    )
    p.add_argument(
        "--out", required=True, help="A run directory (gets checkpoints/step_00000000) or a step_<N> directory."
    )
    p.add_argument("--overwrite", action="store_true", help="Move an existing output aside first.")
    p.add_argument(
        "--registry", help="Lineage registry to record the import in; default: lineage.sqlite beside the run."
    )
    a = parser.parse_args(argv)
    return {"inspect": _inspect, "export": _export, "import": _import}[a.action](a)


# ------------------------------------------------------------------------------------------------ loading


def load_checkpoint_model(ckpt: Location, device: str | torch.device = "cpu") -> Transformer:
    """The model of a checkpoint directory (its weights only, a LoRA run's adapters included), in fp32."""
    return cast(Transformer, checkpoint_model(ckpt, device))


def write_weights_checkpoint(
    model: Transformer, ckpt_dir: Path, *, config: dict, tokenizer_path: Path | None, extra: dict
) -> Path:
    """A checkpoint holding only the model: DCP tensors (as CheckpointManager names them) + plait.json.

    plait.json carries ``"weights_only": true`` and step 0; written to ``<dir>.tmp`` then renamed.
    """
    state = {"model": get_model_state_dict(model)}

    def save(tmp: Path) -> dict:
        with warnings.catch_warnings():  # DCP 'assumes' a single process without a group: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp_writer(tmp), no_dist=True)
        return {}

    return _publish_weights(ckpt_dir, save, config=config, tokenizer_path=tokenizer_path, extra=extra)


def write_imported_checkpoint(
    hf: HFWeights, ckpt_dir: Path, *, config: dict, tokenizer_path: Path | None, extra: dict
) -> str:
    """``write_weights_checkpoint`` of a Hugging Face directory's weights, streamed: each tensor is read
    (mapped), cast to fp32, hashed and written when DCP's writer reaches it, so the process never holds the
    model. Returns the weights hash (``plait.core.digest``), which plait.json carries as a trained checkpoint's
    does."""
    shapes, sources = param_shapes(hf.args), checkpoint_sources(hf.args)
    hashed = StreamedHash()

    def produce(key: str) -> torch.Tensor:
        tensor = hf.read(sources[key]).float()
        if sources[key] == key:  # not the tied output.weight, which repeats the embeddings
            hashed.add(key, tensor)
        return tensor

    def save(tmp: Path) -> dict:
        save_streamed(tmp, {key: shapes[src] for key, src in sources.items()}, produce)
        return {"weights_hash": hashed.hexdigest()}

    _publish_weights(ckpt_dir, save, config=config, tokenizer_path=tokenizer_path, extra=extra)
    return read_meta(ckpt_dir)["weights_hash"]


def _publish_weights(ckpt_dir: Path, save, *, config: dict, tokenizer_path: Path | None, extra: dict) -> Path:
    """Run ``save(tmp)`` (which writes the tensors and returns more plait.json entries), write plait.json and
    the tokenizer, and publish the directory whole as ``ckpt_dir`` (core.publish.staged_dir, the one way)."""
    from plait.core.publish import staged_dir

    exists = ConfigError(f"{ckpt_dir} exists; choose another --out")
    with staged_dir(ckpt_dir, overwrite=False, exists_error=exists) as tmp:
        described = save(tmp)
        meta = {
            "format": CHECKPOINT_FORMAT,
            "weights_only": True,
            "train_state": {"step": 0, "tokens": 0},
            "config": config,
            **extra,
            **described,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            for path in chat_files(tokenizer_path):  # an instruct model's chat template comes along
                shutil.copyfile(path, tmp / path.name)
    return ckpt_dir


# ------------------------------------------------------------------------------------------------ inspect


def _param_summary(m) -> str:
    total = m.num_params()
    line = f"{total:,} ({total / 1e6:.2f}M; {m.num_params(exclude_embeddings=True):,} non-embedding"
    if m.moe_experts:
        line += f"; {m.num_params(active=True):,} active per token"
    return line + ")"


def _inspect(a: argparse.Namespace) -> int:
    ckpt = resolve_checkpoint(a.path)
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
    import re

    from plait.core.storage import DCP_METADATA, parse_metadata, read_bytes

    md = parse_metadata(read_bytes(ckpt / DCP_METADATA))
    rows: dict[tuple[str, str, tuple, str], list[int]] = {}
    for key, entry in md.state_dict_metadata.items():
        size, dtype = getattr(entry, "size", None), getattr(getattr(entry, "properties", None), "dtype", None)
        if size is None:
            continue
        group, _, name = key.partition(".")
        folded = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name)
        dtype_name = str(dtype).removeprefix("torch.")
        nbytes = _prod(tuple(size)) * (torch_dtype_bytes(dtype) if dtype is not None else 0)
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


def torch_dtype_bytes(dtype) -> int:
    import torch

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


# ------------------------------------------------------------------------------------------------- export


def _export(a: argparse.Namespace) -> int:
    if a.max_shard_size is not None and a.format != "hf":
        raise ConfigError(f"--max-shard-size applies to --format hf; --format {a.format} writes one weight file")
    if a.base is not None and a.format != "peft":
        raise ConfigError("--base names a PEFT adapter's base: it applies to --format peft")
    if a.format == "peft":
        return _export_peft(a)
    max_shard_size = parse_shard_size(DEFAULT_MAX_SHARD_SIZE if a.max_shard_size is None else a.max_shard_size)
    ckpt = resolve_checkpoint(a.path)
    out = Path(a.out)
    target = out if a.format == "hf" or out.suffix == ".safetensors" else out / "model.safetensors"
    if _occupied(target) and not a.overwrite:  # before loading the model, which may take long
        raise ConfigError(f"{target} exists; pass --overwrite or choose another --out")
    registry = _export_registry(a, ckpt)
    dtype = _DTYPES[a.dtype]
    if a.format == "hf":
        with phase(f"exporting {ckpt} to {out}"):  # reads and writes every tensor: minutes for a large model
            hashes = export_checkpoint_hf(
                ckpt,
                out,
                tokenizer_path=local_file(ckpt / "tokenizer.json"),
                dtype=dtype,
                overwrite=a.overwrite,
                max_shard_size=max_shard_size,
                hashed=registry is not None,
            )
        hint = f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
    else:
        with phase(f"exporting {ckpt} to {target}"):
            model = cast(Transformer, merge_lora(load_checkpoint_model(ckpt)))  # a LoRA run: its adapters folded in
            export_safetensors(model, target, dtype=dtype, overwrite=a.overwrite)
        hint = f"load it with plait.interop.load_safetensors({str(target)!r})"
        if model.args.retrieval_ids:  # the weights alone do not retrieve: a pointer to the database beside them
            hint += f"; its retrieval database: {_retrieval_pointer(ckpt, target)}"
        hashes = None
        if registry is not None:
            from plait.lifecycle.lora import model_weights_hash

            source = model_weights_hash(model)
            hashes = source, model_weights_hash(model.to(dtype).float()) if dtype != torch.float32 else source
    recorded = ""
    if registry is not None:
        assert hashes is not None  # hashed for a registry
        recorded = _record_export(a, registry, ckpt, target, *hashes)
    tune = read_config(ckpt).finetune
    if tune.lora_rank:
        hint += f"; a LoRA run: its r={tune.lora_rank} adapters are merged in (--format peft writes them alone)"
    print(f"wrote {target} ({a.format}, {a.dtype}) from {ckpt}; {hint}{recorded}")
    return 0


def _retrieval_pointer(ckpt: Location, target: Path) -> Path:
    """Write `<weights>.retrieval.json` beside an exported retrieval model: the database it trained with
    (plait.data.retrieval.database_record), which generation reads (plait generate --data DIR)."""
    from plait.data.retrieval import database_record
    from plait.engine.checkpoint import read_config

    source = read_config(ckpt).data.source
    record = {"trained_on": source, **database_record(source)}
    pointer = target.with_name(f"{target.stem}.retrieval.json")
    pointer.write_text(json.dumps(record, indent=2) + "\n")
    return pointer


def _export_peft(a: argparse.Namespace) -> int:
    """A LoRA run's adapter (its newest, that of one of its checkpoints, or an adapter file) as PEFT's format."""
    from plait.core.publish import staged_dir
    from plait.interop.peft import check_peft_base, write_peft_adapter
    from plait.lifecycle.lora import parse_targets, read_adapter, resolve_adapter

    if a.registry is not None:
        raise ConfigError("--registry records model exports; a LoRA run records its adapters itself: leave it out")
    path = Path(a.path)
    if path.parent.name == "checkpoints" and (path / META).is_file():  # a checkpoint of a LoRA run: its adapter
        path = path.parent.parent / "adapters" / f"{path.name}.safetensors"
    adapter = resolve_adapter(path)
    meta, tensors = read_adapter(adapter)
    out = Path(a.out)
    exists = ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    if _occupied(out) and not a.overwrite:
        raise exists
    if a.base:
        check_peft_base(a.base)
    base = a.base or meta.get("base_path", "")
    with staged_dir(out, overwrite=a.overwrite, exists_error=exists) as tmp:  # the old copy goes after the rename
        write_peft_adapter(
            tmp,
            {k: v.to(_DTYPES[a.dtype]) for k, v in tensors.items()},
            rank=int(meta["rank"]),
            alpha=float(meta["alpha"]),
            dropout=float(meta.get("dropout", 0.0) or 0.0),
            targets=parse_targets(meta["targets"]),
            base=base,
            metadata={"base_weights_hash": meta.get("base_weights_hash", ""), "plait_adapter": str(adapter)},
            chat_template=_trained_chat_template(adapter),
        )
    print(
        f"wrote {out} (PEFT LoRA adapter, r={meta['rank']}, lora_alpha={float(meta['alpha']):g}, {a.dtype}) from "
        f"{adapter}\nload it onto the transformers export of its base: peft.PeftModel.from_pretrained("
        f"AutoModelForCausalLM.from_pretrained(BASE_HF), {str(out)!r})"
        + (f", with BASE_HF written by: plait ckpt export {base} --out BASE_HF" if base and not a.base else "")
    )
    return 0


def _trained_chat_template(adapter: Path) -> str | None:
    """The chat template a LoRA run's data was rendered with (its prepared directory's manifest records it under
    loss_mask.chat_template), for the PEFT export to carry; None when the run trained without one."""
    from plait.data.chat import load_chat_template
    from plait.data.loader import read_manifest

    run = adapter.parent.parent if adapter.parent.name == "adapters" else None
    try:
        source = Path(read_config(resolve_checkpoint(run)).data.source) if run is not None else None
        recorded = (read_manifest(source).get("loss_mask") or {}).get("chat_template") if source else None
    except PlaitError:  # a run without checkpoints, or data no longer here: nothing to carry
        return None
    chat = load_chat_template(source) if recorded and source is not None else None
    return chat.text if chat is not None else None


def export_checkpoint_hf(
    ckpt: Location,
    out: Path,
    *,
    tokenizer_path: Path | None,
    dtype: torch.dtype,
    overwrite: bool,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    hashed: bool = False,
) -> tuple[str, str] | None:
    """Stream a checkpoint's model into a Hugging Face directory, one tensor at a time (read in fp32, cast,
    written into its shard). With ``hashed``: (weights hash of the checkpoint, weights hash of the weights as
    written, which differs for bf16), for the lineage registry, taken in the same pass.

    A LoRA run's checkpoint is written as the model it trained: each adapter folded into its weight.

    The checkpoint's hash is the one its plait.json carries where it has one (taken from the weights as they
    were saved; not for a LoRA run, whose export is the merged weights, hashed as they are read)."""
    cfg = read_config(ckpt)
    args, tune = cfg.model, cfg.finetune
    lora = (tune.lora_rank, tune.lora_alpha, tune.lora_targets) if tune.lora_rank else None
    recorded = read_meta(ckpt).get("weights_hash") if lora is None else None
    source = CheckpointTensors(ckpt, args, lora)
    read_hash, written_hash = StreamedHash(), StreamedHash()
    with hf_export(
        out,
        args,
        order=list(param_shapes(args)),
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_size=max_shard_size,
    ) as write:
        for name in param_shapes(args):
            tensor = source.read(name)
            if hashed and not recorded:
                read_hash.add(name, tensor)
            tensor = tensor.to(dtype)
            if hashed and dtype != torch.float32:
                written_hash.add(name, tensor, as_dtype=torch.float32)  # the weights as a reader gets them
            write(name, tensor)  # meanwhile the digests run
            read_hash.wait()  # before the next read: one tensor at a time
            written_hash.wait()
            del tensor
    if not hashed:
        return None
    source_hash = recorded or read_hash.hexdigest()
    return source_hash, written_hash.hexdigest() if dtype != torch.float32 else source_hash


def _export_registry(a: argparse.Namespace, ckpt: Location):
    """The lineage registry covering the checkpoint (--registry, else one in or above it), or None."""
    from plait.lifecycle.lineage import open_registry

    return open_registry(a.registry, ckpt if isinstance(ckpt, Path) else str(ckpt))  # a URL: none near it


def _record_export(
    a: argparse.Namespace, registry, ckpt: Location, target: Path, source_hash: str, written_hash: str
) -> str:
    """Record the export in the lineage registry as a child of the checkpoint, with the hash of the weights
    as written (a bf16 export has other weights than its source)."""
    from plait.lifecycle.models import Loaded, artifact_for

    meta = read_meta(ckpt)
    # The weights are known by their hash alone here: artifact_for reads no weights once the hash is set.
    source = Loaded(
        None,  # type: ignore[arg-type]
        "checkpoint",
        ckpt,
        None,
        meta.get("config"),
        {k: meta[k] for k in meta if k == "imported_from"},
        _hash=source_hash,
    )
    parent = artifact_for(registry, source)
    registry.record(
        "export",
        name=target.name if a.format == "safetensors" else Path(a.out).name,
        path=target if a.format == "safetensors" else Path(a.out),
        parent=parent.id,
        weights_hash=written_hash,
        extra={"format": a.format, "dtype": a.dtype, "source": str(ckpt)},
    )
    return f" (recorded in the lineage registry {registry.path})"


# ------------------------------------------------------------------------------------------------- import


def _import(a: argparse.Namespace) -> int:
    hf_dir, out = Path(a.hf_dir), Path(a.out)
    if not hf_dir.is_dir():
        raise PlaitError(f"{hf_dir} is not a directory: give a Hugging Face model directory")
    run_dir = None if _STEP_DIR.match(out.name) else out
    ckpt_dir = out if run_dir is None else out / "checkpoints" / "step_00000000"
    if _occupied(out) and not a.overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite (it is moved aside) or choose another --out")
    hf = open_hf(hf_dir)  # checks names and shapes; reads no tensor
    args = hf.args
    cfg = Config()
    cfg.model = args
    cfg.data.seq_len = min(cfg.data.seq_len, args.max_seq_len)
    if run_dir is not None:
        cfg.run.name, cfg.run.out_dir = run_dir.name, str(run_dir.parent)
    validate(cfg)
    # A run directory written while a run trains in it would lose that run's work: its lock is taken first.
    lock = RunLock.for_run(cfg).acquire() if run_dir is not None else None
    try:
        return _write_import(a, hf, hf_dir, out, ckpt_dir, run_dir, cfg)
    finally:
        if lock is not None:
            lock.release()


def _write_import(a, hf, hf_dir: Path, out: Path, ckpt_dir: Path, run_dir: Path | None, cfg: Config) -> int:
    args = hf.args
    if _occupied(out):
        backup = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        out.rename(backup)
        print(f"--overwrite: previous {out} moved to {backup}")
    tokenizer = hf_dir / "tokenizer.json"
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        ckpt_dir.rmdir()  # an empty directory given as --out
    with phase(f"importing {hf_dir} into {ckpt_dir}"):  # every tensor read, converted and written
        digest = write_imported_checkpoint(
            hf,
            ckpt_dir,
            config=to_dict(cfg),
            tokenizer_path=tokenizer if tokenizer.is_file() else None,
            extra={
                "imported_from": {
                    "path": str(hf_dir.resolve()),
                    "model_type": hf.config.get("model_type"),
                    "architectures": hf.config.get("architectures"),
                    "dtype": hf.config.get("dtype", hf.config.get("torch_dtype")),
                }
            },
        )
    recorded = _record_import(a, ckpt_dir, run_dir, digest, to_dict(cfg))
    lines = [f"wrote {ckpt_dir}: {args.num_params() / 1e6:.2f}M parameters from {hf_dir}{recorded}"]
    if not tokenizer.is_file():
        lines.append(f"note: {hf_dir} has no tokenizer.json; copy one into {ckpt_dir} for `plait generate`")
    if run_dir is not None:
        (run_dir / "config.toml").write_text(to_toml(cfg))
        lines.append(
            f"fine-tune: plait data prepare CORPUS --out DATA --tokenizer {tokenizer}\n"
            f"           plait train {run_dir / 'config.toml'} --data.source=DATA"
        )
    print("\n".join(lines))
    return 0


def _record_import(a: argparse.Namespace, ckpt_dir: Path, run_dir: Path | None, digest: str, config: dict) -> str:
    """Record the imported weights as an 'import' artifact (with their hash), so a run fine-tuning them finds
    its parent. Into --registry, else the registry covering the output, else (a run directory) the one a
    run there would use: <out_dir>/lineage.sqlite."""
    from plait.lifecycle.lineage import Registry, open_registry, registry_path

    registry = open_registry(a.registry, ckpt_dir, create=True)
    if registry is None and run_dir is not None:
        registry = Registry(registry_path(run_dir.parent), create=True)
    if registry is None:
        return ""
    meta = read_meta(ckpt_dir)
    registry.record(
        "import",
        name=run_dir.name if run_dir is not None else ckpt_dir.name,
        path=ckpt_dir,
        weights_hash=digest,
        config=config,
        extra={"imported_from": meta["imported_from"]},
    )
    return f" (recorded in the lineage registry {registry.path})"


def _occupied(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))
