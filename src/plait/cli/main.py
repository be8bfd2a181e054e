"""`plait COMMAND ...`: finds the command's module (imported only when run, so `plait --help` is quick) and
runs it; a user error is one line and exit code 2 (plait.cli.run)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys

from plait.cli.run import run_command

COMMANDS = {  # command -> (module, function)
    "train": ("plait.cli.train", "cmd_train"),
    "data": ("plait.cli.data", "cmd_data"),
    "generate": ("plait.cli.generate", "cmd_generate"),
    "config": ("plait.cli.config", "cmd_config"),
    "launch": ("plait.cli.launch", "cmd_launch"),
    "ckpt": ("plait.cli.ckpt", "cmd_ckpt"),
    "plan": ("plait.cli.plan", "cmd_plan"),
    "bench": ("plait.cli.bench", "cmd_bench"),
    "fit": ("plait.cli.fit", "cmd_fit"),
    "compile": ("plait.cli.compile", "cmd_compile"),
    "doctor": ("plait.cli.doctor", "cmd_doctor"),
    "lineage": ("plait.cli.lineage", "cmd_lineage"),
    "eval": ("plait.cli.eval", "cmd_eval"),
    "compress": ("plait.cli.compress", "cmd_compress"),
    "finetune": ("plait.cli.finetune", "cmd_finetune"),
    "plot": ("plait.cli.plot", "cmd_plot"),
    "lighthouse": ("plait.cli.replicas", "cmd_lighthouse"),
}
USAGE = """\
usage: plait COMMAND [...]

commands:
  train [CONFIG] [--section.key=value ...]   train a model (no arguments: the default job)
        [--nproc N] [--max-restarts R]       ... on N local processes (default: one per GPU, else 1)
        [--replicas R]                       ... as R fault-tolerant replica groups (torchft)
  lighthouse [--port P]                      the quorum server of replica groups started as separate jobs
  launch slurm --nodes N [CONFIG] [...]      write an sbatch script for a multi-node run
  data prepare INPUTS --out DIR              tokenise a corpus into token shards
  generate CHECKPOINT [--prompt TEXT]        sample text from a checkpoint (KV cache)
  config show [CONFIG] [overrides]           print the resolved config as TOML
  ckpt inspect|export|import PATH            inspect a checkpoint; export to Hugging Face / safetensors; import
  plan --model PRESET --cluster PRESET       choose a parallel layout from a cost model
  bench [CONFIG] [overrides] [--steps N]     time a config in one process: tokens/s, MFU, breakdown, compile
  fit [CONFIG] [overrides] --world-size N    run rank R of an N-rank job here: peak memory vs the planner
  compile [CONFIG] [...] --world-size N      fill a job's compile cache before it runs (a dir or s3://)
  doctor [--nproc N] [CONFIG] [overrides]    check devices and collectives per mesh axis (busbw table)
  finetune prepare|merge|generate ...        instruction data; fold adapters in; many adapters in one batch
  eval MODEL [--suite S.yaml] [--json OUT]   perplexity and a behavioural test suite (exit 1 on failures)
  compress quantize|prune|distill MODEL      int8/int4 weights, pruning, distillation; size/speed/ppl deltas
  plot RUN [RUN ...] [--out plot.png]        loss, validation loss, LR and tokens/s of runs in one picture
  lineage show|diff|list REF                 where a model came from: runs, data, parents, code, hashes

`plait COMMAND --help` for details."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"; did you mean `plait {close[0]}`?" if close else ""
        print(f"plait: unknown command {argv[0]!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    module, function = COMMANDS[argv[0]]
    return run_command(argv[0], getattr(importlib.import_module(module), function), argv[1:])


def exit_process(code: int) -> None:
    """End the `plait` process with `code`. A launcher that ran torch's elastic agent (`--nproc`) ends at once
    once its output is flushed: its workers have ended and its run lock is released, and the interpreter's
    teardown could meet the agent's store thread still running and abort ("terminate called without an active
    exception", seen once in a loaded test run after a stop had been saved)."""
    from plait.cli.launch import RAN_AGENT

    if RAN_AGENT[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def entry() -> None:
    """The `plait` console command."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())
