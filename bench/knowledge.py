"""Does retrieval carry knowledge? Facts about fictional people (bench/facts.py), retrieval models and a plain one
trained on the same text, the same steps and seed, then asked about people they trained on and people who exist
only in the database; then the database swapped for one where every fact is changed, with no retraining.

    python bench/knowledge.py [--people 400] [--steps 600] [--batch 8] [--seeds 0,1,2] [--chunk 16] [--k 2]
        [--retro '...;...'] [--gate-start 0.5] [--models plain,retrieval_open,retrieval]
        [--json bench/results/knowledge.json]

The models (preset tiny, windows of 128 tokens, the plain one reading the windows the retrieval ones read):
- plain: no retrieval;
- retrieval: cross-attention in blocks 2 and 3, a 1-block neighbour encoder, the copy on (RETRO below), as
  plait starts it: the gates shut (tanh(w) = 0);
- retrieval_open: the same with its gates starting at tanh(w) = --gate-start (a control: does the shut start
  keep the cross-attention out?);
- retrieval_open_no_copy, first seed only: retrieval_open without the copy, so the cross-attention alone (not
  in the default --models since the second slice; its first-slice numbers are in the JSON's "slice1");
- pointer: retrieval with model.retrieval_pointer; pointer_no_copy, first seed only, without the copy;
- pointer_learned: pointer with the retriever that learns (model.retrieval_learned: its encoder starts as the
  database's lexical one, the pointer's likelihood is marginalised over the neighbours, the index is rebuilt
  every REFRESH_STEPS steps), scored with its own encoder's neighbours (--json bench/results/knowledge_learned.json
  keeps it beside the frozen runs of knowledge.json).

The data (made once, facts seed 0; only the training seed changes between seeds). The people, four splits:
- qa: biography in the training text, and one document of their four questions and answers in the held-out
  phrasing ("Q: Where was X born? A: Kestrelford" ...) in training too;
- trained: biography in the training text, no questions in training (what the weights hold, asked in a form
  the model saw only for others: without some question-answering in training a model of this size never answers
  a question form it has not seen; the "physics of language models" setup);
- read: biography only in the database, but their question document in training: answering it the first time
  in training needs the neighbours, the signal that rewards reading the database (the first slice had none of
  these, and its retrieval models answered from memory); asked after training they are trained text, so their
  test is the swapped database: does the answer follow the database or the memorised question document?
- database_only: biography only in the database, no questions in training: the test of reading.
Files:
- train: the training text (the qa and trained people's biographies, the qa and read people's question
  documents, shuffled) followed by the database (everyone's biographies), one prepared directory with a
  held-out share of 5% (TRAIN_VAL) and its lexical database built over its whole train stream: a question
  chunk's neighbours are its person's biographies (other documents, so the exclusion of a chunk's own
  documents leaves them). Every model (the plain one too) trains on windows of the training text only
  (windows_before): the database part is read as neighbours, never trained on.
- database: everyone's biographies (database.jsonl), and the swapped database (database_swapped.jsonl): every
  fact changed. Both prepared with the training directory's tokenizer, a held-out split of 0.2% (HELD_OUT),
  and the lexical encoder, each fitted on its own corpus as `plait data retrieve` does.

The scoring (plait.lifecycle.qa, as `plait eval --qa` scores): each question's prompt is left-padded with
end-of-document tokens to a whole number of chunks, so
that the chunk which ends at the prompt's last token is the question and names the person: generation retrieves
a chunk's neighbours once it is complete, and they serve the tokens after it, so the answer sees the
neighbours of the question (plait.data.retrieval.Retriever with the database's own encoder, as `plait generate
--database` does). One forward of prompt and answer (the answer shorter than a chunk, so all its tokens see the
question's neighbours and nothing else: as in generation) gives the answer tokens' mean loss and the greedy
exact match: greedy decoding starts with the answer's tokens exactly when the argmax at every answer position
is the answer's token. Per split, for the retrieval model with the database and with the swapped database
(the rate that follows the new facts and the rate that repeats the old ones), and for the plain model (the same
padded prompts, no neighbours: it can only remember or guess).

Printed per run: the rates, each retrieval model's |tanh gate| per retrieval block and its copy shares; at the
end a table with each model's ratio to the plain model. Written after every run: bench/results/knowledge.json
(every run, the means and spreads, the machine; the first slice's record under "slice1"); at the end
knowledge.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import facts  # bench/facts.py
from retrieval_quality import windows_every  # bench/: a plain run reads the windows a retrieval run reads

RETRO = "model.retrieval_layers=2,3;model.retrieval_encoder_layers=1;model.retrieval_copy=true"
SPLITS = ("qa", "trained", "read", "database_only")
CONTROLS = ("retrieval_open_no_copy", "pointer_no_copy")
"""Variants trained for the first seed only."""


def variants(retro: list[str], gate_start: float) -> dict[str, tuple[list[str], float | None]]:
    """Each model of the bench: its settings and where its gates start (None: plait's start, shut)."""
    return {
        "plain": ([], None),
        "retrieval": (retro, None),
        "retrieval_open": (retro, gate_start),
        "retrieval_open_no_copy": ([*retro, "model.retrieval_copy=false"], gate_start),
        "pointer": ([*retro, "model.retrieval_pointer=true"], None),
        "pointer_no_copy": ([*retro, "model.retrieval_copy=false", "model.retrieval_pointer=true"], None),
        "pointer_learned": (
            [
                *retro,
                "model.retrieval_pointer=true",
                "model.retrieval_learned=true",
                f"model.retrieval_refresh_steps={REFRESH_STEPS}",
            ],
            None,
        ),
    }


REFRESH_STEPS = 50
"""pointer_learned: the learned retriever's index is rebuilt every this many steps (12 times in 600)."""

HELD_OUT = 0.002
"""The databases' held-out share: as small as prepare allows while the split is not empty (a database built over
an empty validation split fails in plait.data.retrieval_build._embed today). The few held-out biographies
are missing from the database; each of their people has three others."""


def qa_document(questions: list[dict]) -> str:
    """One person's four questions with their answers, a line each, in the held-out phrasing."""
    return "\n".join(q["prompt"] + q["answer"] for q in questions)


TRAIN_VAL = 0.05
"""The training directory's held-out share (of the training text and of the database appended to it)."""


def make_data(work: Path, people: int, chunk: int, k: int) -> tuple[dict[str, Path], list[dict], int]:
    """The prepared directories (train, database, swapped) with their lexical databases, the questions, each
    with its split (qa, trained, read, database_only), and the training text's length in tokens: the training
    directory's train stream is the training text followed by the database (everyone's biographies), so that
    its retrieval database, built over the whole stream, holds every biography, and training reads windows of
    the training text only (windows_before)."""
    from plait.data.prepare import prepare
    from plait.data.retrieval import build_database
    from plait.lifecycle.retrieval import encoder_for

    files = facts.generate(people, 0.5, 4, 0)
    raw = work / "facts"
    raw.mkdir(parents=True)
    for name, text in files.items():
        (raw / name).write_text(text, encoding="utf-8")
    questions = [json.loads(line) for line in files["questions.jsonl"].splitlines()]
    qa_people = set(sorted({q["person"] for q in questions if q["split"] == "trained"})[::2])
    read_people = set(sorted({q["person"] for q in questions if q["split"] == "database_only"})[::2])
    for q in questions:
        q["split"] = "qa" if q["person"] in qa_people else "read" if q["person"] in read_people else q["split"]
    by_person: dict[str, list[dict]] = {}
    for q in questions:
        by_person.setdefault(q["person"], []).append(q)
    docs = [json.loads(line)["text"] for line in files["train.jsonl"].splitlines()]
    docs += [qa_document(by_person[p]) for p in sorted(qa_people | read_people)]
    random.Random(0).shuffle(docs)
    docs += [json.loads(line)["text"] for line in files["database.jsonl"].splitlines()]
    (raw / "train_qa.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    dirs = {"train": work / "train", "database": work / "database", "swapped": work / "swapped"}
    prepare([raw / "train_qa.jsonl"], dirs["train"], vocab_size=2048, val_fraction=TRAIN_VAL)
    text_tokens = training_text_tokens(dirs["train"], docs, len(docs) - len(files["database.jsonl"].splitlines()))
    tokenizer = dirs["train"] / "tokenizer.json"
    prepare([raw / "database.jsonl"], dirs["database"], tokenizer=tokenizer, val_fraction=HELD_OUT)
    prepare([raw / "database_swapped.jsonl"], dirs["swapped"], tokenizer=tokenizer, val_fraction=HELD_OUT)
    for d in dirs.values():
        encode, described = encoder_for("lexical", d, chunk)
        build_database(d, encode, encoder=described, chunk=chunk, k=k)
    return dirs, questions, text_tokens


def training_text_tokens(train_dir: Path, docs: list[str], text_docs: int) -> int:
    """Where the training text ends in the train stream: after its documents that prepare kept for train
    (each ends with an end-of-document token); the rest of the stream is the database's biographies."""
    from plait.data.encoding import is_held_out
    from plait.data.loader import TokenDataset

    kept = [not is_held_out(i, d, TRAIN_VAL) for i, d in enumerate(docs)]
    stream = TokenDataset(train_dir, "train")
    assert stream.num_documents == sum(kept), (stream.num_documents, sum(kept))
    import numpy as np

    ends = np.flatnonzero(stream.tokens(0, stream.num_tokens) == stream.eos_id)
    return int(ends[sum(kept[:text_docs]) - 1]) + 1


@contextlib.contextmanager
def windows_before(train_dir: Path, end: int):
    """While active, the training directory's train split offers only the windows that end before token `end`
    (the training text); the database after it is read as neighbours only, never trained on."""
    from plait.data.loader import TokenDataset

    original = TokenDataset.num_samples

    def num_samples(self, seq_len: int) -> int:
        found = original(self, seq_len)
        if self.split != "train" or self.data_dir.resolve() != train_dir.resolve():
            return found
        return min(found, max(0, (end - seq_len - 1) // self.stride(seq_len) + 1))

    TokenDataset.num_samples = num_samples  # type: ignore[method-assign]
    try:
        yield
    finally:
        TokenDataset.num_samples = original  # type: ignore[method-assign]


def train_run(data: Path, end: int, out: Path, name: str, a: argparse.Namespace, seed: int, variant) -> float:
    """Train one model (preset tiny, seq_len 128) and return its wall time; a plain run (no
    model.retrieval_layers in `extra`) reads the windows a retrieval run of this chunk reads; both read
    windows of the training text only (the stream's first `end` tokens)."""
    from plait.api import train
    from plait.config import load_config

    extra, gate_start = variant
    cfg = [f"data.source={data}", f"train.steps={a.steps}", f"train.global_batch_size={a.batch}",
           f"run.seed={seed}", "data.seq_len=128", "model.vocab_size=2048", f"optim.lr={a.lr}",
           f"optim.warmup_steps={a.steps // 10}", f"eval.every_steps={a.steps}", "eval.num_batches=4",
           "sample.max_new_tokens=0", "log.tensorboard=false", "log.every_steps=50", f"run.out_dir={out}",
           f"run.name={name}", *extra]  # fmt: skip
    started = time.perf_counter()
    retrieves = any(c.startswith("model.retrieval_layers=") for c in extra)
    with (
        contextlib.nullcontext() if retrieves else windows_every(a.chunk),
        gates_start_at(gate_start),
        windows_before(data, end),
    ):
        train(load_config(None, cfg))
    return time.perf_counter() - started


@contextlib.contextmanager
def gates_start_at(value: float | None):
    """While active (value not None), a new retrieval model's cross-attention gates start at tanh(w) = value
    instead of 0 (plait's Flamingo start): the control for a gate that never opens because it starts shut."""
    from plait.model.llama import Transformer

    if value is None:
        yield
        return
    original = Transformer.init_weights

    def init_weights(self, *args, **kw):
        original(self, *args, **kw)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("cross.gate.weight"):
                    param.fill_(math.atanh(value))

    import math

    import torch

    Transformer.init_weights = init_weights  # type: ignore[method-assign]
    try:
        yield
    finally:
        Transformer.init_weights = original  # type: ignore[method-assign]


def encode_questions(questions: list[dict], key: str) -> list:
    """The facts' questions as plait.lifecycle.qa's Questions (each with the split the bench gave it), answered
    by `key`: "answer" (the fact) or "swapped_answer" (the swapped database's)."""
    from plait.lifecycle.qa import Question

    return [Question(q["prompt"], q[key], q["split"], i + 1, "questions.jsonl") for i, q in enumerate(questions)]


def answer_scores(model, tok, eos: int, questions: list, retrieve, chunk: int) -> list[tuple[float, bool]]:
    """Per question (answer tokens' mean loss, greedy exact match) by plait.lifecycle.qa.score_questions, the
    method of `plait eval --qa`: teacher-forced, one forward of prompt + answer with the neighbours of the
    prompt's chunks; every model's prompts left-padded to whole chunks, the plain model's too (the same text, no
    neighbours). An answer of a chunk or more is refused naming its question."""
    from plait.lifecycle.qa import score_questions

    return score_questions(model, tok, eos, questions, retrieve, pad_to=0 if retrieve is not None else chunk)


def gates(model) -> dict:
    """|tanh gate| per retrieval block and the copy's shares (w_u, w_b), if any."""
    found = {
        name.split(".")[1]: round(abs(float(m.weight.detach().tanh()[0])), 5)
        for name, m in model.named_modules()
        if type(m).__name__ == "RetrievalGate"
    }
    copy, pointer = getattr(model, "neighbour_copy", None), getattr(model, "neighbour_pointer", None)
    found = {"gates": found}
    if copy is not None:
        found["copy_shares"] = [round(float(v), 4) for v in copy.shares().detach()]
    if pointer is not None:
        found["pointer_share"] = round(float(pointer.weight.detach().clamp(0, 0.9)), 4)
    return found


def score_run(run_dir: Path, dirs: dict[str, Path], questions: list[dict], chunk: int) -> dict:
    """A trained run's rates and losses per split: with the database and, for a retrieval model, the swapped one."""
    from plait.engine.generate import load_for_generation
    from plait.lifecycle.retrieval import checkpoint_retriever

    model, tok, eos = load_for_generation(run_dir, device="cpu")
    facts_asked, swapped_asked = encode_questions(questions, "answer"), encode_questions(questions, "swapped_answer")
    retrieval = bool(model.args.retrieval_ids)
    result: dict = gates(model) if retrieval else {}
    for db in ("database", "swapped") if retrieval else ("database",):
        retrieve = checkpoint_retriever(run_dir, model, data=dirs[db]) if retrieval else None
        old = answer_scores(model, tok, eos, facts_asked, retrieve, chunk)
        new = answer_scores(model, tok, eos, swapped_asked, retrieve, chunk)
        for split in SPLITS:
            idx = [i for i, q in enumerate(questions) if q["split"] == split]
            result.setdefault(db, {})[split] = {
                "questions": len(idx),
                "exact_old": statistics.fmean(old[i][1] for i in idx),
                "exact_new": statistics.fmean(new[i][1] for i in idx),
                "loss_old": statistics.fmean(old[i][0] for i in idx),
                "loss_new": statistics.fmean(new[i][0] for i in idx),
            }
    return result


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    import os

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}  # fmt: skip


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Mean and sample spread over seeds of every rate and loss, per model, database and split."""
    out: dict = {}
    for model, seeds in runs.items():
        for db in ("database", "swapped"):
            if db not in seeds[0]:
                continue
            for split in SPLITS:
                for key in ("exact_old", "exact_new", "loss_old", "loss_new"):
                    vals = [s[db][split][key] for s in seeds]
                    spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
                    out.setdefault(model, {}).setdefault(db, {}).setdefault(split, {})[key] = [
                        round(statistics.fmean(vals), 4),
                        round(spread, 4),
                    ]
    return out


def print_table(summary: dict) -> None:
    """Per model and split: exact-match rate (mean over seeds) with the ratio to the plain model's, the answer
    tokens' loss, and with the swapped database the rates and the answer losses of the new and the old facts (the
    plain model's: the same forward, it reads no database)."""
    print(f"{'model':<24} {'split':<14} {'EM':>6} {'x plain':>8} {'loss':>6} {'swap: new':>9} {'swap: old':>9} "
          f"{'loss new':>8} {'loss old':>8}")  # fmt: skip
    plain = summary["plain"]["database"]
    for model, found in summary.items():
        for split in SPLITS:
            em, base = found["database"][split]["exact_old"][0], plain[split]["exact_old"][0]
            ratio = f"{em / base:8.2f}" if base else f"{'-':>8}"
            swap = found.get("swapped", found["database"])[split]
            print(f"{model:<24} {split:<14} {em:6.3f} {ratio} {found['database'][split]['loss_old'][0]:6.3f} "
                  f"{swap['exact_new'][0]:9.3f} {swap['exact_old'][0]:9.3f} {swap['loss_new'][0]:8.3f} "
                  f"{swap['loss_old'][0]:8.3f}")  # fmt: skip


def plot(summary: dict, path: Path) -> None:
    """Exact-match rate per split: each model with its database, and each retrieval model with the swapped one
    (the new facts' rate solid, the old facts' hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, "database", "exact_old", m) for m in summary]
    for m in summary:
        if "swapped" in summary[m]:
            bars += [(m, "swapped", "exact_new", f"{m}, swapped db: new fact"),
                     (m, "swapped", "exact_old", f"{m}, swapped db: old fact")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(14, 4.5))
    width = 0.85 / len(bars)
    for j, (model, db, key, label) in enumerate(bars):
        vals = [summary[model][db][s][key] for s in SPLITS]
        ax.bar([i + j * width for i in range(len(SPLITS))], [v[0] for v in vals], width, yerr=[v[1] for v in vals],
               label=label, hatch="//" if key == "exact_old" and db == "swapped" else None)  # fmt: skip
    ax.set_xticks([i + 0.425 - width / 2 for i in range(len(SPLITS))],
                  ["trained, QA trained", "trained", "database, QA trained (read)", "database only"])  # fmt: skip
    ax.set_ylabel("greedy exact match")
    ax.set_title("Facts of fictional people: answers with and without retrieval (mean, sd over seeds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--people", type=int, default=400)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8, help="train.global_batch_size (windows of 128 tokens)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--retro", default=RETRO, help="the retrieval runs' settings, ';'-separated")
    p.add_argument("--gate-start", type=float, default=0.5, help="the *_open runs' gates start at this tanh(w)")
    p.add_argument("--models", default="plain,retrieval_open,retrieval",
                   help="which to train, in this order per seed, of plain, retrieval, retrieval_open and "
                        "retrieval_open_no_copy (the last for the first seed only)")  # fmt: skip
    p.add_argument("--json", default="bench/results/knowledge.json")
    p.add_argument("--report", action="store_true", help="print the table and plot of --json again, train nothing")
    a = p.parse_args()
    if a.report:
        summary = json.loads(Path(a.json).read_text())["summary"]
        if "plain" in summary:
            print_table(summary)
        plot(summary, Path(a.json).with_suffix(".png"))
        return 0
    seeds = [int(s) for s in a.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="plait-knowledge-"))
    started = time.perf_counter()
    dirs, questions, text_tokens = make_data(work, a.people, a.chunk, a.k)
    print(f"data ready in {time.perf_counter() - started:.0f} s ({work}); training text: {text_tokens} tokens",
          flush=True)  # fmt: skip
    retro = [*a.retro.split(";"), f"model.retrieval_chunk={a.chunk}", f"model.retrieval_k={a.k}"]
    table = variants(retro, a.gate_start)
    models = {m: table[m] for m in a.models.split(",")}
    earlier = previous_slices(Path(a.json))
    runs: dict[str, list[dict]] = {}
    for seed in seeds:
        for model, variant in models.items():
            if model in CONTROLS and seed != seeds[0]:
                continue
            name = f"{model}-{seed}"
            seconds = train_run(dirs["train"], text_tokens, work / "runs", name, a, seed, variant)
            result = score_run(work / "runs" / name, dirs, questions, a.chunk)
            runs.setdefault(model, []).append({"seed": seed, "train_seconds": round(seconds, 1), **result})
            print_run(seed, model, result, seconds)
            # written after every run: a bench cut short keeps what finished
            record = {"settings": {k: v for k, v in vars(a).items() if k != "json"}, "retrieval_settings": retro,
                      "machine": machine(), "seeds": seeds, "training_text_tokens": text_tokens,
                      "summary": summarise(runs), "runs": runs, "work_dir": str(work),
                      "seconds": round(time.perf_counter() - started), **earlier}  # fmt: skip
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(record, indent=2) + "\n")
    summary = summarise(runs)
    if "plain" in summary:
        print_table(summary)
    if summary:
        plot(summary, Path(a.json).with_suffix(".png"))
    return 0


def previous_slices(path: Path) -> dict:
    """The earlier slices' records kept in the JSON: the first slice (three splits, the database only in the
    database) under "slice1", the second (four splits, no pointer) under "slice2"; this one's at the top."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    kept = {key: old[key] for key in ("slice1", "slice2") if key in old}
    if "summary" in old and "slice1" in old and "slice2" not in old and "pointer" not in old["summary"]:
        kept["slice2"] = {key: value for key, value in old.items() if key != "slice1"}
    elif "summary" in old and "slice1" not in old:
        kept["slice1"] = old
    return kept


def print_run(seed: int, model: str, result: dict, seconds: float) -> None:
    """One run's line: exact match per split, the swapped database's new and old rates (read, database only),
    the gates and copy shares."""
    db = result["database"]
    line = f"seed {seed} {model}: exact match " + ", ".join(f"{s} {db[s]['exact_old']:.3f}" for s in SPLITS)
    if "swapped" in result:
        sw = result["swapped"]
        line += "; swapped db new/old: " + ", ".join(
            f"{s} {sw[s]['exact_new']:.3f}/{sw[s]['exact_old']:.3f}" for s in ("read", "database_only")
        )
        line += f"; |tanh gate| {result['gates']}, copy {result.get('copy_shares')}"
    print(line + f"; {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
