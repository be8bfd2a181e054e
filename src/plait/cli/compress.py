"""`plait compress quantize|prune|distill`: a smaller model, and its size, speed and perplexity deltas.

plait compress quantize MODEL --bits 8|4 --out DIR
plait compress prune MODEL --method magnitude|structured --sparsity S --out DIR [--finetune-steps N]
plait compress distill --teacher MODEL --out DIR --steps N [--student model.dim=128 ...]
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from plait.cli.args import PlaitParser
from plait.cli.lifecycle import console, data_dir_of, open_registry_near, registry_arg
from plait.core.errors import ConfigError


def _parser() -> PlaitParser:
    parser = PlaitParser(prog="plait compress", description="Quantize, prune or distill a model.")
    sub = parser.add_subparsers(dest="action", required=True)
    q = sub.add_parser("quantize", help="Weight-only int8 (per-channel) or int4 (group-wise) quantization.")
    q.add_argument("model")
    q.add_argument("--bits", type=int, choices=[8, 4], default=8)
    q.add_argument("--group-size", type=int, default=64, help="int4: input columns per scale.")
    q.add_argument(
        "--format",
        choices=["torchao", "plait"],
        default="torchao",
        help="torchao: a transformers directory of torchao-quantized weights (from_pretrained loads it); "
        "plait: plait-quant-v1 (plait's own loader).",
    )
    p = sub.add_parser("prune", help="Magnitude (unstructured) or structured (MLP channels) pruning.")
    p.add_argument("model")
    p.add_argument("--method", choices=["magnitude", "structured"], default="magnitude")
    p.add_argument("--sparsity", type=float, default=0.5, help="Fraction of weights (or MLP channels) removed.")
    p.add_argument("--finetune-steps", type=int, default=0, help="Fine-tune this many steps after pruning.")
    d = sub.add_parser("distill", help="Train a smaller student on a teacher's logits (KL at a temperature).")
    d.add_argument("--teacher", required=True)
    d.add_argument("--student", nargs="*", default=[], metavar="model.KEY=VALUE", help="Student shape overrides.")
    d.add_argument("--student-preset", help="Start the student's shape from a preset (vocabulary: the teacher's).")
    d.add_argument("--steps", type=int, default=100)
    d.add_argument("--temperature", type=float, default=2.0)
    d.add_argument("--hard-weight", type=float, default=0.0, help="Weight of the plain next-token loss (0..1).")
    for s in (p, d):
        s.add_argument("--lr", type=float, default=1e-4 if s is p else 1e-3)
        s.add_argument("--batch-size", type=int, default=8)
        s.add_argument("--hf-out", help="Also write a Hugging Face Llama directory here.")
    for s in (q, p, d):
        s.add_argument("--out", required=True, help="Output directory (must not exist or be empty).")
        s.add_argument("--data", help="Prepared data for perplexity (and training); default: the model's.")
        s.add_argument("--seq-len", type=int, default=128)
        s.add_argument("--batches", type=int, default=4, help="Batches of 4 sequences for perplexity.")
        s.add_argument("--json", help="Also write the report here (it is always written to OUT/compress.json).")
        registry_arg(s)
    return parser


def _checked_out(a) -> Path:
    """--out, empty, once the options are in range (before any model loads)."""
    if a.action == "quantize" and a.group_size < 1:
        raise ConfigError(f"--group-size={a.group_size} must be a positive number of input columns per scale, e.g. 64")
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose another")
    return out


def cmd_compress(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    out = _checked_out(a)
    from plait.cli.views_reports import print_comparison
    from plait.core.progress import phase
    from plait.lifecycle import compress as C
    from plait.lifecycle.lora import merge_lora, model_weights_hash
    from plait.lifecycle.model_run import write_run
    from plait.lifecycle.models import load_model

    with phase(f"loading {a.teacher if a.action == 'distill' else a.model}"):
        source = load_model(a.teacher if a.action == "distill" else a.model)
    merge_lora(source.model)  # a LoRA run: quantize / prune / teach with its adapters folded in
    source.model.eval()
    data_dir = data_dir_of(a.data, source.config, source.model.args.vocab_size)
    if a.action != "quantize" and data_dir is None and (a.action == "distill" or a.finetune_steps):
        raise ConfigError("training needs data: pass --data DIR (a prepared directory)")
    with phase("measuring the source (size, speed, perplexity)"):
        before = C.measure(source.model, data_dir, seq_len=a.seq_len, batches=a.batches)
    start = time.perf_counter()
    info: dict[str, Any] = {"method": a.action}
    if a.action == "quantize":
        model, digest = _quantize(a, source, out, info)
        kind = "quantized"
    else:
        model, kind, trained = (_prune if a.action == "prune" else _distill)(a, source, data_dir, info)
        checkpoint = trained or write_run(model, out, source, data_dir, info)
        digest = model_weights_hash(model)
        if a.hf_out:
            from plait.interop.hf import export_hf

            export_hf(model, a.hf_out, tokenizer_path=source.tokenizer)
            info["hf_out"] = str(Path(a.hf_out).resolve())
            info["loads_in_transformers"] = True
    info["seconds"] = time.perf_counter() - start
    with phase(f"measuring the {kind} model"):
        after = C.measure(model, data_dir, seq_len=a.seq_len, batches=a.batches)
    if info.get("format") == "torchao":  # torchao's tensors report their float size: the files' is the truth
        after["size_mb"] = info["weight_files_mb"]
    print_comparison(f"{kind}: {source.path} -> {out}", C.compare(before, after), console)
    report = {"source": str(source.path), "out": str(out.resolve()), "info": info, "before": before, "after": after}
    for path in (out / "compress.json", *([Path(a.json)] if a.json else [])):
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    _record(a, source, out if kind == "quantized" else checkpoint, kind, digest, report)
    return 0


def _quantize(a, source, out: Path, info: dict[str, Any]):
    """The quantized model and its content hash; its directory is written beside --out and renamed into place
    whole (core.publish.staged_dir): a crash on the way leaves no partial directory."""
    from plait.core.progress import phase
    from plait.core.publish import staged_dir
    from plait.core.quiet import library_calm  # torchao's and transformers' harmless start-up lines
    from plait.lifecycle import compress as C

    exists = ConfigError(f"--out {out} exists and is not empty; choose another")
    if a.format == "torchao":
        C.check_torchao(source.model, a.bits, a.group_size)
        with library_calm(), phase(f"quantizing to int{a.bits} with torchao and writing {out}"):
            with staged_dir(out, overwrite=False, exists_error=exists) as tmp:
                written, digest = C.save_torchao(
                    source.model, tmp, bits=a.bits, group_size=a.group_size, tokenizer=source.tokenizer
                )
            model = C.torchao_quantize(copy.deepcopy(source.model), a.bits, a.group_size)
        info.update(bits=a.bits, group_size=a.group_size, format="torchao", loads_in_transformers=True,
                    weight_files_mb=written / 2**20, bf16_mb=C.weights_bytes(source.model) / 2 / 2**20)  # fmt: skip
        return model, digest
    model = C.quantize_model(copy.deepcopy(source.model), a.bits, a.group_size)
    info.update(bits=a.bits, group_size=a.group_size, format="plait", loads_in_transformers=False)
    meta = {"source": str(source.path), "config": source.config}
    with staged_dir(out, overwrite=False, exists_error=exists) as tmp:
        digest = C.save_quantized(
            model, tmp, bits=a.bits, group_size=a.group_size, meta=meta, tokenizer=source.tokenizer
        )
    return model, digest


def _prune(a, source, data_dir, info: dict[str, Any]):
    """The pruned model (magnitude: weights zeroed, kept zero through the fine-tune; structured: MLP channels
    removed), fine-tuned --finetune-steps steps on plait's trainer if asked: (model, kind, the fine-tune's
    checkpoint or None)."""
    from plait.lifecycle import compress as C

    model = copy.deepcopy(source.model)
    masks = None
    if a.method == "magnitude":
        masks = C.magnitude_prune(model, a.sparsity)
    else:
        model = C.structured_prune(model, a.sparsity)
    info.update(prune=a.method, sparsity=a.sparsity, finetune_steps=a.finetune_steps)
    if not a.finetune_steps:
        return model, "pruned", None
    info["pruned_only"] = C.measure(model, data_dir, seq_len=a.seq_len, batches=a.batches)
    keep = [C.KeepZeros(masks)] if masks else []
    losses, (model, checkpoint) = _train(a, model, data_dir, a.finetune_steps, keep)
    info["finetune_loss"] = [losses[0], losses[-1]]
    return model, "pruned", checkpoint


def _distill(a, source, data_dir, info: dict[str, Any]):
    """A student of the --student shape trained on the teacher's softened logits on plait's trainer."""
    from plait.lifecycle import compress as C

    args = _student_args(source.model.args, a.student_preset, a.student)
    student = C.student_from_teacher(source.model, args)
    info["student_init"] = C.measure(student, data_dir, seq_len=a.seq_len, batches=a.batches)
    teach = C.Distillation(source.model, a.temperature, a.hard_weight)
    losses, (model, checkpoint) = _train(a, student, data_dir, a.steps, [teach], loss=teach.loss)
    info.update(temperature=a.temperature, hard_weight=a.hard_weight, steps=a.steps, loss=[losses[0], losses[-1]])
    return model, "distilled", checkpoint


def _train(a, model, data_dir: Path, steps: int, callbacks: list, loss=None):
    """`steps` of training from `model`'s weights as a plait run into --out: (the loss of each step,
    (the trained model, its checkpoint)), the model read back from the run as any user would."""
    from plait.api import Trainer
    from plait.engine.checkpoint import resolve_checkpoint
    from plait.lifecycle import compress as C
    from plait.lifecycle.models import load_model

    out = Path(a.out)
    cfg = C.training_config(model.args, out, data_dir, steps=steps, lr=a.lr, seq_len=a.seq_len, batch_size=a.batch_size)
    losses = C.Losses()
    Trainer(cfg, loss=loss, callbacks=[C.StartFrom(model), *callbacks, losses]).fit()
    return losses.values, (load_model(out).model, resolve_checkpoint(out))


def _record(a, source, path, kind: str, digest: str, report: dict) -> None:
    """The compressed model (and its Hugging Face export) in the lineage registry that covers the source."""
    reg = open_registry_near(a.registry, source.path)
    if reg is None:
        return
    from plait.lifecycle.lineage import code_version
    from plait.lifecycle.models import artifact_for

    before, after = report["before"], report["after"]
    aid = reg.record(
        kind,
        name=Path(a.out).name,
        path=path,
        parent=artifact_for(reg, source).id,
        weights_hash=digest,
        code=code_version(),
        metrics={f"{k}_{side}": v for side, m in (("before", before), ("after", after)) for k, v in m.items()},
        extra=report["info"],
    )
    if a.action != "quantize" and a.hf_out:
        extra = {"format": "hf"}
        reg.record("export", name=Path(a.hf_out).name, path=a.hf_out, parent=aid, weights_hash=digest, extra=extra)


def _student_args(teacher, preset: str | None, overrides: list[str]):
    from dataclasses import replace

    from plait.config.fields import convert, hints  # the config's own type conversion and messages
    from plait.model import ModelArgs
    from plait.model.presets import PRESETS

    if preset and preset not in PRESETS:
        raise ConfigError(f"--student-preset={preset!r} is not a preset; valid: {', '.join(PRESETS)}")
    args = ModelArgs(**PRESETS[preset]) if preset else replace(teacher)
    known = hints(ModelArgs)
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        name = key.removeprefix("--").removeprefix("model.")
        if name not in known or not value:
            raise ConfigError(f"--student {item!r}: expected model.KEY=VALUE with KEY in {', '.join(known)}")
        changes[name] = convert(f"model.{name}", value, known[name])
    args = replace(args, **changes, vocab_size=teacher.vocab_size)
    if "max_seq_len" not in changes:
        args = replace(args, max_seq_len=min(args.max_seq_len, teacher.max_seq_len) if preset else teacher.max_seq_len)
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or (args.dim // args.n_heads) % 2:
        raise ConfigError(
            f"student shape dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads} is invalid"
        )
    return args
