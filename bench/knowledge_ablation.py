"""Which part of a retrieval model carries the knowledge? The models bench/knowledge.py trained (its JSON names
their directory), each scored again with one part switched off at test time, no retraining: the cross-attention
(its gates set to 0), the pointer (its share to 0), the copy (its shares to 0), and for a learned retriever its
prior (uniform) and its learning (the table set back to the lexical encoder it started from). A part that
carries the answers takes the exact-match rate with it when it is off; one that does not leaves it where it was.

    python bench/knowledge_ablation.py [--json bench/results/knowledge.json]
        [--models pointer,pointer_no_copy,retrieval] [--out bench/results/knowledge_ablation.json]

Scored as bench/knowledge.py scores (plait.lifecycle.qa: greedy exact match of the held-out question form, the
prompt left-padded to whole chunks), per split, with the database and with the swapped one (the new facts'
rate and the old facts'). Printed: a table of each model and part off against the model whole, over the seeds;
written to --out with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import host  # bench/host.py: the machine line

SPLITS = ("qa", "trained", "read", "database_only")
PARTS = ("none", "cross_attention", "pointer", "copy", "prior", "learning")
"""prior and learning: a learned retriever's (model.retrieval_learned) prior p(z | x) made uniform (the search
still its own), and its table set back to the lexical encoder it started from (search and prior both)."""


def switched_off(model, part: str, work: Path) -> bool:
    """Set `part` of the model to 0 in place; False where the model has no such part."""
    import torch

    with torch.no_grad():
        retriever = getattr(getattr(model, "neighbour_pointer", None), "retriever", None)
        if part in ("prior", "learning"):
            if retriever is None:
                return False
            if part == "prior":
                retriever.scale.fill_(-30.0)  # 10 e^-30 x the cosines: p(z | x) uniform
            else:
                from plait.data.lexical import lexical_table

                lexical = torch.from_numpy(lexical_table(work / "train", model.args.retrieval_chunk,
                                                         model.args.retrieval_dim))  # fmt: skip
                retriever.table.zero_()
                retriever.table[: len(lexical)] = lexical
            return True
        if part == "cross_attention":
            gates = [b.cross.gate.weight for b in model.layers.values() if b.cross is not None]
            for g in gates:
                g.zero_()
            return bool(gates)
        found = {"pointer": getattr(model, "neighbour_pointer", None), "copy": getattr(model, "neighbour_copy", None)}
        module = found.get(part)
        if module is None:
            return part == "none"
        module.weight.zero_()
        return True


def questions(work: Path, answer_field: str):
    """The bench's questions with its four splits (every other person of each facts split, by name, also asked in
    training: qa and read, as bench/knowledge.py and bench/facts.py --qa-every 2 choose them)."""
    from dataclasses import replace

    from plait.lifecycle.qa import read_questions

    path = work / "facts" / "questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    asked = set()
    for split in ("trained", "database_only"):
        asked |= set(sorted({r["person"] for r in rows if r["split"] == split})[::2])
    renamed = {"trained": "qa", "database_only": "read"}
    found = read_questions(path, answer_field)
    return [replace(q, split=renamed[q.split]) if r["person"] in asked else q for q, r in zip(found, rows, strict=True)]


def score(run: Path, work: Path, part: str) -> dict | None:
    """Exact-match rate per split: with the database (the facts) and with the swapped one (new, old)."""
    from plait.engine.generate import load_for_generation
    from plait.lifecycle.qa import score_questions
    from plait.lifecycle.retrieval import checkpoint_retriever

    model, tok, eos = load_for_generation(run, device="cpu")
    if not switched_off(model, part, work):
        return None
    out = {}
    for db, field, key in (("database", "answer", "facts"), ("swapped", "swapped_answer", "new"),
                           ("swapped", "answer", "old")):  # fmt: skip
        qs = questions(work, field)
        retrieve = checkpoint_retriever(run, model, data=work / db)
        hits = score_questions(model, tok, eos, qs, retrieve)
        out[key] = {s: statistics.mean(h for q, (_, h) in zip(qs, hits, strict=True) if q.split == s) for s in SPLITS}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench/results/knowledge.json", help="bench/knowledge.py's record")
    p.add_argument("--models", default="pointer,pointer_no_copy,retrieval")
    p.add_argument("--parts", default=",".join(PARTS), help="which to switch off, of " + ", ".join(PARTS))
    p.add_argument("--out", default="bench/results/knowledge_ablation.json")
    p.add_argument("--plot", action="store_true", help="only plot --out again (beside it, .png)")
    a = p.parse_args()
    if a.plot:
        plot(json.loads(Path(a.out).read_text())["runs"], Path(a.out).with_suffix(".png"))
        return 0
    record = json.loads(Path(a.json).read_text())
    work = Path(record["work_dir"])
    started, results = time.perf_counter(), {}
    for model in a.models.split(","):
        for run in record["runs"].get(model, []):
            run_dir = work / "runs" / f"{model}-{run['seed']}"
            for part in a.parts.split(","):
                found = score(run_dir, work, part)
                if found is not None:
                    results.setdefault(model, {}).setdefault(part, []).append({"seed": run["seed"], **found})
                    db = {key: found[key]["database_only"] for key in ("facts", "new", "old")}
                    print(f"{model} seed {run['seed']} {part} off: database_only {db['facts']:.3f}, "
                          f"swap new/old {db['new']:.3f}/{db['old']:.3f}", flush=True)  # fmt: skip
    summary = {m: {part: {key: {s: round(statistics.mean(r[key][s] for r in runs), 4) for s in SPLITS}
                            for key in ("facts", "new", "old")} for part, runs in parts.items()}
               for m, parts in results.items()}  # fmt: skip
    print(f"{'model':<16} {'off':<16} " + " ".join(f"{s:>14}" for s in SPLITS) + f" {'swap new':>9} {'swap old':>9}")
    for m, parts in summary.items():
        for part, found in parts.items():
            rates = " ".join(f"{found['facts'][s]:14.3f}" for s in SPLITS)
            print(
                f"{m:<16} {part:<16} {rates} {found['new']['database_only']:9.3f} {found['old']['database_only']:9.3f}"
            )
    out = {"machine": host.describe(), "source": a.json, "summary": summary, "runs": results,
           "seconds": round(time.perf_counter() - started)}  # fmt: skip
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(results, Path(a.out).with_suffix(".png"))
    return 0


def plot(runs: dict, path: Path) -> None:
    """Bars per model and part off: database-only people's exact match with the database, and the new facts'
    after the swap, the seeds' mean with their spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{m}\n{part} off" if part != "none" else f"{m}\nas trained", found)
            for m, parts in runs.items() for part, found in parts.items()]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(bars)), 4.5))
    for i, (key, label) in enumerate((("facts", "database-only people"), ("new", "swapped: new facts"))):
        values = [[r[key]["database_only"] for r in found] for _, found in bars]
        means = [statistics.mean(v) for v in values]
        spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        ax.bar([j + 0.4 * i for j in range(len(bars))], means, 0.4, yerr=spread, label=label)
    ax.set_xticks([j + 0.2 for j in range(len(bars))], [b for b, _ in bars], fontsize=8)
    ax.set(ylabel="greedy exact match", title="Which part carries the answers (seeds' mean, sd)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
