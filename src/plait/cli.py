"""The `plait` command line: train, data prepare, generate, config show.

User errors (PlaitError) print one line and exit with status 2; nothing else is written.
"""

from __future__ import annotations

import os
import sys

from plait.argparsing import PlaitParser, config_argv, config_parser, parse_config_args, split_config_args
from plait.errors import ConfigError, PlaitError
from plait.stop import EXIT_STOPPED

TRAIN_DESCRIPTION = """\
Train a model. With no arguments: the 'tiny' model on the bundled Shakespeare corpus, on CUDA if present,
else the CPU. A run directory that already holds checkpoints is resumed from the newest one.
The parallel layout is set by the [parallel] settings, or chosen by the planner with --layout auto. Under
torchrun: `torchrun --nproc-per-node N -m plait train [CONFIG] [settings]`."""


def _load(args: list[str]):
    from plait.config import load_config

    path, overrides = split_config_args(args)
    return load_config(path, overrides)


def cmd_train(argv: list[str]) -> int:
    parser = config_parser("plait train", TRAIN_DESCRIPTION)
    parser.add_argument("--nproc", type=int, metavar="N", help="local workers (default: one per visible GPU, else 1)")
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="R", help="restarts of the group after a lost worker"
    )
    parser.add_argument(
        "--layout", metavar="auto", help="'auto': the planner chooses the [parallel] degrees for the processes"
    )
    a, settings = parse_config_args(parser, argv)
    args = config_argv(a.config, settings)
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts={a.max_restarts} must be 0 or more (how often a failed group is restarted)")
    if "WORLD_SIZE" not in os.environ:  # not yet inside a launched worker
        _load(args)  # a bad setting is refused now, before torch is even imported
        from plait.launch import _validate_before_launch, default_nproc, launch_local

        nproc = default_nproc() if a.nproc is None else a.nproc
        if nproc < 1:
            raise ConfigError(f"--nproc={nproc} must be at least 1")
        if a.layout == "auto":
            from plait.planner.auto import auto_layout_overrides

            overrides, why = auto_layout_overrides(_load(args), nproc)
            print("\n".join(["plait train --layout auto:", *why, "using: " + " ".join(overrides)]), file=sys.stderr)
            args += [f"--{o}" for o in overrides]
        elif a.layout is not None:
            raise ConfigError(f"--layout={a.layout!r}: only 'auto' is accepted (or set the [parallel] options)")
        cfg = _validate_before_launch(args, nproc)
        if nproc > 1 or a.max_restarts:
            from plait.planner.preflight import check_memory

            note = check_memory(cfg, nproc, nproc)  # once, here; the workers do not repeat it
            if note:
                print(note, file=sys.stderr)
            from plait.runlock import RunLock

            # The launcher holds the run directory's lock across the group's restarts; its workers run under it.
            with RunLock.for_run(cfg).acquire(break_lock=cfg.run.break_lock).held() as lock:
                return launch_local(nproc, args, a.max_restarts, train_worker, env=lock.handed_env())
    cfg = _load(args)
    from plait.api import train

    train(cfg)
    return 0


def cmd_config(argv: list[str]) -> int:
    if not argv or argv[0] != "show":
        parser = PlaitParser(prog="plait config", description="Print the resolved config as TOML.")
        parser.add_argument("action", choices=["show"], help="show [CONFIG.toml] [--section.key=value ...]")
        parser.parse_args(argv[:1])  # help, or the usage error (exit 2)
    parser = config_parser("plait config show", "Print the resolved config as TOML: every section, every key.")
    a, settings = parse_config_args(parser, argv[1:])
    from plait.config import to_toml

    print(to_toml(_load(config_argv(a.config, settings))), end="")
    return 0


def cmd_data(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait data", description="Prepare data for training.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="Tokenise text / JSONL / Parquet into memory-mapped token shards.")
    p.add_argument("inputs", nargs="+", help="Files or directories (.txt, .jsonl, .jsonl.gz, .parquet).")
    p.add_argument("--out", required=True, help="Output directory (must not exist or be empty).")
    p.add_argument("--tokenizer", help="An existing tokenizer.json; default: train a byte-level BPE.")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when training one.")
    p.add_argument("--val-fraction", type=float, default=0.05, help="Share of documents held out.")
    p.add_argument("--text-field", default="text", help="Field / column holding the text in JSONL / Parquet.")
    p.add_argument("--overwrite", action="store_true", help="Replace an existing output directory.")
    a = parser.parse_args(argv)
    if a.vocab_size < 260:
        raise ConfigError(f"--vocab-size={a.vocab_size} is too small: at least 260 (256 bytes + specials)")
    if not 0 < a.val_fraction < 1:
        raise ConfigError(f"--val-fraction={a.val_fraction} must be between 0 and 1, e.g. 0.05")
    from plait.data import prepare

    manifest = prepare(
        a.inputs,
        a.out,
        tokenizer=a.tokenizer,
        vocab_size=a.vocab_size,
        val_fraction=a.val_fraction,
        text_field=a.text_field,
        overwrite=a.overwrite,
    )
    splits = manifest["splits"]
    print(
        f"wrote {a.out}: train {splits['train']['num_tokens']:,} tokens / "
        f"{splits['train']['num_documents']} documents, val {splits['val']['num_tokens']:,} tokens / "
        f"{splits['val']['num_documents']} documents, vocabulary {manifest['vocab_size']}\n"
        f"train on it with: plait train --data.source={a.out} --model.vocab_size={manifest['vocab_size']}"
    )
    return 0


def cmd_generate(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait generate", description="Sample text from a checkpoint.")
    parser.add_argument("checkpoint", help="A checkpoint directory, or a run directory (its newest checkpoint).")
    parser.add_argument("--prompt", default="OTHELLO.", help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to generate per sample.")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding.")
    parser.add_argument("--top-k", type=int, default=50, help="0 disables top-k.")
    parser.add_argument("--top-p", type=float, default=0.95, help="1.0 disables nucleus sampling.")
    parser.add_argument("--num-samples", type=int, default=1, help="Independent samples of the prompt.")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed (the same seed, the same text).")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (a GPU if there is one).")
    a = parser.parse_args(argv)
    for flag, value, ok, valid in (
        ("--temperature", a.temperature, a.temperature >= 0, "0 or more (0: greedy), e.g. 0.8"),
        ("--top-k", a.top_k, a.top_k >= 0, "0 or more (0: off), e.g. 50"),
        ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1] (1: off), e.g. 0.95"),
        ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "at least 1, e.g. 200"),
        ("--num-samples", a.num_samples, a.num_samples >= 1, "at least 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range: {flag} must be {valid}")
    from plait.generate import generate, load_for_generation

    model, tok, eos = load_for_generation(a.checkpoint, a.device)
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise ConfigError("--prompt is empty after tokenisation; give some text")
    if len(ids) >= model.args.max_seq_len:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the model supports {model.args.max_seq_len}")
    outs = generate(
        model,
        [ids] * a.num_samples,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_id=eos,
        seed=a.seed,
    )
    for i, out in enumerate(outs):
        if a.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tok.decode(out))
    return 0


def cmd_launch(argv: list[str]) -> int:
    from plait.launch import cmd_launch as launch

    return launch(argv)


def cmd_ckpt(argv: list[str]) -> int:
    from plait.interop.ckpt_cli import cmd_ckpt as run

    return run(argv)


def cmd_plan(argv: list[str]) -> int:
    from plait.planner.cli import cmd_plan as run

    return run(argv)


def cmd_bench(argv: list[str]) -> int:
    from plait.bench import cmd_bench as run

    return run(argv)


def cmd_lineage(argv: list[str]) -> int:
    from plait.lifecycle.cli import cmd_lineage as run

    return run(argv)


def cmd_eval(argv: list[str]) -> int:
    from plait.lifecycle.cli import cmd_eval as run

    return run(argv)


def cmd_compress(argv: list[str]) -> int:
    from plait.lifecycle.cli import cmd_compress as run

    return run(argv)


def cmd_finetune(argv: list[str]) -> int:
    from plait.lifecycle.cli import cmd_finetune as run

    return run(argv)


def cmd_plot(argv: list[str]) -> int:
    from plait.plot import cmd_plot as run

    return run(argv)


def cmd_doctor(argv: list[str]) -> int:
    from plait.doctor import cmd_doctor

    return cmd_doctor(argv, worker=worker)


COMMANDS = {
    "train": cmd_train,
    "data": cmd_data,
    "generate": cmd_generate,
    "config": cmd_config,
    "launch": cmd_launch,
    "ckpt": cmd_ckpt,
    "plan": cmd_plan,
    "bench": cmd_bench,
    "doctor": cmd_doctor,
    "lineage": cmd_lineage,
    "eval": cmd_eval,
    "compress": cmd_compress,
    "finetune": cmd_finetune,
    "plot": cmd_plot,
}
USAGE = """\
usage: plait COMMAND [...]

commands:
  train [CONFIG] [--section.key=value ...]   train a model (no arguments: the default job)
        [--nproc N] [--max-restarts R]       ... on N local processes (default: one per GPU, else 1)
  launch slurm --nodes N [CONFIG] [...]      write an sbatch script for a multi-node run
  data prepare INPUTS --out DIR              tokenise a corpus into token shards
  generate CHECKPOINT [--prompt TEXT]        sample text from a checkpoint (KV cache)
  config show [CONFIG] [overrides]           print the resolved config as TOML
  ckpt inspect|export|import PATH            inspect a checkpoint; export to Hugging Face / safetensors; import
  plan --model PRESET --cluster PRESET       choose a parallel layout from a cost model
  bench [CONFIG] [overrides] [--steps N]     time a config in one process: tokens/s, MFU, breakdown, compile
  doctor [--nproc N] [CONFIG] [overrides]    check devices and collectives per mesh axis (busbw table)
  finetune prepare|merge|generate ...        instruction data; fold adapters in; many adapters in one batch
  eval MODEL [--suite S.yaml] [--json OUT]   perplexity and a behavioural test suite (exit 1 on failures)
  compress quantize|prune|distill MODEL      int8/int4 weights, pruning, distillation; size/speed/ppl deltas
  plot RUN [RUN ...] [--out plot.png]        loss, validation loss, LR and tokens/s of runs in one picture
  lineage show|diff|list REF                 where a model came from: runs, data, parents, code, hashes

`plait COMMAND --help` for details."""


def _told_launcher(message: str, code: int) -> bool:
    """In a worker of `plait train --nproc`: the launcher prints the error, once for all ranks."""
    if "PLAIT_WORKER_ERRORS" not in os.environ:
        return False
    from plait.launch import report_to_launcher

    return report_to_launcher(message, code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"plait: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except PlaitError as e:
        code = getattr(e, "exit_code", 2)
        told = code in (2, EXIT_STOPPED) and _told_launcher(str(e), code)
        if str(e) and not told:  # a rank may end silently: the main one says it
            print(f"plait {argv[0]}: {'error: ' if code == 2 else ''}{e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"plait {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # argparse's --help (0) and usage errors (2): a code for Python callers too
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def worker(argv: list[str]) -> None:
    """A process started by `plait train|doctor --nproc`: the command line, exiting with its code."""
    code = main(argv)
    if code:
        sys.exit(code)


def train_worker(argv: list[str]) -> None:
    worker(["train", *argv])


if __name__ == "__main__":
    sys.exit(main())
