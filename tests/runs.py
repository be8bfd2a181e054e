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


def bundled_speeches(count: int) -> list[str]:
    """The first `count` speeches of the bundled text (its paragraphs)."""
    import gzip
    import json

    from plait.data.prepare import bundled_corpus_path

    with gzip.open(bundled_corpus_path(), "rt") as f:
        text = json.loads(f.readline())["text"]
    return [s for s in text.split("\n\n") if s.strip()][:count]


def prepared_speeches(root: Path, count: int, tokenizer: Path, val_fraction: float = 0.1) -> Path:
    """The first `count` speeches of the bundled text, one document each, written to root/speeches.jsonl and
    prepared into root/data with `tokenizer`; returns that directory."""
    import json

    from plait.data.prepare import prepare

    speeches = bundled_speeches(count)
    (root / "speeches.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in speeches) + "\n")
    prepare([root / "speeches.jsonl"], root / "data", tokenizer=tokenizer, val_fraction=val_fraction)
    return root / "data"
