"""Weighted mixtures of prepared corpora (data.sources): every global batch holds each source's share to within
one sequence, deterministically from run.seed; the position is the per-source count, so a resume continues
exactly, also at another data-parallel degree; the trainer reports tokens and validation loss per source; bad
mixtures are refused before any training with one line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.config import load_config
from plait.config.validate import data_sources
from plait.core.errors import ConfigError
from plait.data.loader import FORMAT, MANIFEST, TokenDataset
from plait.data.mixture import Mixture, MixtureLoader, mixture_counts, open_mixture
from runs import debug_run

WEIGHTS = {"web": 0.7, "code": 0.2, "books": 0.1}
SEQ = 8


def synthetic_source(root: Path, token: int, tokens: int = 4000, tokenizer: str = "same") -> Path:
    """A prepared directory whose every token is `token` (so a batch row tells its source)."""
    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n in (("train", tokens), ("val", tokens // 4)):
        np.full(n, token, dtype="<u2").tofile(root / f"{split}.bin")
        splits[split] = {"num_tokens": n, "shards": [{"file": f"{split}.bin", "num_tokens": n}]}
    manifest = {"format": FORMAT, "dtype": "uint16", "vocab_size": 64, "eos_id": 0, "splits": splits,
                "tokenizer": "tokenizer.json", "tokenizer_sha256": tokenizer}  # fmt: skip
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[tuple[str, str, float]]:
    root = tmp_path_factory.mktemp("mix")
    return [(n, str(synthetic_source(root / n, i + 1)), w) for i, (n, w) in enumerate(WEIGHTS.items())]


def loader(mixture: Mixture, global_batch: int = 16, dp_rank: int = 0, dp: int = 1, seed: int = 0) -> MixtureLoader:
    return MixtureLoader(mixture, seq_len=SEQ, global_batch_size=global_batch, dp_rank=dp_rank, dp_degree=dp,
                         seed=seed, prefetch=0)  # fmt: skip


def composition(inputs) -> np.ndarray:
    """Rows per source (token 1, 2, 3) of a batch."""
    return np.bincount(inputs[:, 0].numpy(), minlength=4)[1:]


def test_every_global_batch_holds_each_share_to_within_one_sequence(sources):
    mix = open_mixture(sources, "train", 64)
    shares = np.array(list(WEIGHTS.values()))
    served = np.zeros(3, dtype=np.int64)
    it = loader(mix)
    for step in range(1000):
        inputs, targets = next(it)
        got = composition(inputs)
        assert got.sum() == 16 and np.all(np.abs(got - 16 * shares) < 1), (step, got)
        served += got
        assert np.all(np.abs(served - shares * served.sum()) < 1), (step, served)  # and in the long run
        assert (targets[:, :-1] == inputs[:, 1:]).all()
    assert it.source_tokens() == {n: int(c) * SEQ for n, c in zip(WEIGHTS, served, strict=True)}
    # the counts alone: other batch sizes and four sources
    for weights, g in (([0.5, 0.3, 0.15, 0.05], 7), ([1.0, 1.0, 1.0], 16)):
        w = np.array(weights) / sum(weights)
        n = np.zeros(len(w), dtype=np.int64)
        for _ in range(500):
            c = mixture_counts(n, w, g)
            assert c.sum() == g and np.all(np.abs(c - w * g) < 1)
            n += c


def test_the_order_is_drawn_from_the_seed_and_resumes_exactly_at_another_dp_degree(sources):
    mix = open_mixture(sources, "train", 64)
    straight = loader(mix)
    batches = [next(straight)[0] for _ in range(12)]
    assert not all((next(loader(mix, seed=1))[0] == batches[0]).all() for _ in range(1))  # another seed: another order
    first = loader(mix)
    for _ in range(5):
        next(first)
    state = first.state_dict()
    assert state["samples_consumed"] == 80 and sum(state["source_samples"].values()) == 80
    for dp in (1, 2, 4):  # the same global batches, cut in dp contiguous slices
        ranks = [loader(mix, dp_rank=r, dp=dp) for r in range(dp)]
        for r in ranks:
            r.load_state_dict(json.loads(json.dumps(state)))  # as saved in a checkpoint
        for k in range(5, 12):
            got = np.concatenate([next(r)[0].numpy() for r in ranks])
            assert (got == batches[k].numpy()).all(), (dp, k)


def test_a_resume_with_new_weights_or_a_new_source_continues_from_the_counts(sources, tmp_path):
    mix = open_mixture(sources, "train", 64)
    first = loader(mix)
    for _ in range(10):
        next(first)
    state = first.state_dict()
    reweighted = open_mixture([(n, p, 1.0) for n, p, _ in sources], "train", 64)
    again = loader(reweighted)
    again.load_state_dict(state)
    served = np.array(list(state["source_samples"].values()))
    for _ in range(200):  # equal weights now: the counts move towards equal shares of everything served
        served += composition(next(again)[0])
    assert np.all(np.abs(served / served.sum() - 1 / 3) < 0.1)
    four = open_mixture([*sources, ("math", str(synthetic_source(tmp_path / "math", 4)), 0.1)], "train", 64)
    grown = loader(four)
    grown.load_state_dict(state)
    assert grown.state_dict()["source_samples"]["math"] == 0
    with pytest.raises(ConfigError, match="position is of a mixture"):
        from plait.data.loader import TokenLoader

        TokenLoader(TokenDataset(sources[0][1]), seq_len=SEQ, global_batch_size=16).load_state_dict(state)


def test_a_mixture_trains_reports_each_source_and_resumes_bitwise(data_dir, tmp_path):
    from plait.api import train

    mix = f"data.sources=web={data_dir}:0.7,code={data_dir}:0.2,books={data_dir}:0.1"

    def run(name: str, steps: int = 6, mix: str = mix) -> dict:
        cfg = [*debug_run(data_dir, tmp_path, name, steps, "checkpoint.every_steps=3", "eval.every_steps=3"), mix]
        cfg = [c for c in cfg if not c.startswith("data.source=")]
        train(load_config(None, cfg))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {k: {r["step"]: r[k] for r in rows if k in r} for k in {k for r in rows for k in r}}

    straight = run("a")
    for name, weight in WEIGHTS.items():  # 6 steps of 8 sequences of 32 tokens: each within one of its share
        assert abs(straight[f"train/tokens_{name}"][6] / 32 - weight * 48) < 1
    assert sum(straight[f"train/tokens_{n}"][6] for n in WEIGHTS) == straight["train/tokens"][6] == 6 * 8 * 32
    assert set(straight["val/loss_web"]) == {3, 6} and straight["val/loss_books"][6] > 0
    run("b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_00000006")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = run("b")
    assert resumed["train/loss"] == {s: straight["train/loss"][s] for s in (4, 5, 6)}
    assert resumed["train/tokens_code"][6] == straight["train/tokens_code"][6]
    # new weights on resume (a curriculum): allowed and reported; the counts carry on from the checkpoint's
    (tmp_path / "b" / "metrics.jsonl").unlink()
    longer = run("b", 8, f"data.sources=web={data_dir}:0.2,code={data_dir}:0.6,books={data_dir}:0.2")
    assert sorted(longer["train/loss"]) == [7, 8]
    assert (longer["train/tokens_code"][8] - straight["train/tokens_code"][6]) // 32 in (9, 10)  # 0.6 x 16 sequences


@pytest.mark.parametrize(
    "text,message",
    [
        ("web=/d:0", r"the weight 0 must be positive"),
        ("web=/d:-1,code=/e:1", r"the weight -1 must be positive"),
        ("web=/d", r"is not \[NAME=\]DIR:WEIGHT"),
        ("web=/d:x", r"is not \[NAME=\]DIR:WEIGHT"),
        ("a=/d:1,a=/e:1", r"names 'a' twice"),
        (" , ", r"names no source"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_item(text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"data.sources={text}"])


def test_names_default_to_the_directory_and_both_settings_at_once_are_refused():
    assert data_sources("/data/web/:2, code=s/code:1") == [("web", "/data/web/", 2.0), ("code", "s/code", 1.0)]
    with pytest.raises(ConfigError, match="are both set"):
        load_config(None, ["data.source=/x", "data.sources=/y:1"])


def test_sources_of_another_tokenizer_or_a_larger_vocabulary_exit_2_before_training(sources, tmp_path):
    other = synthetic_source(tmp_path / "other", 5, tokenizer="another")
    mix = ",".join(f"{n}={p}:{w}" for n, p, w in sources)
    runs = tmp_path / "runs"
    base = [sys.executable, "-m", "plait.cli", "train", "--model.preset=debug", "--data.seq_len=8",
            f"--run.out_dir={runs}", "--run.device=cpu"]  # fmt: skip
    for extra, message in (
        ([f"--data.sources={mix},other={other}:0.5"], "'other' was prepared with another tokenizer"),
        ([f"--data.sources={mix}", "--model.vocab_size=32"], "has a vocabulary of 64, more than model.vocab_size"),
        ([f"--data.sources={mix},gone={tmp_path / 'gone'}:1"], "does not exist"),
    ):
        proc = subprocess.run([*base, *extra], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr[-800:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not runs.exists() or not any(runs.rglob("checkpoints"))
