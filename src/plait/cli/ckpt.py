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
from pathlib import Path

import torch

from plait.cli.args import PlaitParser
from plait.config import to_dict
from plait.core.errors import ConfigError, PlaitError
from plait.core.progress import phase
from plait.core.storage import Location
from plait.engine.checkpoint import META, local_file, read_config, read_meta, resolve_checkpoint
from plait.engine.runlock import RunLock
from plait.interop.hf.checkpoint import (
    HFImport,
    export_checkpoint_hf,
    export_checkpoint_safetensors,
    plan_import,
    write_import,
    write_retrieval_pointer,
)
from plait.interop.hf.names import ARCHITECTURES
from plait.interop.shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size

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
    if a.action == "inspect":
        from plait.cli.ckpt_inspect import inspect_checkpoint

        return inspect_checkpoint(a.path)
    return {"export": _export, "import": _import}[a.action](a)


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
            model = export_checkpoint_safetensors(ckpt, target, dtype=dtype, overwrite=a.overwrite)
        hint = f"load it with plait.interop.load_safetensors({str(target)!r})"
        if model.args.retrieval_ids:  # the weights alone do not retrieve: a pointer to the database beside them
            hint += f"; its retrieval database: {write_retrieval_pointer(ckpt, target)}"
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


def _export_peft(a: argparse.Namespace) -> int:
    """A LoRA run's adapter (its newest, that of one of its checkpoints, or an adapter file) as PEFT's format."""
    from plait.interop.peft import check_peft_base, publish_peft_adapter
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
    publish_peft_adapter(  # the old copy goes after the rename
        out,
        adapter,
        meta,
        tensors,
        targets=parse_targets(meta["targets"]),
        dtype=_DTYPES[a.dtype],
        base=base,
        overwrite=a.overwrite,
    )
    print(
        f"wrote {out} (PEFT LoRA adapter, r={meta['rank']}, lora_alpha={float(meta['alpha']):g}, {a.dtype}) from "
        f"{adapter}\nload it onto the transformers export of its base: peft.PeftModel.from_pretrained("
        f"AutoModelForCausalLM.from_pretrained(BASE_HF), {str(out)!r})"
        + (f", with BASE_HF written by: plait ckpt export {base} --out BASE_HF" if base and not a.base else "")
    )
    return 0


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
    if _occupied(out) and not a.overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite (it is moved aside) or choose another --out")
    plan = plan_import(hf_dir, out)
    # A run directory written while a run trains in it would lose that run's work: its lock is taken first.
    lock = RunLock.for_run(plan.cfg).acquire() if plan.run_dir is not None else None
    try:
        return _write_import(a, plan)
    finally:
        if lock is not None:
            lock.release()


def _write_import(a: argparse.Namespace, plan: HFImport) -> int:
    hf_dir, ckpt_dir, run_dir = plan.hf_dir, plan.ckpt_dir, plan.run_dir

    def moved(backup: Path) -> None:
        print(f"--overwrite: previous {plan.out} moved to {backup}")

    with phase(f"importing {hf_dir} into {ckpt_dir}"):  # every tensor read, converted and written
        digest = write_import(plan, overwrite=a.overwrite, moved=moved)
    recorded = _record_import(a, ckpt_dir, run_dir, digest, to_dict(plan.cfg))
    lines = [f"wrote {ckpt_dir}: {plan.hf.args.num_params() / 1e6:.2f}M parameters from {hf_dir}{recorded}"]
    if not plan.tokenizer.is_file():
        lines.append(f"note: {hf_dir} has no tokenizer.json; copy one into {ckpt_dir} for `plait generate`")
    if run_dir is not None:
        lines.append(
            f"fine-tune: plait data prepare CORPUS --out DATA --tokenizer {plan.tokenizer}\n"
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
