"""Questions scored on a model (`plait eval MODEL --qa FILE`): per question, the answer tokens' mean loss and
whether greedy decoding starts with the answer, and per split their rates and means.

The file is JSONL, one question per line: {"prompt": "Q: Where was Ada born? A:", "answer": " Kestrelford",
"split": "trained"}; "split" is optional, the answer may sit under another field (`answer_field`, e.g.
"swapped_answer"), other fields are ignored. `read_questions` checks every line before anything is scored.

The method (as bench/knowledge.py measured it first): one teacher-forced forward of prompt + answer. The answer
is the greedy continuation exactly when the argmax at every answer position is the answer's token, so the
exact match needs no decoding loop. A retrieval model's prompt is left-padded with end-of-document tokens to a
whole number of chunks, so that the chunk ending at the prompt's last token is the question: generation
retrieves a chunk's neighbours once it is complete and they serve the tokens after it, so every answer token
(the answer shorter than a chunk) sees the neighbours of the question, as it would when generated."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.core.errors import ConfigError

MAX_BYTES = 64 << 20
"""The largest questions file read: 100,000 questions of a few hundred characters fit many times over."""

FORMAT = 'one JSON object per line, {"prompt": "...", "answer": "..."} and optionally "split"'


class QAError(ConfigError):
    """A questions file that cannot be scored: the message names the file (and line) and what to fix."""


@dataclass(frozen=True)
class Question:
    """One question: its prompt, the answer scored after it, its split ("" where the line gives none), and
    where it was read (file and 1-based line), which every later refusal of it names."""

    prompt: str
    answer: str
    split: str
    line: int
    file: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def read_questions(path: str | Path, answer_field: str = "answer", limit: int = 100_000) -> list[Question]:
    """The questions of a JSONL file, every line checked (QAError naming FILE:LINE and the field): blank lines
    skipped; at least one question and at most `limit`; the file at most MAX_BYTES, checked before reading."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QAError(f"questions file {path} does not exist: give a JSONL file, {FORMAT}")
    if not path.is_file():
        raise QAError(f"questions file {path} is not a file: give a JSONL file, {FORMAT}")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise QAError(f"questions file {path} is {size / 2**20:.1f} MiB, over the {MAX_BYTES >> 20} MiB read: split it")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # strict; a leading byte-order mark (some editors write one) is dropped
    except UnicodeDecodeError as e:
        bad = raw[: e.start].count(b"\n") + 1
        raise QAError(f"{path}:{bad} is not UTF-8 (byte {e.start}): save the file as UTF-8") from None
    questions: list[Question] = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: a JSON string may hold U+2028
        if not line.strip():
            continue
        if len(questions) == limit:
            raise QAError(f"{path} holds more than {limit:,} questions: score at most {limit:,} at a time")
        questions.append(_parse_line(line, f"{path}:{number}", answer_field, number, str(path)))
    if not questions:
        raise QAError(f"{path} holds no questions: write {FORMAT}")
    return questions


def _parse_line(line: str, where: str, answer_field: str, number: int, file: str) -> Question:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise QAError(f"{where} is not JSON ({e.msg}, column {e.colno}): write {FORMAT}") from None
    except (ValueError, RecursionError) as e:  # an integer of too many digits, nesting too deep
        raise QAError(f"{where} cannot be read as JSON ({type(e).__name__}): write {FORMAT}") from None
    if not isinstance(row, dict):
        raise QAError(f"{where} is a JSON {_json_type(row)}, not an object: write {FORMAT}")
    prompt = _text(row, "prompt", where, "each line needs its question")
    answer = _text(row, answer_field, where, "each line needs the answer scored (the answer field)")
    split = row.get("split", "")
    if not isinstance(split, str):
        raise QAError(f'{where}: "split" is a JSON {_json_type(split)}, not a string: name the split, e.g. "trained"')
    if split == "all":
        raise QAError(f'{where}: "split" is "all", the name of the total over every split: choose another name')
    return Question(prompt, answer, split, number, file)


def _text(row: dict, key: str, where: str, why: str) -> str:
    if key not in row:
        raise QAError(f'{where}: no "{key}" field: {why}')
    value = row[key]
    if not isinstance(value, str):
        raise QAError(f'{where}: "{key}" is a JSON {_json_type(value)}, not a string: {why}, as text')
    if not value:
        raise QAError(f'{where}: "{key}" is empty: {why}, as text')
    return value


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def encode_questions(tok, questions: list[Question], eos: int | None, chunk: int, max_seq_len: int):
    """Per question (prompt ids, answer ids): where `chunk` (a retrieval model's chunk size) the prompt
    left-padded with `eos` to a whole number of chunks, so that its last chunk ends at its last token (the module
    docstring says why), and the answer refused unless shorter than a chunk; refused too where the forward would
    be longer than `max_seq_len` (prompt + answer, right-padded to whole chunks where `chunk`)."""
    rows = []
    for q in questions:
        prompt = tok.encode(q.prompt).ids
        answer = tok.encode(q.answer, add_special_tokens=False).ids
        if not prompt or not answer:
            empty = "prompt" if not prompt else "answer"
            raise QAError(f"{q.where}: the {empty} encodes to no tokens: give text the tokenizer reads")
        if chunk:
            if len(answer) >= chunk:
                raise QAError(
                    f"{q.where}: the answer's {len(answer)} tokens are not fewer than a chunk: a retrieval model's "
                    f"answer must fit in one chunk (model.retrieval_chunk={chunk}); shorten the answer"
                )
            assert eos is not None, "a retrieval model's prompt is padded with the end-of-document token"
            prompt = [eos] * (-len(prompt) % chunk) + prompt
        width = len(prompt) + len(answer)
        width = -(-width // chunk) * chunk if chunk else width
        if width > max_seq_len:
            raise QAError(
                f"{q.where}: the prompt and answer take {width} tokens, more than the model reads "
                f"(model.max_seq_len={max_seq_len}); shorten the prompt"
            )
        rows.append((prompt, answer))
    return rows


def score_questions(
    model, tok, eos: int | None, questions: list[Question], retrieve=None, batch: int = 64, pad_to: int = 0
):
    """Per question (the answer tokens' mean loss in nats, greedy exact match), by one teacher-forced forward
    of prompt + answer in batches of `batch`; a retrieval model (model.args.retrieval_ids) needs `retrieve`
    (plait.data.retrieval.Retriever: the prompt's complete chunks' neighbours) and `eos` (its padding).
    `pad_to` pads a plain model's prompts as a retrieval model's of that chunk size (bench/knowledge.py compares
    the two on the same text); a retrieval model's are padded to its own chunk."""
    args = model.args
    if args.retrieval_ids and retrieve is None:
        raise ConfigError("a retrieval model answers with neighbours from a database: pass retrieve=Retriever(...)")
    if not args.retrieval_ids and retrieve is not None:
        raise ConfigError("this model retrieves nothing (no model.retrieval_layers): pass retrieve=None")
    if args.retrieval_ids and pad_to not in (0, args.retrieval_chunk):
        raise ConfigError(f"pad_to={pad_to}: a retrieval model's prompts end on its chunks of {args.retrieval_chunk}")
    chunk = args.retrieval_chunk if args.retrieval_ids else pad_to
    rows = encode_questions(tok, questions, eos, chunk, args.max_seq_len)
    out: list[tuple[float, bool]] = []
    for start in range(0, len(rows), batch):
        out += _score_batch(model, rows[start : start + batch], retrieve, chunk)
    return out


def _score_batch(model, part, retrieve, chunk: int) -> list[tuple[float, bool]]:
    """One forward of a batch of (prompt, answer) rows, each right-padded (with 0: after its answer, nothing
    it is scored on reads it) to the batch's width (whole chunks where `chunk`), with its prompt's chunks'
    neighbours where `retrieve`."""
    import numpy as np
    import torch

    device = next(model.parameters()).device
    width = max(len(p) + len(a) for p, a in part)
    width = -(-width // chunk) * chunk if chunk else width
    tokens = torch.zeros(len(part), width, dtype=torch.long)  # (B, T)
    for i, (prompt, answer) in enumerate(part):
        tokens[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
    inputs = tokens
    if retrieve is not None:  # each row's complete chunks are its prompt's; the answer's chunk and padding get none
        found = np.zeros((len(part), width // chunk, model.args.retrieval_k, 2 * chunk), dtype=np.int64)
        complete = [len(prompt) // chunk for prompt, _ in part]  # the whole prompt: padded to whole chunks
        chunks = np.concatenate([np.array(prompt).reshape(-1, chunk) for prompt, _ in part])  # (sum complete, c)
        neighbours = retrieve(chunks)[1]  # (sum complete, k, 2c): one search for the batch
        at = 0
        for i, n in enumerate(complete):
            found[i, :n] = neighbours[at : at + n]
            at += n
        inputs = torch.cat([tokens, torch.from_numpy(found).reshape(len(part), -1)], 1)  # (B, T + T/c k 2c)
    with torch.no_grad():
        # a plain model's logits, a retrieval model's mixed log-probabilities: log_softmax leaves those as they are
        logp = torch.log_softmax(model(inputs.to(device)).float(), -1).cpu()  # (B, T, vocab)
    scores = []
    for i, (prompt, answer) in enumerate(part):
        p, ans = len(prompt), torch.tensor(answer)
        at_answer = logp[i, p - 1 : p - 1 + len(answer)]  # the predictions of the answer's tokens
        loss = float(-at_answer.gather(1, ans[:, None]).mean())
        scores.append((loss, bool((at_answer.argmax(-1) == ans).all())))
    return scores


def qa_report(questions: list[Question], scores: list[tuple[float, bool]]) -> dict[str, dict[str, Any]]:
    """Per split (sorted; questions without one count in "all" only) and "all": n, correct, exact_match (the
    rate) and answer_loss (the mean of the questions' mean answer-token losses, nats)."""
    groups: dict[str, list[tuple[float, bool]]] = {}
    for q, s in zip(questions, scores, strict=True):
        if q.split:
            groups.setdefault(q.split, []).append(s)
    groups = {name: groups[name] for name in sorted(groups)}
    groups["all"] = list(scores)
    return {
        name: {
            "n": len(found),
            "correct": sum(hit for _, hit in found),
            "exact_match": sum(hit for _, hit in found) / len(found),
            "answer_loss": statistics.fmean(loss for loss, _ in found),
        }
        for name, found in groups.items()
    }
