"""A run on too little data says so: a warning at start when the planned steps pass over the training data
more than EPOCHS_WARNED times, a warning when the validation loss climbs back above the unigram baseline, and
checkpoint.keep_best keeps the checkpoint with the lowest validation loss whatever keep_last removes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from plait.config import load_config
from plait.core.errors import ConfigError
from plait.engine.checkpoint import list_checkpoints
from plait.engine.step_metrics import EPOCHS_WARNED, epochs_problem
from plait.engine.validation import rose_above
from runs import debug_run


@pytest.fixture(scope="module")
def small(tmp_path_factory, data_dir) -> Path:
    """40 speeches of the bundled text (a quarter held out), with the bundled tokenizer."""
    from plait.data.prepare import bundled_corpus_path, prepare

    root = tmp_path_factory.mktemp("small")
    with gzip.open(bundled_corpus_path(), "rt") as f:
        speeches = [s for s in json.loads(f.readline())["text"].split("\n\n") if s.strip()][:40]
    (root / "s.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in speeches))
    prepare([root / "s.jsonl"], root / "prepared", tokenizer=Path(data_dir) / "tokenizer.json", val_fraction=0.25)
    return root / "prepared"


def test_epochs_warning_says_how_many_passes_and_what_to_do():
    class Loader:
        num_windows, global_batch_size = 1000, 8

    assert epochs_problem(Loader(), int(EPOCHS_WARNED * 1000 / 8)) is None
    text = epochs_problem(Loader(), 2000)
    assert text and "16.0 times" in text and "lower train.steps to about 500" in text


def test_the_baseline_warning_fires_when_the_loss_climbs_back_above_it():
    assert not rose_above(float("inf"), 8.3, 6.0)  # an untrained model starts above it: no warning
    assert not rose_above(5.5, 5.8, 6.0)
    assert rose_above(5.5, 6.2, 6.0)


def test_a_small_corpus_warns_and_keep_best_keeps_the_best_checkpoint(small, tmp_path, capfd):
    from plait.api import train

    steps = 24
    cfg = debug_run(small, tmp_path, "small", steps, "eval.every_steps=4", "checkpoint.every_steps=4",
                    "checkpoint.keep_last=1", "checkpoint.keep_best=true", "optim.lr=2e-2")  # fmt: skip
    train(load_config(None, cfg))
    err = " ".join(capfd.readouterr().err.split())
    assert "the run passes over its training data" in err and "lower train.steps" in err
    rows = [json.loads(line) for line in (tmp_path / "small" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    best = min(val, key=val.get)
    assert best < steps, val  # memorising 40 speeches: the best validation loss comes before the end
    kept = [int(p.name.removeprefix("step_")) for p in list_checkpoints(tmp_path / "small" / "checkpoints")]
    assert kept == sorted({best, steps}), (val, kept)


def test_keep_best_without_validation_at_the_saved_steps_is_refused():
    with pytest.raises(ConfigError, match="set eval.every_steps"):
        load_config(None, ["checkpoint.keep_best=true", "eval.every_steps=0"])
    with pytest.raises(ConfigError, match="make checkpoint.every_steps a multiple of 30"):
        load_config(None, ["checkpoint.keep_best=true", "eval.every_steps=30", "checkpoint.every_steps=100"])
