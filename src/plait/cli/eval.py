"""`plait eval MODEL [--suite suite.yaml] [--qa questions.jsonl] [--data DIR] [--json OUT]`: perplexity, a
behavioural suite and questions' exact match."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

from plait.cli.args import PlaitParser, check_input
from plait.cli.lifecycle import console, data_dir_of, open_registry_near, registry_arg
from plait.core.errors import ConfigError, PlaitError

EVAL_EPILOG = """suite format (YAML): a 'tests' list; each test has a name, a prompt (or 'prompts': paraphrases),
optionally a 'text' to score, and 'expect': assertions among contains, not_contains, regex, not_regex, exact,
max_length (characters), max_perplexity (of 'text'), equivalent (paraphrases agree). Greedy decoding unless
'temperature' is set.

questions format (JSONL, --qa): one object per line with "prompt", the answer (--answer-field, default "answer")
and optionally "split"; scored per split as greedy exact match and the answer tokens' loss.

Exit status: 0 all passed, 1 some failed, 2 usage error."""


def _parser() -> PlaitParser:
    parser = PlaitParser(
        prog="plait eval",
        description="Perplexity on held-out data and a behavioural test suite.",
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="Checkpoint / run / Hugging Face directory, adapter file or quantized dir.")
    parser.add_argument("--suite", help="A behavioural test suite (YAML).")
    parser.add_argument(
        "--qa",
        metavar="FILE",
        help="Questions (JSONL): per split, the rate at which greedy decoding starts with the answer and the answer "
        "tokens' mean loss.",
    )
    parser.add_argument(
        "--answer-field",
        metavar="NAME",
        help='--qa: the field holding the answer scored (default "answer"; e.g. "swapped_answer").',
    )
    parser.add_argument(
        "--database",
        metavar="DIR",
        help="--qa with a retrieval model: the prepared directory whose database it retrieves from (or its "
        "retrieval/ folder), any built with the model's encoder, tokenizer and chunk size (default: the one it "
        "trained on).",
    )
    parser.add_argument("--data", help="A prepared data directory for perplexity; default: the model's training data.")
    parser.add_argument("--split", default="val", help="Split to measure perplexity on.")
    parser.add_argument(
        "--seq-len", type=int, help="Tokens per sequence for perplexity; default: the run's data.seq_len (else 256)."
    )
    parser.add_argument(
        "--batches",
        type=int,
        help="Batches for perplexity; default: the run's eval.num_batches of its global batch size (so the loss "
        "is the run's validation loss), else 8 of 4 sequences.",
    )
    parser.add_argument("--no-perplexity", action="store_true", help="Run only the suite (and --lm-eval).")
    parser.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,arc_easy): scored on this model. "
        "plait-shakespeare-mc is plait's own and runs offline; a Hub task needs its dataset cached or the network.",
    )
    parser.add_argument(
        "--lm-eval-include",
        metavar="DIR",
        help="A directory of task YAMLs of your own. Its Python runs: a YAML's '!function module.name' entries "
        "import and execute DIR's .py files, so include only a directory you trust.",
    )
    parser.add_argument("--limit", type=int, help="--lm-eval: at most this many examples per task.")
    parser.add_argument("--num-fewshot", type=int, help="--lm-eval: few-shot examples (default: each task's).")
    parser.add_argument("--base", help="For an adapter: its base model (default: the path the adapter records).")
    parser.add_argument("--json", help="Write the full report (results, completions, perplexity) here.")
    parser.add_argument("--device", default="cpu")
    registry_arg(parser)
    return parser


def cmd_eval(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    _check_args(a)
    from plait.cli.views_reports import print_report
    from plait.core.progress import phase
    from plait.lifecycle.evaluate import Report, load_suite
    from plait.lifecycle.models import describe, load_model
    from plait.lifecycle.qa import read_questions

    if a.lm_eval:
        from plait.lifecycle.harness import _harness

        _harness()  # installed, before the model loads
    suite = load_suite(a.suite) if a.suite else None  # check the suite and the questions before loading a model
    questions = read_questions(a.qa, a.answer_field or "answer") if a.qa else None
    with phase(f"loading {a.model}"):
        loaded = load_model(a.model, device=a.device, base=a.base)
    console.print(describe(loaded), highlight=False)
    report = Report(suite.name if suite else "", model=str(loaded.path))
    data_dir = None if a.no_perplexity else data_dir_of(a.data, loaded.config, loaded.model.args.vocab_size)
    if data_dir is not None:
        report.perplexity = _perplexity(a, loaded, data_dir)
    if suite is not None:
        report.results, report.completions = _run_suite(a, loaded, suite)
    if a.lm_eval:
        with phase(f"lm-eval {a.lm_eval}"):
            report.lm_eval = _lm_eval(a, loaded)
    qa = _qa(a, loaded, questions) if questions else {}
    print_report(report, console)
    for split, found in qa.items():
        console.print(
            f"qa {split}: exact match {found['exact_match']:.3f} ({found['correct']}/{found['n']}), answer loss "
            f"{found['answer_loss']:.3f} nats/token",
            highlight=False,
        )
    payload = {**report.to_dict(), **({"qa": qa} if qa else {})}
    if a.json:
        Path(a.json).write_text(json.dumps(payload, indent=2) + "\n")
    _record(a, loaded, report, suite, data_dir, payload)
    return 1 if report.failed else 0


def _check_args(a) -> None:
    """The arguments in range and the inputs there, all before torch loads."""
    if (a.batches is not None and a.batches < 1) or (a.seq_len is not None and a.seq_len < 2):
        raise ConfigError(f"need --batches >= 1 and --seq-len >= 2 (got {a.batches}, {a.seq_len})")
    if a.json and Path(a.json).is_dir():
        raise ConfigError(f"--json {a.json} is a directory; give a file path, e.g. {Path(a.json) / 'eval.json'}")
    _check_lm_eval_args(a)  # how the options go together, then where they point: all before torch
    check_input("", a.model, "a checkpoint, run, Hugging Face directory or adapter file")
    check_input("--suite", a.suite, "a suite file (YAML)")
    check_input("--data", a.data, "a prepared data directory")
    if (a.answer_field is not None or a.database) and not a.qa:
        raise ConfigError("--answer-field and --database apply to --qa FILE: give the questions")
    check_input("--qa", a.qa, "a questions file (JSONL, one object with prompt and answer per line)")
    check_input("--database", a.database, "a prepared directory with a retrieval database (plait data retrieve)")


def _perplexity(a, loaded, data_dir: Path) -> dict[str, float]:
    """Perplexity on `data_dir`, with the run's own validation setting where the model has one (then the loss
    is its validation loss), and the data beside the numbers."""
    from plait.core.progress import phase
    from plait.lifecycle.evaluate import perplexity

    run = loaded.config or {}
    seq_len = a.seq_len or run.get("data", {}).get("seq_len", 256)
    batch = run.get("train", {}).get("global_batch_size", 4) if a.batches is None else 4
    batches = a.batches or run.get("eval", {}).get("num_batches", 8)
    if loaded.model.args.retrieval_ids and loaded.kind == "checkpoint":  # a database built for this model
        from plait.lifecycle.retrieval import check_checkpoint_database

        check_checkpoint_database(loaded.path, loaded.model, data_dir)
    with phase(f"perplexity on {data_dir} ({a.split}, up to {batches} batches of {batch} x {seq_len})"):
        measured = perplexity(
            loaded.model, data_dir, split=a.split, seq_len=seq_len, batch_size=batch, max_batches=batches
        )
    cast(dict[str, Any], measured)["data"] = str(data_dir)  # the data beside the numbers
    return measured


def _run_suite(a, loaded, suite):
    """(results, completions) of the behavioural suite; refused for a model without a tokenizer."""
    from plait.core.progress import phase
    from plait.lifecycle.evaluate import run_suite

    if loaded.tokenizer is None:
        raise PlaitError(f"{loaded.path} has no tokenizer.json; the suite needs one to encode its prompts")
    from plait.data import load_tokenizer

    with phase(f"suite {suite.name or a.suite} ({len(suite.cases)} cases)"):
        ran = run_suite(loaded.model, load_tokenizer(loaded.tokenizer), suite)
    return ran.results, ran.completions


def _qa(a, loaded, questions) -> dict[str, dict[str, Any]]:
    """--qa: the questions scored (plait.lifecycle.qa), per split; a retrieval model reads --database or the
    database it trained with, as `plait generate` does."""
    from plait.core.progress import phase
    from plait.data import eos_id, load_tokenizer
    from plait.lifecycle.qa import qa_report, score_questions

    if loaded.tokenizer is None:
        raise PlaitError(f"{loaded.path} has no tokenizer.json; --qa needs one to encode its questions")
    tok = load_tokenizer(loaded.tokenizer)
    retrieve, eos = None, None
    if loaded.model.args.retrieval_ids:
        if loaded.kind != "checkpoint":
            raise ConfigError(
                f"{a.model} is a retrieval model loaded as {loaded.kind}: --qa finds its database through its "
                "checkpoint; give its run or checkpoint directory"
            )
        from plait.lifecycle.retrieval import checkpoint_retriever

        retrieve, eos = checkpoint_retriever(loaded.path, loaded.model, a.database or "", a.device), eos_id(tok)
    elif a.database:
        raise ConfigError(f"{a.model} retrieves nothing (no model.retrieval_layers): drop --database")
    with phase(f"qa {a.qa} ({len(questions)} questions)"):
        scores = score_questions(loaded.model, tok, eos, questions, retrieve)
    return qa_report(questions, scores)


def _record(a, loaded, report, suite, data_dir: Path | None, payload: dict[str, Any]) -> None:
    """The evaluation in the lineage registry that covers the model (or --registry), as a child of the model's
    artifact, with its numbers as metrics; nothing where there is no registry."""
    reg = open_registry_near(a.registry, loaded.path)
    if reg is None:
        return
    from plait.lifecycle.models import artifact_for

    target = artifact_for(reg, loaded)
    metrics: dict[str, Any] = {"passed": report.passed, "failed": report.failed}
    if report.perplexity:
        metrics.update(perplexity=report.perplexity["perplexity"], loss=report.perplexity["loss"])
    for task, values in report.lm_eval.items():
        metrics.update({f"{task}/{k}": v for k, v in values.items() if isinstance(v, (int, float))})
    for split, found in payload.get("qa", {}).items():
        metrics.update({f"qa/{split}/{key}": found[key] for key in ("exact_match", "answer_loss")})
    reg.record(
        "eval",
        name=suite.name if suite else "perplexity",
        parent=target.id,
        weights_hash=None,
        metrics=metrics,
        extra={"suite": a.suite, "qa": a.qa, "json": a.json, "data": str(data_dir) if data_dir else None},
        events=[(None, "eval", payload)],
    )


def _check_lm_eval_args(a) -> None:
    """--lm-eval's settings, before anything is imported: --limit and --num-fewshot in range and with tasks,
    and a warning that --lm-eval-include's Python runs."""
    if (a.lm_eval_include or a.limit is not None or a.num_fewshot is not None) and not a.lm_eval:
        raise ConfigError("--lm-eval-include, --limit and --num-fewshot apply to --lm-eval TASKS: give the tasks")
    if a.limit is not None and a.limit < 1:
        raise ConfigError(f"--limit={a.limit} must be at least 1 (examples per task), e.g. --limit 100")
    if a.num_fewshot is not None and a.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot={a.num_fewshot} must be 0 or more (examples shown before each question)")
    if a.lm_eval_include:
        if not Path(a.lm_eval_include).is_dir():
            raise ConfigError(f"--lm-eval-include {a.lm_eval_include} is not a directory of task YAMLs")
        print(f"warning: --lm-eval-include {a.lm_eval_include}: its tasks' !function entries run the Python files "
              "there", file=sys.stderr)  # fmt: skip


def _lm_eval(a, loaded) -> dict[str, dict[str, Any]]:
    """--lm-eval TASKS: the harness's scores of the loaded model, task -> metric -> value."""
    if loaded.tokenizer is None:
        raise PlaitError(f"{loaded.path} has no tokenizer.json; the harness's tasks are text")
    from plait.lifecycle.harness import run_lm_eval

    tasks = [t.strip() for t in a.lm_eval.split(",") if t.strip()]
    return run_lm_eval(
        loaded.model, loaded.tokenizer, tasks, include_path=a.lm_eval_include, limit=a.limit,
        num_fewshot=a.num_fewshot, device=a.device,
    )  # fmt: skip
