"""`plait data prepare` throughput: one worker against several, on a generated corpus, in the same run.

The corpus: the bundled Shakespeare text cut into its speeches (one JSON document each), repeated up to
--size-mb. Both runs use the bundled corpus's tokenizer (no BPE training: only tokenising is timed, as
at scale, where the tokenizer is trained once on a sample). Printed and written to
bench/results/prepare_scaling.json: MB/s and tokens/s per number of workers, the speed-up against one, and
whether the outputs are byte-identical (they must be).

    python bench/prepare_scaling.py [--size-mb 1024] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from plait.core.hardware import device_info  # noqa: E402
from plait.data import ensure_prepared  # noqa: E402
from plait.data.prepare import bundled_corpus_path, prepare  # noqa: E402


def corpus(path: Path, size_mb: float) -> int:
    with gzip.open(bundled_corpus_path(), "rt") as f:
        speeches = [s for line in f for s in json.loads(line)["text"].split("\n\n") if s.strip()]
    lines = [json.dumps({"text": s}) + "\n" for s in speeches]
    written, target = 0, int(size_mb * 1e6)
    with open(path, "w") as f:
        while written < target:
            for line in lines:
                f.write(line)
                written += len(line.encode())
                if written >= target:
                    break
    return path.stat().st_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prepare_scaling.json")
    a = p.parse_args()
    counts = [int(w) for w in a.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="plait-prepare-") as tmp_dir:
        tmp = Path(tmp_dir)
        size = corpus(tmp / "corpus.jsonl", a.size_mb)
        tokenizer = ensure_prepared("shakespeare", tmp / "cache", 4096) / "tokenizer.json"
        for workers in counts:
            started = time.perf_counter()
            m = prepare([tmp / "corpus.jsonl"], tmp / f"out{workers}", tokenizer=tokenizer, workers=workers)
            seconds = time.perf_counter() - started
            tokens = sum(s["num_tokens"] for s in m["splits"].values())
            rows.append({"workers": workers, "seconds": round(seconds, 1), "mb_per_s": round(size / 1e6 / seconds, 2),
                         "tokens_per_s": round(tokens / seconds), "splits": m["splits"]})  # fmt: skip
            rate = f"{size / 1e6 / seconds:.2f} MB/s, {tokens / seconds:,.0f} tokens/s"
            print(f"{workers} worker(s): {seconds:.1f} s, {rate}", flush=True)
    same = all(r["splits"] == rows[0]["splits"] for r in rows)
    for r in rows:
        r["speedup"] = round(rows[0]["seconds"] / r["seconds"], 2)
        r.pop("splits")
    record = {
        "machine": f"{device_info(torch.device('cpu')).name}, {os.cpu_count()} cores ({platform.machine()})",
        "corpus_mb": round(size / 1e6, 1),
        "tokens": tokens,
        "identical_outputs": same,
        "runs": rows,
    }
    print(json.dumps(record, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
