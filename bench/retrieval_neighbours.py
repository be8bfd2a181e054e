"""How much do a retrieval database's neighbours tell about the text that follows? For held-out chunks: the
share of the next chunk's token bigrams found in the continuations of (a) the chunk's k database neighbours,
(b) k random database chunks, (c) the k database chunks sharing the most (rarity-weighted) bigrams with it, a
lexical search that stands for the best a better encoder could find. RETRO's gain comes from (a) well above
(b); if even (c) is close to (b), the corpus does not repeat itself enough for retrieval to pay.

    python bench/retrieval_neighbours.py [--documents speeches|plays] [--encoder-steps 100] [--chunk 32] [--k 2]
        [--queries 1500] [--json bench/results/retrieval_neighbours.json]

The corpus and encoder are those of bench/retrieval_quality.py (the bundled corpus; plait's default model
trained --encoder-steps steps as the encoder).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

COMMON = 2000  # bigrams in more database chunks than this are skipped by the lexical search (too common to tell)


def bigrams(chunk: np.ndarray, vocab: int) -> set[int]:
    return set((chunk[:-1].astype(np.int64) * vocab + chunk[1:]).tolist())


def share(target: set[int], found: set[int]) -> float:
    return len(target & found) / max(len(target), 1)


def measure(data: Path, chunk: int, k: int, queries: int, seed: int = 0) -> dict[str, float]:
    from plait.data.retrieval import chunk_split, neighbours

    train, val = chunk_split(data, "train", chunk).tokens, chunk_split(data, "val", chunk).tokens
    found = np.asarray(neighbours(data, "val"))[:, :k]
    vocab = int(max(train.max(), val.max())) + 1
    stored = len(train) - 1  # a database chunk has a continuation
    index: dict[int, list[int]] = collections.defaultdict(list)
    for j in range(stored):
        for b in bigrams(train[j], vocab):
            index[b].append(j)
    rng = np.random.default_rng(seed)
    sides: dict[str, list[float]] = {"database": [], "random": [], "lexical": []}
    for u in rng.choice(len(val) - 1, min(queries, len(val) - 1), replace=False):
        query, following = bigrams(val[u], vocab), bigrams(val[u + 1], vocab)
        score: collections.Counter = collections.Counter()
        for b in query:
            hits = index.get(b, ())
            if len(hits) <= COMMON:
                for j in hits:
                    score[j] += 1.0 / math.log(2 + len(hits))
        chosen = {
            "database": [int(j) for j in found[u]],
            "random": rng.integers(0, stored, k).tolist(),
            "lexical": [j for j, _ in score.most_common(k)],
        }
        for side, rows in chosen.items():
            continuations = set().union(*(bigrams(train[j + 1], vocab) for j in rows if j + 1 < len(train)))
            sides[side].append(share(following, continuations))
    return {side: float(np.mean(values)) for side, values in sides.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", choices=["plays", "speeches", "code"], default="speeches")
    p.add_argument("--encoder-steps", type=int, default=100)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--queries", type=int, default=1500)
    p.add_argument("--json", default="bench/results/retrieval_neighbours.json")
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from plait.data.retrieval import build_database
    from retrieval_db import corpus_and_encoder  # bench/: the same corpus and encoder as the quality benchmark

    work = Path(tempfile.mkdtemp(prefix="plait-retrieval-neighbours-"))
    started = time.perf_counter()
    data, encode, described = corpus_and_encoder(work, steps=a.encoder_steps, documents=a.documents)
    build_database(data, encode, encoder=described, chunk=a.chunk, k=a.k)
    result = measure(data, a.chunk, a.k, a.queries)
    out = {"documents": a.documents, "encoder_steps": a.encoder_steps, "chunk": a.chunk, "k": a.k,
           "queries": a.queries, "next_chunk_bigrams_found": result,
           "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    for side, value in result.items():
        print(f"{side:9s} neighbours' continuations hold {100 * value:5.2f}% of the next chunk's bigrams")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
