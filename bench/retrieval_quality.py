"""Does retrieval lower the held-out loss? The same model with and without RETRO's chunked cross-attention, at
equal steps and equal non-retrieval parameters, over 3 seeds, on the bundled corpus; and what a step costs.

    python bench/retrieval_quality.py [--steps 150] [--seeds 0,1,2] [--chunk 32] [--k 2] [--batch 8]
        [--encoder-steps 100 | --encoder lexical] [--documents plays|speeches|code] [--retro '...;...']
        [--shuffled-check] [--random-neighbours]

The database is built once (its encoder: plait's default model trained --encoder-steps steps, not timed with
the runs, or --encoder lexical, plait.data.lexical's TF-IDF). --documents: the corpus's plays as documents (as
plait prepares it), or its speeches (the same text cut at blank lines: a held-out speech retrieves from the other
speeches of its play).
Each run trains `--steps` steps of the default model (preset tiny) with validation at the end; the retrieval
runs add cross-attention in blocks 2 and 3 and a 1-block neighbour encoder. Both sides read the same windows,
in training and in validation: a retrieval window starts on a chunk boundary (every seq_len + chunk tokens),
and the plain runs here take that stride too, so the only difference is the retrieval (without it, the two
sides scored different held-out text, which moved the difference by up to 0.07 nats at 150 steps).
Printed: each seed's final validation loss, the mean and spread of the difference, each side's tokens/s (the
step's overhead) and the retrieval models' gates; written to bench/results/retrieval_quality.json.
--shuffled-check also scores each retrieval model with its held-out neighbours permuted across chunks: the
same loss means it takes nothing from them. --random-neighbours gives the retrieval runs random database chunks
as neighbours, in training and validation: the control for a gain from any text of the corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

RETRO = ["model.retrieval_layers=2,3", "model.retrieval_encoder_layers=1"]
SCHEDULE = "optim.warmup_steps=30"
"""The warm-up every figure of this bench and bench/retrieval_ceiling.py was measured with (docs/data.md): the
default until 2026-11-29, pinned so that they stay reproducible."""


@contextlib.contextmanager
def windows_every(stride_extra: int):
    """While active, the token loader's windows start every seq_len + stride_extra tokens (a retrieval
    dataset's stride, with stride_extra its chunk), so a plain run reads the windows a retrieval run reads."""
    from plait.data.loader import TokenDataset

    original = TokenDataset.stride
    TokenDataset.stride = lambda self, seq_len: seq_len + stride_extra  # type: ignore[method-assign]
    try:
        yield
    finally:
        TokenDataset.stride = original  # type: ignore[method-assign]


@contextlib.contextmanager
def gate_readings():
    """While active, the dict yielded maps each retrieval block's gate to its latest tanh(weight): how much of
    its cross-attention the model adds to its residual stream (0: nothing)."""
    from plait.model.retrieval import NeighbourCopy, RetrievalGate

    readings: dict = {}
    original, shares = RetrievalGate.forward, NeighbourCopy.shares

    def forward(self, x):
        readings[id(self)] = float(self.weight.detach().tanh()[0])
        return original(self, x)

    def copy_shares(self):
        w = shares(self)
        readings["copy"] = [round(float(v), 4) for v in w.detach()]  # the unigram's and the bigram's
        return w

    RetrievalGate.forward = forward  # type: ignore[method-assign]
    NeighbourCopy.shares = copy_shares  # type: ignore[method-assign]
    try:
        yield readings
    finally:
        RetrievalGate.forward = original  # type: ignore[method-assign]
        NeighbourCopy.shares = shares  # type: ignore[method-assign]


def run(data: Path, out: Path, name: str, steps: int, batch: int, seed: int, extra: list[str], chunk: int) -> dict:
    """One run's final held-out loss, training loss over its last 50 steps, tokens/s and gates; a plain run
    (no model.retrieval_layers in `extra`) reads the windows of a retrieval run of this chunk."""
    from plait.api import train
    from plait.config import load_config

    cfg = [f"data.source={data}", f"train.steps={steps}", f"train.global_batch_size={batch}", f"run.seed={seed}",
           f"eval.every_steps={steps}", "eval.num_batches=16", "sample.max_new_tokens=0", "log.tensorboard=false",
           "checkpoint.save_final=false", "log.every_steps=10", f"run.out_dir={out}", f"run.name={name}",
           SCHEDULE, *extra]  # fmt: skip
    started = time.perf_counter()
    retrieves = any(c.startswith("model.retrieval_layers=") for c in extra)
    with contextlib.nullcontext() if retrieves else windows_every(chunk), gate_readings() as gates:
        train(load_config(None, cfg))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r][1:]  # the first includes start-up
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    train_losses = [r["train/loss"] for r in rows if "train/loss" in r and r["step"] > steps - 50]
    return {"val_loss": val[-1], "train_loss": statistics.fmean(train_losses), "tokens_per_s": statistics.median(rates),
            "seconds": time.perf_counter() - started, "gates": sorted(v for k, v in gates.items() if k != "copy"),
            **({"copy_shares": gates["copy"]} if "copy" in gates else {})}  # fmt: skip


def shuffled_neighbours_loss(run_dir: Path) -> dict[str, float]:
    """A trained retrieval model's held-out loss with its neighbours as retrieved and with them permuted
    across the held-out chunks (each chunk given another chunk's neighbours): equal losses mean the model
    takes nothing from its neighbours."""
    import numpy as np

    import plait.data.retrieval as retrieval
    from plait.cli.main import main as plait_main

    out: dict[str, float] = {}
    original = retrieval.RetrievalDataset.__init__
    for side in ("retrieved", "shuffled"):

        def init(self, data_dir, split, _side=side, **kw):
            original(self, data_dir, split, **kw)
            if _side == "shuffled" and split != "train":
                self.neighbours = np.asarray(self.neighbours)[
                    np.random.default_rng(0).permutation(len(self.neighbours))
                ]

        retrieval.RetrievalDataset.__init__ = init
        try:
            plait_main(["eval", str(run_dir), "--json", str(run_dir / f"eval_{side}.json")])
        finally:
            retrieval.RetrievalDataset.__init__ = original
        out[side] = json.loads((run_dir / f"eval_{side}.json").read_text())["perplexity"]["loss"]
    return out


@contextlib.contextmanager
def oracle_neighbours():
    """While active, every training chunk's neighbours are the chunk itself and its continuation (database chunk
    i: what the chunk after it will say), the leak RETRO's exclusion of a chunk's own document keeps out. A model
    that can read its neighbours learns to copy the continuation and its training loss falls below the plain
    model's; one that cannot (no positions between tokens and neighbours, a misaligned chunk) stays above."""
    import numpy as np

    import plait.data.retrieval as retrieval

    original = retrieval.RetrievalDataset.__init__

    def init(self, data_dir, split, **kw):
        original(self, data_dir, split, **kw)
        if split == "train":
            n = len(self.neighbours)
            own = np.minimum(np.arange(n, dtype=np.int32), n - 2)  # the last chunk has no continuation: a near one
            self.neighbours = np.repeat(own[:, None], self.k, axis=1)

    retrieval.RetrievalDataset.__init__ = init
    try:
        yield
    finally:
        retrieval.RetrievalDataset.__init__ = original


@contextlib.contextmanager
def random_neighbours():
    """While active, every chunk's neighbours, in training and validation, are random database chunks: the
    control that tells a gain from the retrieved text apart from a gain from any text of the corpus."""
    import numpy as np

    import plait.data.retrieval as retrieval

    original = retrieval.RetrievalDataset.__init__

    def init(self, data_dir, split, **kw):
        original(self, data_dir, split, **kw)
        found = np.asarray(self.neighbours)
        rng = np.random.default_rng(1 if split == "train" else 2)
        self.neighbours = rng.integers(0, int(found.max()) + 1, found.shape).astype(found.dtype)

    retrieval.RetrievalDataset.__init__ = init
    try:
        yield
    finally:
        retrieval.RetrievalDataset.__init__ = original


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="train.global_batch_size of every run")
    p.add_argument("--encoder-steps", type=int, default=100, help="steps of the encoder's training")
    p.add_argument("--encoder", help="the database's encoder: lexical, or a model (default: one trained here)")
    p.add_argument(
        "--documents",
        choices=["plays", "speeches", "code"],
        default="plays",
        help="what a document is (code: another corpus, bench/retrieval_db.py)",
    )
    p.add_argument("--retro", default=";".join(RETRO), help="the retrieval runs' settings, ';'-separated")
    p.add_argument("--json", default="bench/results/retrieval_quality.json")
    p.add_argument("--shuffled-check", action="store_true",
                   help="also score each retrieval run's model with its held-out neighbours permuted")  # fmt: skip
    p.add_argument("--oracle", action="store_true",
                   help="also train with each training chunk and its continuation as its neighbours")  # fmt: skip
    p.add_argument("--random-neighbours", action="store_true",
                   help="the retrieval runs' neighbours random database chunks (a control)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.dry_run:
        print(f"would train {2 * len(seeds)} runs of {a.steps} steps (chunk {a.chunk}, k {a.k})")
        return 0
    from plait.data.retrieval import build_database
    from retrieval_db import corpus_and_encoder  # bench/: the same corpus and encoder as the build's benchmark

    work = Path(tempfile.mkdtemp(prefix="plait-retrieval-quality-"))
    data, encode, described = corpus_and_encoder(work, a.encoder, a.encoder_steps, a.documents, a.chunk)
    build_database(data, encode, encoder=described, chunk=a.chunk, k=a.k)
    retro = [*a.retro.split(";"), f"model.retrieval_chunk={a.chunk}", f"model.retrieval_k={a.k}"]
    results: dict[str, list[dict]] = {"plain": [], "retrieval": []}
    for seed in seeds:
        results["plain"].append(run(data, work, f"plain-{seed}", a.steps, a.batch, seed, [], a.chunk))
        keep = ["checkpoint.save_final=true"] if a.shuffled_check else []
        with random_neighbours() if a.random_neighbours else contextlib.nullcontext():
            results["retrieval"].append(
                run(data, work, f"retro-{seed}", a.steps, a.batch, seed, [*retro, *keep], a.chunk)
            )
        if a.shuffled_check:
            results["retrieval"][-1]["held_out_loss"] = shuffled_neighbours_loss(work / f"retro-{seed}")
        if a.oracle:
            with oracle_neighbours():
                oracle = run(data, work, f"oracle-{seed}", a.steps, a.batch, seed, retro, a.chunk)
            results.setdefault("oracle", []).append(oracle)
            losses = ", ".join(f"{side} {results[side][-1]['train_loss']:.4f}" for side in results)
            print(f"seed {seed}: training loss, last 50 steps: {losses}", flush=True)
        print(f"seed {seed}: val loss {results['plain'][-1]['val_loss']:.4f} plain, "
              f"{results['retrieval'][-1]['val_loss']:.4f} with retrieval (gates "
              f"{', '.join(f'{g:+.4f}' for g in results['retrieval'][-1]['gates'])}; copy shares "
              f"{results['retrieval'][-1].get('copy_shares', '-')})", flush=True)  # fmt: skip
    gains = [p["val_loss"] - r["val_loss"] for p, r in zip(results["plain"], results["retrieval"], strict=True)]
    speed = {side: statistics.median(r["tokens_per_s"] for r in runs) for side, runs in results.items()}
    oracle_gain = [
        p["train_loss"] - o["train_loss"] for p, o in zip(results["plain"], results.get("oracle", []), strict=False)
    ]
    summary = {
        "steps": a.steps,
        "chunk": a.chunk,
        "k": a.k,
        "batch": a.batch,
        "encoder": described,
        "encoder_steps": None if a.encoder else a.encoder_steps,
        "documents": a.documents,
        "random_neighbours": a.random_neighbours,
        "retrieval_settings": a.retro.split(";"),
        "seeds": seeds,
        "runs": results,
        "val_loss_gain_mean": statistics.mean(gains),
        "val_loss_gain_stdev": statistics.stdev(gains) if len(gains) > 1 else 0.0,
        "tokens_per_s": speed,
        "step_cost_ratio": speed["plain"] / speed["retrieval"],
        **({"oracle_train_loss_gain_mean": statistics.mean(oracle_gain)} if oracle_gain else {}),
    }
    print(f"held-out loss lower by {summary['val_loss_gain_mean']:+.4f} +- {summary['val_loss_gain_stdev']:.4f} "
          f"nats/token with retrieval (plain - retrieval, {len(seeds)} seeds); tokens/s {speed['plain']:,.0f} plain, "
          f"{speed['retrieval']:,.0f} with retrieval (a step costs {summary['step_cost_ratio']:.2f}x)")  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
