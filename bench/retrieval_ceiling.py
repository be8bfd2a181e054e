"""How much could a model gain from its neighbours on this corpus? A ceiling without training a network: the
held-out loss of the next chunk's tokens under an interpolated bigram model of the train split, mixed with
caches (Kuhn and De Mori's cache model; kNN-LM's mixture) of (a) the window's own preceding seq_len tokens,
(b) the retrieved neighbours' tokens (each a chunk and its continuation), (c) both. The mixture weights are the
best of a grid, chosen on the same tokens (so the figures are generous). "Neighbours add" is (a) minus (c):
what retrieval could add beyond what the context already gives; random database chunks in place of the
neighbours are the control (they add 0).

    python bench/retrieval_ceiling.py [--documents plays|speeches|code] [--chunk 32] [--ks 2,8] [--queries 1500]
        [--model-encoder-steps 100] [--model-steps 150]

--model-steps N also puts plait's default model, trained N steps on the same corpus without retrieval, in
the bigram's place (its probability of each scored token, from a window of seq_len tokens): the caches then
measure what that model leaves on the table. "Neighbours' cache" alone over it is the most a retrieval model of
the same size and steps could gain over the plain one by copying from its neighbours, as a cache copies.

Neighbours: plait.data.lexical's encoder, as `plait data retrieve --encoder lexical` finds them for held-out
chunks; with --model-encoder-steps also plait's default model trained that long (the other kind of encoder).
With speeches as documents each side's share of neighbours from the query's own play is printed too. Written
to bench/results/retrieval_ceiling_{documents}.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GRID = (0.0, 0.02, 0.05, 0.1, 0.2)  # each cache's unigram and bigram weights
BIGRAM_WEIGHT = 0.6  # the bigram model's weight on the bigram (the rest on the unigram)


def probabilities(train: np.ndarray, vocab: int):
    """p(b | a) of an interpolated bigram model of a token stream."""
    unigram = np.bincount(train, minlength=vocab) + 0.5
    unigram /= unigram.sum()
    pairs, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    follows = np.bincount(train[:-1], minlength=vocab)

    def p(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        at = np.searchsorted(pairs, a * vocab + b)
        hit = (at < len(pairs)) & (pairs[np.minimum(at, len(pairs) - 1)] == a * vocab + b)
        seen = follows[a] > 0
        bigram = np.where(hit, counts[np.minimum(at, len(pairs) - 1)], 0) / np.maximum(follows[a], 1)
        w = BIGRAM_WEIGHT * seen
        return w * bigram + (1 - w) * unigram[b]

    return p


def cache(tokens: np.ndarray, prev: int, target: int) -> tuple[float, float, bool]:
    """(target's share of the tokens, its share of the tokens that follow `prev` there, whether any do)."""
    after = tokens[1:][tokens[:-1] == prev]
    return float((tokens == target).mean()), float((after == target).mean()) if len(after) else 0.0, len(after) > 0


def nearest(data: Path, chunk: int, k: int, encode) -> np.ndarray:
    """(val chunks, k) nearest database chunks of each held-out chunk by `encode` (cosine), as the database finds
    them (validation chunks exclude nothing: none of theirs is in the database)."""
    import faiss

    from plait.data.retrieval import chunk_split

    train, val = chunk_split(data, "train", chunk).tokens, chunk_split(data, "val", chunk).tokens

    def unit(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    blocks = [unit(encode(train[s : min(s + 1024, len(train) - 1)])) for s in range(0, len(train) - 1, 1024)]
    index = faiss.IndexFlatIP(blocks[0].shape[1])
    for block in blocks:
        index.add(block)
    return np.concatenate([index.search(unit(encode(val[s : s + 1024])), k)[1] for s in range(0, len(val), 1024)])


def query_chunks(data: Path, chunk: int, seq_len: int, queries: int, seed: int = 0) -> np.ndarray:
    """The held-out chunks whose next chunk is scored: each with a whole window of context before the chunk it
    helps predict; the same for every k, every side and the model."""
    from plait.data.retrieval import chunk_split

    n, first = len(chunk_split(data, "val", chunk).tokens), seq_len // chunk
    return np.random.default_rng(seed).choice(np.arange(first, n - 1), min(queries, n - 1 - first), replace=False)


def model_probabilities(run_dir: Path, data: Path, chunk: int, seq_len: int, us: np.ndarray) -> np.ndarray:
    """(len(us), chunk): a trained model's probability of each token of chunk u + 1, reading the seq_len tokens
    before chunk u + 1's last one (so each token has seq_len - chunk .. seq_len - 1 tokens of context, as the
    model had in training)."""
    import torch

    from plait.data.retrieval import chunk_split
    from plait.lifecycle.models import load_model

    model = load_model(run_dir).model.eval()
    stream = torch.from_numpy(chunk_split(data, "val", chunk).tokens.ravel().astype(np.int64))
    out = []
    with torch.no_grad():
        for block in np.array_split(us, max(1, len(us) // 64)):
            ends = [(int(u) + 2) * chunk - 1 for u in block]
            windows = torch.stack([stream[e - seq_len : e] for e in ends])
            targets = torch.stack([stream[e - chunk + 1 : e + 1] for e in ends])
            logp = model(windows)[:, -chunk:].float().log_softmax(-1)
            out.append(logp.gather(-1, targets[..., None])[..., 0].exp().numpy())
    return np.concatenate(out).astype(np.float64)


def ceiling(
    data: Path, chunk: int, found: np.ndarray, seq_len: int, us: np.ndarray, model: np.ndarray | None = None
) -> dict:
    """The cache ceiling (module docstring) over the held-out chunks `us` with the neighbours `found`; with
    `model` (model_probabilities of `us`) a trained model's probabilities in place of the bigram's."""
    from plait.data.loader import read_manifest
    from plait.data.retrieval import chunk_split

    train, val = chunk_split(data, "train", chunk).tokens, chunk_split(data, "val", chunk).tokens
    vocab = int(read_manifest(data)["vocab_size"])
    stream = val.ravel().astype(np.int64)
    rows, pairs = [], []
    for u in us:
        neighbours = np.concatenate([np.concatenate([train[j], train[j + 1]]) for j in found[u]])
        for pos in range((u + 1) * chunk, (u + 2) * chunk):
            prev, target = int(stream[pos - 1]), int(stream[pos])
            rows.append((*cache(stream[pos - seq_len : pos], prev, target), *cache(neighbours, prev, target)))
            pairs.append((prev, target))
    r, ab = np.asarray(rows, dtype=np.float64), np.asarray(pairs, dtype=np.int64)
    if model is None:  # the bigram model of the train split (not built where a trained model takes its place)
        bigram = probabilities(train.ravel().astype(np.int64), vocab)(ab[:, 0], ab[:, 1])
    else:
        bigram = model.ravel()
    cu, cb, ch, nu, nb, nh = r.T

    def loss(wcu: float, wcb: float, wnu: float, wnb: float) -> float:
        rest = 1 - wcu - wcb * ch - wnu - wnb * nh
        q = rest * bigram + wcu * cu + wcb * ch * cb + wnu * nu + wnb * nh * nb
        return float(-np.log(np.maximum(q, 1e-12)).mean())

    base = loss(0, 0, 0, 0)
    context = min((loss(a, b, 0, 0), a, b) for a, b in itertools.product(GRID, GRID))
    neighbours_only = min(loss(0, 0, a, b) for a, b in itertools.product(GRID, GRID))
    both = min(loss(*w) for w in itertools.product(GRID, GRID, GRID, GRID))  # all four weights together
    return {"tokens": len(r), "bigram" if model is None else "model": base,
            "with_context": context[0], "with_neighbours": neighbours_only, "with_both": both,
            "neighbours_add": context[0] - both}  # fmt: skip


def speech_plays(data: Path, chunk: int) -> tuple[np.ndarray, np.ndarray, float]:
    """With speeches as documents: (each train chunk's play, each held-out chunk's play, the share of database
    chunks from a held-out chunk's play on average: the same-play share of random neighbours)."""
    import gzip

    from plait.data.prepare import _is_val, bundled_corpus_path  # the split's own rule (10% of speeches held out)
    from plait.data.retrieval import chunk_split

    with gzip.open(bundled_corpus_path(), "rt") as f:
        plays = [json.loads(line)["text"] for line in f if line.strip()]
    speeches = [(p, s) for p, text in enumerate(plays) for s in text.split("\n\n") if s.strip()]
    held = [_is_val(i, s, 0.1) for i, (_, s) in enumerate(speeches)]
    train_play = np.array([p for (p, _), v in zip(speeches, held, strict=True) if not v])
    val_play = np.array([p for (p, _), v in zip(speeches, held, strict=True) if v])
    train, val = chunk_split(data, "train", chunk), chunk_split(data, "val", chunk)
    by_chunk = train_play[np.minimum(train.first_doc, len(train_play) - 1)]
    query = val_play[np.minimum(val.first_doc, len(val_play) - 1)]
    shares = np.bincount(by_chunk, minlength=len(plays)) / len(by_chunk)
    return by_chunk, query, float(shares[query].mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", choices=["plays", "speeches", "code"], default="plays")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--ks", default="2,8")
    ap.add_argument("--seq-len", type=int, default=256, help="the context cache's length (the model's window)")
    ap.add_argument("--queries", type=int, default=1500, help="held-out chunks whose next chunk is scored")
    ap.add_argument(
        "--model-encoder-steps",
        type=int,
        default=0,
        help="also plait's default model trained this many steps as the encoder (the database's other kind)",
    )
    ap.add_argument(
        "--model-steps",
        type=int,
        default=0,
        help="also the ceiling over plait's default model trained this many steps in place of the bigram",
    )
    ap.add_argument("--json", help="default bench/results/retrieval_ceiling_{documents}.json")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from plait.data.lexical import lexical_encoder
    from plait.data.retrieval import chunk_split
    from retrieval_db import corpus_and_encoder

    work = Path(tempfile.mkdtemp(prefix="plait-retrieval-ceiling-"))
    started = time.perf_counter()
    model = a.model_encoder_steps > 0
    data, encode, _ = corpus_and_encoder(
        work, None if model else "lexical", a.model_encoder_steps, a.documents, a.chunk
    )
    encoders = {"lexical": lexical_encoder(data, a.chunk)[0], **({"model": encode} if model else {})}
    plays = speech_plays(data, a.chunk) if a.documents == "speeches" else None
    us = query_chunks(data, a.chunk, a.seq_len, a.queries)
    trained = None
    if a.model_steps:  # the model the neighbours would have to help: trained on the same corpus, no retrieval
        from retrieval_quality import run

        run(data, work, "plain", a.model_steps, 8, 0, [f"data.seq_len={a.seq_len}", "checkpoint.save_final=true"],
            a.chunk)  # fmt: skip
        trained = model_probabilities(work / "plain", data, a.chunk, a.seq_len, us)
    rows = []
    for k in (int(k) for k in a.ks.split(",")):
        sides = {name: nearest(data, a.chunk, k, encode) for name, encode in encoders.items()}
        val_chunks = len(chunk_split(data, "val", a.chunk).tokens)
        sides["random"] = np.random.default_rng(1).integers(0, len(chunk_split(data, "train", a.chunk).tokens) - 1,
                                                            (val_chunks, k))  # fmt: skip
        for name, found in sides.items():
            r = {"k": k, "neighbours": name, **ceiling(data, a.chunk, found, a.seq_len, us)}
            if trained is not None:
                r["over_the_model"] = ceiling(data, a.chunk, found, a.seq_len, us, trained)
            if plays is not None:
                r["same_play"] = float((plays[0][found] == plays[1][:, None]).mean())
                r["same_play_by_chance"] = plays[2]
            rows.append(r)
            same = f" (from the query's play: {r['same_play']:.1%})" if plays is not None else ""
            print(f"k={k} {name:>7} neighbours{same}: bigram {r['bigram']:.4f}, + context cache "
                  f"{r['with_context']:.4f}, + neighbours' cache {r['with_neighbours']:.4f}, "
                  f"+ both {r['with_both']:.4f}: neighbours add {r['neighbours_add']:.4f} nats/token beyond the "
                  "context", flush=True)  # fmt: skip
            if trained is not None:
                m = r["over_the_model"]
                print(f"    over the trained model: {m['model']:.4f}, + context cache {m['with_context']:.4f}, "
                      f"+ neighbours' cache {m['with_neighbours']:.4f}, + both {m['with_both']:.4f}: neighbours "
                      f"add {m['neighbours_add']:.4f}", flush=True)  # fmt: skip
    out = Path(a.json or f"bench/results/retrieval_ceiling_{a.documents}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "documents": a.documents,
        "chunk": a.chunk,
        "seq_len": a.seq_len,
        "queries": a.queries,
        "model_steps": a.model_steps,
        "grid": GRID,
        "bigram_weight": BIGRAM_WEIGHT,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(summary, indent=2) + "\n")  # fmt: skip
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
