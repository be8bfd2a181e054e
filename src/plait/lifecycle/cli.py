"""`plait lineage`, `plait eval`, `plait compress` and `plait finetune`.

    plait lineage show REF | diff A B | list [--kind K]          [--registry FILE]
    plait eval MODEL [--suite suite.yaml] [--data DIR] [--json OUT]
    plait compress quantize MODEL --bits 8|4 --out DIR
    plait compress prune MODEL --method magnitude|structured --sparsity S --out DIR [--finetune-steps N]
    plait compress distill --teacher MODEL --out DIR --steps N [--student model.dim=128 ...]
    plait finetune prepare DATA.jsonl --out DIR --tokenizer tokenizer.json
    plait finetune merge ADAPTER_OR_LORA_RUN --out DIR [--format plait|hf]
    plait finetune generate BASE --adapter A --adapter B --prompt TEXT   (all adapters in one batch)

MODEL is a checkpoint or run directory, a Hugging Face directory, an adapter file or a quantized directory.
Every command that makes or evaluates a model records it in the lineage registry that covers its input
(``lineage.sqlite`` in or above it), or in ``--registry FILE``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from plait.argparsing import PlaitParser
from plait.errors import ConfigError, PlaitError

_console = Console(width=120)


def _registry_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", help="The lineage registry (SQLite); default: lineage.sqlite in or above the input.")


def _open(explicit: str | None, near, *, create: bool = False):
    from plait.lifecycle.lineage import open_registry

    return open_registry(explicit, near, create=create)


# ----------------------------------------------------------------------------------------------- lineage


def cmd_lineage(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait lineage", description="Where models came from.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("show", help="Draw the derivation tree around an artifact, back to its root.")
    p.add_argument("ref", help="An id (prefix), a path, a run name or a weights hash (prefix).")
    _registry_arg(p)
    p = sub.add_parser("diff", help="What differs between two artifacts: config keys, data, parents, code.")
    p.add_argument("a")
    p.add_argument("b")
    _registry_arg(p)
    p = sub.add_parser("list", help="Every artifact, oldest first.")
    p.add_argument("--kind", help="Only this kind (run, checkpoint, adapter, eval, ...).")
    _registry_arg(p)
    a = parser.parse_args(argv)
    near = getattr(a, "ref", None) or getattr(a, "a", None)
    reg = _open(a.registry, near if near and Path(near).exists() else None)
    if reg is None:
        raise PlaitError("no lineage registry found (looked in and above the path, and ./runs); pass --registry FILE")
    from plait.lifecycle import views

    if a.action == "show":
        views.show(reg, reg.find(a.ref), _console)
    elif a.action == "diff":
        views.diff(reg, reg.find(a.a), reg.find(a.b), _console)
    else:
        views.listing(reg, a.kind, _console)
    return 0


# -------------------------------------------------------------------------------------------------- eval

EVAL_EPILOG = """suite format (YAML): a 'tests' list; each test has a name, a prompt (or 'prompts': paraphrases),
optionally a 'text' to score, and 'expect': assertions among contains, not_contains, regex, not_regex, exact,
max_length (characters), max_perplexity (of 'text'), equivalent (paraphrases agree). Greedy decoding unless
'temperature' is set. Exit status: 0 all passed, 1 some failed, 2 usage error."""


def cmd_eval(argv: list[str]) -> int:
    parser = PlaitParser(
        prog="plait eval",
        description="Perplexity on held-out data and a behavioural test suite.",
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="Checkpoint / run / Hugging Face directory, adapter file or quantized dir.")
    parser.add_argument("--suite", help="A behavioural test suite (YAML).")
    parser.add_argument("--data", help="A prepared data directory for perplexity; default: the model's training data.")
    parser.add_argument("--split", default="val", help="Split to measure perplexity on.")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8, help="Batches of 4 sequences for perplexity.")
    parser.add_argument("--no-perplexity", action="store_true", help="Run only the suite.")
    parser.add_argument("--base", help="For an adapter: its base model (default: the path the adapter records).")
    parser.add_argument("--json", help="Write the full report (results, completions, perplexity) here.")
    parser.add_argument("--device", default="cpu")
    _registry_arg(parser)
    a = parser.parse_args(argv)
    if a.batches < 1 or a.seq_len < 2:
        raise ConfigError(f"need --batches >= 1 and --seq-len >= 2 (got {a.batches}, {a.seq_len})")
    if a.json and Path(a.json).is_dir():
        raise ConfigError(f"--json {a.json} is a directory; give a file path, e.g. {Path(a.json) / 'eval.json'}")
    from plait.lifecycle.evaluate import Report, load_suite, perplexity, print_report, run_suite, write_json
    from plait.lifecycle.models import describe, load_model

    suite = load_suite(a.suite) if a.suite else None  # check the suite before loading a model
    loaded = load_model(a.model, device=a.device, base=a.base)
    _console.print(describe(loaded), highlight=False)
    report = Report(suite.name if suite else "", model=str(loaded.path))
    data_dir = None if a.no_perplexity else _data_dir(a.data, loaded.config, loaded.model.args.vocab_size)
    if data_dir is not None:
        report.perplexity = perplexity(loaded.model, data_dir, split=a.split, seq_len=a.seq_len, max_batches=a.batches)
        report.perplexity["data"] = str(data_dir)
    if suite is not None:
        if loaded.tokenizer is None:
            raise PlaitError(f"{loaded.path} has no tokenizer.json; the suite needs one to encode its prompts")
        from plait.data import load_tokenizer

        ran = run_suite(loaded.model, load_tokenizer(loaded.tokenizer), suite)
        report.results, report.completions = ran.results, ran.completions
    print_report(report, _console)
    if a.json:
        write_json(report, a.json)
    reg = _open(a.registry, loaded.path)
    if reg is not None:
        from plait.lifecycle.models import artifact_for

        target = artifact_for(reg, loaded)
        metrics: dict[str, Any] = {"passed": report.passed, "failed": report.failed}
        if report.perplexity:
            metrics.update(perplexity=report.perplexity["perplexity"], loss=report.perplexity["loss"])
        reg.record(
            "eval",
            name=suite.name if suite else "perplexity",
            parent=target.id,
            weights_hash=None,
            metrics=metrics,
            extra={"suite": a.suite, "json": a.json, "data": str(data_dir) if data_dir else None},
            events=[(None, "eval", report.to_dict())],
        )
    return 1 if report.failed else 0


def _data_dir(explicit: str | None, config: dict | None, vocab: int) -> Path | None:
    """--data, else the data the model was trained on (when it still exists); None when neither is known."""
    from plait.data import ensure_prepared

    if explicit:
        return ensure_prepared(explicit, "~/.cache/plait/data", vocab)
    data = (config or {}).get("data") or {}
    source = data.get("source")
    if not source:
        _console.print("no --data and no training data recorded: perplexity skipped")
        return None
    if source != "shakespeare" and not Path(source).is_dir():
        _console.print(f"the training data {source} is gone: perplexity skipped (pass --data)")
        return None
    return ensure_prepared(source, Path(data.get("cache_dir", "~/.cache/plait/data")).expanduser(), vocab)


# ---------------------------------------------------------------------------------------------- compress


def cmd_compress(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait compress", description="Quantize, prune or distill a model.")
    sub = parser.add_subparsers(dest="action", required=True)
    q = sub.add_parser("quantize", help="Weight-only int8 (per-channel) or int4 (group-wise) quantization.")
    q.add_argument("model")
    q.add_argument("--bits", type=int, choices=[8, 4], default=8)
    q.add_argument("--group-size", type=int, default=64, help="int4: input columns per scale.")
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
        _registry_arg(s)
    a = parser.parse_args(argv)
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose another")
    from plait.lifecycle import compress as C
    from plait.lifecycle.lora import merge_lora
    from plait.lifecycle.models import load_model

    source = load_model(a.teacher if a.action == "distill" else a.model)
    merge_lora(source.model)  # a LoRA run: quantize / prune / teach with its adapters folded in
    source.model.eval()
    data_dir = _data_dir(a.data, source.config, source.model.args.vocab_size)
    if a.action != "quantize" and data_dir is None and (a.action == "distill" or a.finetune_steps):
        raise ConfigError("training needs data: pass --data DIR (a prepared directory)")
    before = C.measure(source.model, data_dir, seq_len=a.seq_len, batches=a.batches)
    start = time.perf_counter()
    info: dict[str, Any] = {"method": a.action}
    if a.action == "quantize":
        model = C.quantize_model(copy.deepcopy(source.model), a.bits, a.group_size)
        info.update(bits=a.bits, group_size=a.group_size, loads_in_transformers=False)
        digest = C.save_quantized(
            model,
            out,
            bits=a.bits,
            group_size=a.group_size,
            meta={"source": str(source.path), "config": source.config},
            tokenizer=source.tokenizer,
        )
        kind = "quantized"
    else:
        log = _step_logger()
        if a.action == "prune":
            model = copy.deepcopy(source.model)
            masks = None
            if a.method == "magnitude":
                masks = C.magnitude_prune(model, a.sparsity)
            else:
                model = C.structured_prune(model, a.sparsity)
            info.update(prune=a.method, sparsity=a.sparsity, finetune_steps=a.finetune_steps)
            if a.finetune_steps:
                info["pruned_only"] = C.measure(model, data_dir, seq_len=a.seq_len, batches=a.batches)
                losses = C.train_loop(
                    model,
                    data_dir,
                    steps=a.finetune_steps,
                    lr=a.lr,
                    seq_len=a.seq_len,
                    batch_size=a.batch_size,
                    masks=masks,
                    log=log,
                )
                info["finetune_loss"] = [losses[0], losses[-1]]
            kind = "pruned"
        else:
            args = _student_args(source.model.args, a.student_preset, a.student)
            model = C.student_from_teacher(source.model, args)
            info["student_init"] = C.measure(model, data_dir, seq_len=a.seq_len, batches=a.batches)
            loss_fn = C.distillation_loss(source.model, a.temperature, a.hard_weight)
            losses = C.train_loop(
                model,
                data_dir,
                steps=a.steps,
                lr=a.lr,
                seq_len=a.seq_len,
                batch_size=a.batch_size,
                loss_fn=loss_fn,
                log=log,
            )
            info.update(
                temperature=a.temperature, hard_weight=a.hard_weight, steps=a.steps, loss=[losses[0], losses[-1]]
            )
            kind = "distilled"
        digest = _write_run(model, out, source, data_dir, info)
        if a.hf_out:
            from plait.interop.hf import export_hf

            export_hf(model, a.hf_out, tokenizer_path=source.tokenizer)
            info["hf_out"] = str(Path(a.hf_out).resolve())
            info["loads_in_transformers"] = True
    info["seconds"] = time.perf_counter() - start
    after = C.measure(model, data_dir, seq_len=a.seq_len, batches=a.batches)
    rows = C.compare(before, after)
    C.print_comparison(f"{kind}: {source.path} -> {out}", rows, _console)
    report = {"source": str(source.path), "out": str(out.resolve()), "info": info, "before": before, "after": after}
    (out / "compress.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    reg = _open(a.registry, source.path)
    if reg is not None:
        from plait.lifecycle.lineage import code_version
        from plait.lifecycle.models import artifact_for

        parent = artifact_for(reg, source)
        target = out if kind == "quantized" else out / "checkpoints" / "step_00000000"
        aid = reg.record(
            kind,
            name=out.name,
            path=target,
            parent=parent.id,
            weights_hash=digest,
            code=code_version(),
            metrics={f"{k}_{side}": v for side, m in (("before", before), ("after", after)) for k, v in m.items()},
            extra=info,
        )
        if a.action != "quantize" and a.hf_out:
            reg.record(
                "export",
                name=Path(a.hf_out).name,
                path=a.hf_out,
                parent=aid,
                weights_hash=digest,
                extra={"format": "hf"},
            )
    return 0


def _step_logger():
    def log(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0:
            print(f"step {step:>5} loss {loss:.4f}", file=sys.stderr, flush=True)

    return log


def _student_args(teacher, preset: str | None, overrides: list[str]):
    from dataclasses import replace

    from plait.config import _convert, _hints  # the config's own type conversion and messages
    from plait.model import ModelArgs
    from plait.model.presets import PRESETS

    if preset and preset not in PRESETS:
        raise ConfigError(f"--student-preset={preset!r} is not a preset; valid: {', '.join(PRESETS)}")
    args = ModelArgs(**PRESETS[preset]) if preset else replace(teacher)
    hints = _hints(ModelArgs)
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        name = key.removeprefix("--").removeprefix("model.")
        if name not in hints or not value:
            raise ConfigError(f"--student {item!r}: expected model.KEY=VALUE with KEY in {', '.join(hints)}")
        changes[name] = _convert(f"model.{name}", value, hints[name])
    args = replace(args, **changes, vocab_size=teacher.vocab_size)
    if "max_seq_len" not in changes:
        args = replace(args, max_seq_len=min(args.max_seq_len, teacher.max_seq_len) if preset else teacher.max_seq_len)
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or (args.dim // args.n_heads) % 2:
        raise ConfigError(
            f"student shape dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads} is invalid"
        )
    return args


def _write_run(model, out: Path, source, data_dir: Path | None, info: dict) -> str:
    """A plait run directory holding the model as a weights-only checkpoint plus its config.toml."""
    from plait.config import Config, from_dict, to_dict, to_toml, validate
    from plait.interop.ckpt_cli import write_weights_checkpoint
    from plait.lifecycle.lora import model_weights_hash

    cfg = from_dict(source.config) if source.config else Config()
    cfg.model = model.args
    cfg.finetune.init_from, cfg.finetune.lora_rank = "", 0
    cfg.run.name, cfg.run.out_dir = out.name, str(out.parent)
    cfg.data.seq_len = min(cfg.data.seq_len, model.args.max_seq_len)
    if data_dir is not None:
        cfg.data.source = str(data_dir)
    validate(cfg)
    ckpt = out / "checkpoints" / "step_00000000"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    write_weights_checkpoint(
        model,
        ckpt,
        config=to_dict(cfg),
        tokenizer_path=source.tokenizer,
        extra={"compressed_from": {"path": str(source.path), **_jsonable(info)}},
    )
    (out / "config.toml").write_text(to_toml(cfg))
    return model_weights_hash(model)


def _jsonable(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))


# ---------------------------------------------------------------------------------------------- finetune


def cmd_finetune(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait finetune", description="Instruction data, adapters, serving.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="Tokenise {prompt, response} JSONL with the prompt masked out of the loss.")
    p.add_argument("inputs", nargs="+", help=".jsonl / .jsonl.gz files of records with prompt and response.")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="The base model's tokenizer.json.")
    p.add_argument("--template", help="Prompt format with {prompt}; default: '### Instruction: ... ### Response:'.")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--response-field", default="response")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--train-on-prompt", action="store_true", help="Count the prompt's tokens in the loss too.")
    p.add_argument("--overwrite", action="store_true")
    m = sub.add_parser("merge", help="Fold an adapter into its base: a plain model (plait run or HF directory).")
    m.add_argument("source", help="An adapter file, or a LoRA run / checkpoint directory.")
    m.add_argument("--out", required=True)
    m.add_argument("--base", help="For an adapter file: its base (default: the path it records).")
    m.add_argument("--format", choices=["plait", "hf"], default="plait")
    _registry_arg(m)
    g = sub.add_parser("generate", help="Run several adapters of one base in one batch (shared stem).")
    g.add_argument("base", help="The base model (checkpoint / run / HF directory).")
    g.add_argument("--adapter", action="append", required=True, metavar="[NAME=]PATH", help="Repeat for more.")
    g.add_argument("--prompt", action="append", required=True, help="Repeat for more; each runs on every adapter.")
    g.add_argument("--include-base", action="store_true", help="Also answer with the base alone.")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    return {"prepare": _ft_prepare, "merge": _ft_merge, "generate": _ft_generate}[a.action](a)


def _ft_prepare(a) -> int:
    from plait.lifecycle.finetune import DEFAULT_TEMPLATE, prepare_instructions

    manifest = prepare_instructions(
        a.inputs,
        a.out,
        tokenizer=a.tokenizer,
        template=a.template.replace("\\n", "\n") if a.template else DEFAULT_TEMPLATE,  # a literal \n in a shell
        prompt_field=a.prompt_field,
        response_field=a.response_field,
        val_fraction=a.val_fraction,
        train_on_prompt=a.train_on_prompt,
        overwrite=a.overwrite,
    )
    s = manifest["splits"]
    print(
        f"wrote {a.out}: train {s['train']['num_documents']} examples / {s['train']['num_tokens']:,} tokens "
        f"({s['train']['num_target_tokens']:,} in the loss), val {s['val']['num_documents']} examples\n"
        f"fine-tune on it with: plait train BASE_RUN/config.toml --finetune.init_from=BASE_RUN "
        f"--finetune.lora_rank=8 --data.source={a.out} --run.name=NAME"
    )
    return 0


def _ft_merge(a) -> int:
    from plait.lifecycle.lora import merge_lora, model_weights_hash
    from plait.lifecycle.models import artifact_for, load_model

    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose another")
    loaded = load_model(a.source, base=a.base)
    from plait.lifecycle.lora import lora_tensors

    if not lora_tensors(loaded.model):
        raise ConfigError(
            f"{loaded.path} has no LoRA adapters to merge (a plain model: use it as it is); give an adapter file "
            f"or the run of a fine-tune with finetune.lora_rank > 0"
        )
    reg = _open(a.registry, loaded.path)
    parent = artifact_for(reg, loaded) if reg is not None else None  # before merging: the adapter's own hash
    model = merge_lora(loaded.model)
    if a.format == "hf":
        from plait.interop.hf import export_hf

        export_hf(model, out, tokenizer_path=loaded.tokenizer)
        digest, target = model_weights_hash(model), out
    else:
        digest = _write_run(model, out, loaded, None, {"merged_from": str(loaded.path)})
        target = out / "checkpoints" / "step_00000000"
    if reg is not None and parent is not None:
        reg.record(
            "merged", name=out.name, path=target, parent=parent.id, weights_hash=digest, extra={"format": a.format}
        )
    print(f"wrote {out} ({a.format}): {loaded.path} with its adapters merged")
    return 0


def _ft_generate(a) -> int:
    from plait.data import eos_id, load_tokenizer
    from plait.lifecycle.models import load_model
    from plait.lifecycle.serve import SharedStem

    adapters = {}
    for i, spec in enumerate(a.adapter):
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep and not Path(spec).exists() else (f"adapter{i + 1}", spec)
        adapters[name] = path
    base = load_model(a.base)
    if base.tokenizer is None:
        raise PlaitError(f"{base.path} has no tokenizer.json")
    tok = load_tokenizer(base.tokenizer)
    stem = SharedStem(base.model, adapters)
    names: list[str | None] = [*adapters, *([None] if a.include_base else [])]
    requests = [(tok.encode(p, add_special_tokens=False).ids, n) for p in a.prompt for n in names]
    try:
        eos = eos_id(tok)
    except PlaitError:
        eos = None
    outs = stem.generate(requests, max_new_tokens=a.max_new_tokens, temperature=a.temperature, eos_id=eos, seed=a.seed)
    print(f"{len(requests)} requests ({len(a.prompt)} prompts x {len(names)} models) through one shared base")
    for (ids, name), out in zip(requests, outs, strict=True):
        print(f"--- {name or 'base'}: {tok.decode(ids)!r}")
        print(tok.decode(out[len(ids) :]))
    return 0
