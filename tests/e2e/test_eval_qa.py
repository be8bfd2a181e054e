"""`plait eval MODEL --qa FILE` (plait.lifecycle.qa): questions scored as greedy exact match and the answer
tokens' loss, per split. A plain model's and a retrieval model's scores equal what greedy generation
(plait.engine.generate) gives question by question; a retrieval model's prompt is left-padded so its end is a
chunk's; every malformed questions file is refused naming its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bad_inputs import judge
from plait.cli import main

RETRO = ["model.retrieval_layers=1", "model.retrieval_chunk=8", "model.retrieval_k=2",
         "model.retrieval_encoder_layers=1", "model.retrieval_copy=true"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> dict:
    """A plain debug run (6 steps) and a retrieval one (4 steps) on speeches of the bundled text, whose lexical
    database (8-token chunks, k = 2) it reads; both with the session's tokenizer."""
    pytest.importorskip("faiss")
    from plait.api import train
    from plait.config import load_config
    from plait.data.retrieval import build_database
    from plait.lifecycle.retrieval import encoder_for
    from runs import bundled_speeches, debug_run, prepared_speeches

    root = tmp_path_factory.mktemp("qa")
    prepared_speeches(root, 800, Path(data_dir) / "tokenizer.json")
    speeches = bundled_speeches(800)
    encode, described = encoder_for("lexical", root / "data", 8)
    build_database(root / "data", encode, encoder=described, chunk=8, k=2)
    train(load_config(None, debug_run(root / "data", root, "plain", 6)))
    train(load_config(None, debug_run(root / "data", root, "retro", 4, *RETRO)))
    return {"plain": root / "plain", "retro": root / "retro", "data": root / "data", "speeches": speeches}


def greedy_questions(run: Path, speeches: list[str], path: Path, splits: list[str]) -> None:
    """A questions file: prompts cut from the speeches, each answered by the model's own greedy continuation of
    two tokens (right, unless re-encoding the text changes the tokens) or by a word it did not say (wrong)."""
    from plait.engine.generate import generate, load_for_generation
    from plait.lifecycle.retrieval import checkpoint_retriever

    model, tok, eos = load_for_generation(run, "cpu")
    retrieve = checkpoint_retriever(run, model) if model.args.retrieval_ids else None
    chunk = model.args.retrieval_chunk if retrieve is not None else 1
    rows = []
    for i, split in enumerate(splits):
        prompt = " ".join(speeches[10 + i].split()[:9])
        ids = tok.encode(prompt).ids
        padded = [eos] * (-len(ids) % chunk) + ids
        said = generate(model, [padded], max_new_tokens=2, temperature=0.0, retrieve=retrieve)[0][len(padded) :]
        answer = tok.decode(said) if i % 3 != 2 else " Zanzibar"
        rows.append({"prompt": prompt, "answer": answer or " the", "split": split, "person": f"p{i}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def hand_greedy(run: Path, questions) -> list[tuple[float, bool]]:
    """Question by question: the answer tokens' mean loss from a forward of prompt and answer, and whether
    greedy generation (plait.engine.generate, the model's own decoding) starts with the answer's tokens."""
    from plait.engine.generate import generate, load_for_generation
    from plait.lifecycle.qa import encode_questions
    from plait.lifecycle.retrieval import checkpoint_retriever

    model, tok, eos = load_for_generation(run, "cpu")
    retrieve = checkpoint_retriever(run, model) if model.args.retrieval_ids else None
    chunk = model.args.retrieval_chunk if retrieve is not None else 0
    found = []
    for prompt, answer in encode_questions(tok, questions, eos, chunk, model.args.max_seq_len):
        said = generate(model, [prompt], max_new_tokens=len(answer), temperature=0.0, retrieve=retrieve)[0]
        loss = float("nan")
        if retrieve is None:  # the retrieval model's loss is checked through the CLI's agreement with greedy
            with torch.no_grad():
                logits = model(torch.tensor([prompt + answer]))[0, len(prompt) - 1 : -1]
            loss = float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(answer)))
        found.append((loss, said[len(prompt) :] == answer))
    return found


def scored(run: Path, questions_file: Path, out: Path, *extra: str) -> dict:
    assert main(["eval", str(run), "--qa", str(questions_file), "--no-perplexity", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["qa"]


def test_a_plain_models_exact_match_is_its_greedy_answer(runs, tmp_path, capsys):
    from plait.lifecycle.qa import read_questions

    path = tmp_path / "q.jsonl"
    splits = ["trained", "trained", "trained", "held", "held", ""]
    greedy_questions(runs["plain"], runs["speeches"], path, splits)
    questions = read_questions(path)
    hand = hand_greedy(runs["plain"], questions)
    assert any(hit for _, hit in hand) and not all(hit for _, hit in hand), hand
    qa = scored(runs["plain"], path, tmp_path / "r.json")
    assert list(qa) == ["held", "trained", "all"]
    for split, idx in (("trained", [0, 1, 2]), ("held", [3, 4]), ("all", range(6))):
        assert qa[split]["n"] == len(idx)
        assert qa[split]["correct"] == sum(hand[i][1] for i in idx), (split, hand)
        assert qa[split]["exact_match"] == pytest.approx(qa[split]["correct"] / len(idx))
    assert qa["all"]["answer_loss"] == pytest.approx(sum(loss for loss, _ in hand) / 6, rel=1e-4)
    out = capsys.readouterr().out
    all_ = qa["all"]
    assert f"qa all: exact match {all_['exact_match']:.3f} ({all_['correct']}/6), answer loss" in out
    swapped = tmp_path / "swapped.jsonl"  # another answer field: the same prompts, every answer wrong
    swapped.write_text("".join(json.dumps({"prompt": q.prompt, "alt": " Zanzibar"}) + "\n" for q in questions))
    assert scored(runs["plain"], swapped, tmp_path / "s.json", "--answer-field", "alt")["all"]["correct"] == 0


def test_a_retrieval_models_prompt_ends_on_a_chunk_and_it_answers_as_it_generates(runs, tmp_path):
    from plait.data import eos_id, load_tokenizer
    from plait.lifecycle.qa import encode_questions, read_questions

    path = tmp_path / "q.jsonl"
    greedy_questions(runs["retro"], runs["speeches"], path, ["a", "a", "a", "b"])
    questions = read_questions(path)
    tok = load_tokenizer(runs["data"] / "tokenizer.json")
    eos = eos_id(tok)
    for q, (prompt, answer) in zip(questions, encode_questions(tok, questions, eos, 8, 512), strict=True):
        ids = tok.encode(q.prompt).ids
        assert len(prompt) % 8 == 0 and prompt[len(prompt) - len(ids) :] == ids  # the prompt's end: a chunk's
        assert set(prompt[: len(prompt) - len(ids)]) <= {eos} and len(prompt) - len(ids) < 8
        assert answer == tok.encode(q.answer, add_special_tokens=False).ids
    hand = hand_greedy(runs["retro"], questions)
    assert any(hit for _, hit in hand), hand  # the greedy answers re-encode to themselves in some questions
    given = scored(runs["retro"], path, tmp_path / "r.json", "--database", str(runs["data"] / "retrieval"))
    assert [given[s]["correct"] for s in ("a", "b")] == [sum(h for _, h in hand[:3]), int(hand[3][1])], hand
    assert given["all"]["n"] == 4
    assert scored(runs["retro"], path, tmp_path / "own.json") == given  # without --database: the one it trained on


def test_the_scoring_api_refuses_a_model_and_retriever_that_do_not_go_together(runs):
    from plait.core.errors import ConfigError
    from plait.engine.generate import load_for_generation
    from plait.lifecycle.qa import Question, score_questions

    questions = [Question("Q: Who? A:", " Ada", "", 1, "q.jsonl")]
    plain, tok, eos = load_for_generation(runs["plain"], "cpu")
    retro = load_for_generation(runs["retro"], "cpu")[0]
    for model, retrieve, pad_to, words in ((plain, len, 0, "retrieves nothing"), (retro, None, 0, "pass retrieve"),
                                           (retro, len, 4, "pad_to=4")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            score_questions(model, tok, eos, questions, retrieve, pad_to=pad_to)
    padded = score_questions(plain, tok, eos, questions, pad_to=8)  # the bench's plain model: padded as retro's
    assert len(padded) == 1 and padded[0] != score_questions(plain, tok, eos, questions)[0]


# --------------------------------------------------------------------------------------- malformed questions
def _lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


GOOD = {"prompt": "Q: Who? A:", "answer": " Ada"}
LONG = {"prompt": " ".join(["word"] * 600), "answer": " Ada"}
BAD_FILES = [  # (name, the file's bytes (None: no file; "dir": a directory), extra arguments, model, words)
    ("missing", None, [], "plain", "q.jsonl does not exist"),
    ("a directory", "dir", [], "plain", "q.jsonl is not a file"),
    ("not UTF-8", _lines(GOOD, b'{"prompt": "\xff\xfe", "answer": "x"}'), [], "plain", "q.jsonl:2 is not UTF-8"),
    ("not JSON", _lines(GOOD, b'{"prompt": "Q"'), [], "plain", "q.jsonl:2 is not JSON"),
    ("not an object", _lines([GOOD]), [], "plain", "q.jsonl:1 is a JSON array, not an object"),
    ("no prompt", _lines({"answer": "x"}), [], "plain", 'q.jsonl:1: no "prompt" field'),
    ("prompt a number", _lines({"prompt": 3, "answer": "x"}), [], "plain", '"prompt" is a JSON number'),
    ("prompt empty", _lines(GOOD, {"prompt": "", "answer": "x"}), [], "plain", 'q.jsonl:2: "prompt" is empty'),
    ("no answer", _lines({"prompt": "Q"}), [], "plain", 'q.jsonl:1: no "answer" field'),
    ("no such answer field", _lines(GOOD), ["--answer-field", "swapped_answer"], "plain", 'no "swapped_answer"'),
    ("answer null", _lines({"prompt": "Q", "answer": None}), [], "plain", '"answer" is a JSON null, not a string'),
    ("answer empty", _lines({"prompt": "Q", "answer": ""}), [], "plain", 'q.jsonl:1: "answer" is empty'),
    ("split a number", _lines({**GOOD, "split": 1}), [], "plain", '"split" is a JSON number, not a string'),
    ("split all", _lines({**GOOD, "split": "all"}), [], "plain", '"split" is "all"'),
    ("no questions", b"\n  \n\n", [], "plain", "q.jsonl holds no questions"),
    ("too many", _lines(*[GOOD] * 100_001), [], "plain", "holds more than 100,000 questions"),
    ("over 64 MiB", "huge", [], "plain", "over the 64 MiB read"),
    ("longer than the model reads", _lines(GOOD, LONG), [], "plain", "q.jsonl:2: the prompt and answer take"),
    ("--answer-field without --qa", "noqa", ["--answer-field", "x"], "plain", "apply to --qa FILE"),
    ("--database, a plain model", _lines(GOOD), ["--database", "DATA"], "plain", "retrieves nothing"),
    ("an answer of a chunk", _lines({"prompt": "Q", "answer": " a b c d e f g h i"}), [], "retro",
     "q.jsonl:1: the answer's 9 tokens are not fewer than a chunk: a retrieval model's answer must fit in one chunk "
     "(model.retrieval_chunk=8)"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_malformed_questions_file_is_refused_naming_its_line(case, runs, tmp_path, capsys):
    name, content, extra, model, words = case
    path = tmp_path / "q.jsonl"
    if content == "dir":
        path.mkdir()
    elif content == "huge":
        with path.open("wb") as f:  # sparse: the size is refused before a byte is read
            f.truncate(65 << 20)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    extra = [str(runs["data"]) if e == "DATA" else e for e in extra]
    argv = ["eval", str(runs[model]), "--no-perplexity", *([] if content == "noqa" else ["--qa", str(path)]), *extra]
    err = judge(name, argv, words, tmp_path, capsys, protected=runs[model])
    assert len([line for line in err.splitlines() if words.split(":")[0] in line]) == 1, err
