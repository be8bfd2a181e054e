"""The settings of a short run of the debug model on the bundled corpus, in one process on the CPU, as the
end-to-end tests start it (section.key=value; the command line takes each with `--` in front)."""

from __future__ import annotations

from pathlib import Path


def debug_run(data_dir: Path, out: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        "model.preset=debug",
        f"data.source={data_dir}",
        "data.seq_len=32",
        "train.global_batch_size=8",
        f"train.steps={steps}",
        "optim.warmup_steps=2",
        "eval.every_steps=0",
        "log.every_steps=1",
        "log.tensorboard=false",
        "sample.max_new_tokens=0",
        "data.prefetch=0",
        "run.device=cpu",
        f"run.out_dir={out}",
        f"run.name={name}",
        *extra,
    ]
