"""Evaluation: perplexity on held-out data and behavioural test suites.

A suite is YAML (or JSON)::

    name: smoke
    max_new_tokens: 32          # defaults for every test (greedy decoding unless temperature is set)
    tests:
      - name: speaks
        prompt: "ROMEO:"
        expect:
          - contains: "the"
          - not_contains: "<|endoftext|>"
          - regex: "^\\s*\\w"
          - max_length: 400     # characters of the completion
      - name: exact-answer
        prompt: "2 + 2 ="
        expect: [{exact: " 4"}]
      - name: fluent
        prompt: "ROMEO:"         # optional: the text is scored after this context
        text: " What light through yonder window breaks?"
        expect: [{max_perplexity: 200}]
      - name: paraphrases
        prompts: ["What is the capital of France?", "Name France's capital city."]
        expect: [{equivalent: true}, {contains: "Paris"}]

``equivalent`` asks that the completions of all paraphrases agree (after lower-casing and collapsing white
space; ``equivalent: {words: N}`` compares only the first N words). Other assertions apply to every
paraphrase's completion. The same suite runs as a training monitor (``eval.suite``) at every evaluation.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.errors import PlaitError

if TYPE_CHECKING:
    from plait.model.llama import ModelArgs, Transformer

ASSERTIONS = ("contains", "not_contains", "regex", "not_regex", "exact", "max_length", "max_perplexity", "equivalent")
TEST_KEYS = ("name", "prompt", "prompts", "text", "expect", "max_new_tokens", "temperature")
SUITE_KEYS = ("name", "tests", "max_new_tokens", "temperature", "description")


# --------------------------------------------------------------------------------------------------- suites


@dataclass
class Check:
    kind: str
    arg: Any


@dataclass
class Case:
    name: str
    prompts: list[str]
    text: str | None
    checks: list[Check]
    max_new_tokens: int
    temperature: float


@dataclass
class Suite:
    name: str
    cases: list[Case]
    source: str = ""


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file; every mistake is reported with the test's name and a valid alternative."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise PlaitError(f"suite {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PlaitError(f"suite {path} is not valid YAML: {e}") from None
    return parse_suite(data, str(path))


def parse_suite(data: Any, where: str = "suite") -> Suite:
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list) or not data["tests"]:
        raise PlaitError(f"{where}: expected a mapping with a non-empty 'tests' list")
    _unknown(data, SUITE_KEYS, where)
    cases, names = [], set()
    for i, raw in enumerate(data["tests"]):
        if not isinstance(raw, dict):
            raise PlaitError(f"{where}: test {i + 1} must be a mapping")
        name = str(raw.get("name") or f"test-{i + 1}")
        at = f"{where}: test {name!r}"
        if name in names:
            raise PlaitError(f"{at} appears twice; give each test its own name")
        names.add(name)
        _unknown(raw, TEST_KEYS, at)
        prompts = raw.get("prompts") or ([raw["prompt"]] if "prompt" in raw else [])
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
            raise PlaitError(f"{at}: 'prompt' must be a non-empty string, 'prompts' a list of them")
        text = raw.get("text")
        if text is not None and not isinstance(text, str):
            raise PlaitError(f"{at}: 'text' must be a string")
        expect = raw.get("expect", [])
        if isinstance(expect, dict):
            expect = [{k: v} for k, v in expect.items()]
        if not isinstance(expect, list) or not expect:
            raise PlaitError(f"{at}: 'expect' must list at least one assertion, e.g. - contains: \"word\"")
        checks = []
        for item in expect:
            if not isinstance(item, dict) or len(item) != 1:
                raise PlaitError(f"{at}: each assertion is one 'kind: value' pair, got {item!r}")
            ((kind, arg),) = item.items()
            checks.append(_check(kind, arg, at))
        kinds = {c.kind for c in checks}
        if "max_perplexity" in kinds and text is None:
            raise PlaitError(f"{at}: max_perplexity scores the test's 'text': add one")
        if kinds - {"max_perplexity"} and not prompts:
            raise PlaitError(f"{at}: assertions on a completion need a 'prompt' (or 'prompts')")
        if "equivalent" in kinds and len(prompts) < 2:
            raise PlaitError(f"{at}: 'equivalent' compares paraphrases: give at least two 'prompts'")
        cases.append(
            Case(
                name=name,
                prompts=prompts,
                text=text,
                checks=checks,
                # raw[k] if present, else the suite's value (not raw.get(k, default): mypy types it Optional)
                max_new_tokens=int(
                    raw["max_new_tokens"] if "max_new_tokens" in raw else data.get("max_new_tokens", 32)
                ),
                temperature=float(raw["temperature"] if "temperature" in raw else data.get("temperature", 0.0)),
            )
        )
    return Suite(str(data.get("name") or Path(where).stem), cases, where)


def _unknown(raw: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        raise PlaitError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(allowed)}")


def _check(kind: str, arg: Any, where: str) -> Check:
    if kind not in ASSERTIONS:
        raise PlaitError(f"{where}: unknown assertion {kind!r}; valid: {', '.join(ASSERTIONS)}")
    if kind in ("contains", "not_contains", "exact") and not isinstance(arg, str):
        raise PlaitError(f"{where}: {kind} expects a string, got {arg!r}")
    if kind in ("regex", "not_regex"):
        try:
            re.compile(str(arg))
        except re.error as e:
            raise PlaitError(f"{where}: {kind} {arg!r} is not a valid regular expression ({e})") from None
    if kind in ("max_length", "max_perplexity") and (
        not isinstance(arg, int | float) or isinstance(arg, bool) or arg <= 0
    ):
        raise PlaitError(f"{where}: {kind} expects a positive number, got {arg!r}")
    if kind == "equivalent" and not (arg is True or (isinstance(arg, dict) and isinstance(arg.get("words"), int))):
        raise PlaitError(f"{where}: equivalent expects true or {{words: N}}, got {arg!r}")
    return Check(kind, arg)


# -------------------------------------------------------------------------------------------------- running


@dataclass
class Result:
    test: str
    assertion: str
    passed: bool
    detail: str


@dataclass
class Report:
    suite: str
    results: list[Result] = field(default_factory=list)
    completions: dict[str, list[str]] = field(default_factory=dict)
    perplexity: dict[str, float] | None = None
    model: str = ""
    lm_eval: dict[str, dict[str, Any]] = field(default_factory=dict)  # lm-evaluation-harness: task -> metrics

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return sum(not r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "model": self.model,
            "passed": self.passed,
            "failed": self.failed,
            "perplexity": self.perplexity,
            "results": [asdict(r) for r in self.results],
            "completions": self.completions,
            "lm_eval": self.lm_eval,
        }


@torch.no_grad()
def complete(model: nn.Module, tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> str:
    from plait.data import eos_id
    from plait.engine.generate import generate

    ids = tok.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise PlaitError(f"prompt {prompt!r} is empty after tokenisation")
    args = cast("ModelArgs", model.args)
    room = args.max_seq_len - len(ids)
    if room < 1:
        raise PlaitError(f"prompt {prompt[:40]!r}... has {len(ids)} tokens; the model supports {args.max_seq_len}")
    try:
        eos = eos_id(tok)
    except PlaitError:
        eos = None
    out = generate(
        cast("Transformer", model),
        [ids],
        max_new_tokens=min(max_new_tokens, room),
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        eos_id=eos,
        seed=seed,
    )[0][len(ids) :]
    if eos is not None and out and out[-1] == eos:
        out = out[:-1]
    return tok.decode(out)


@torch.no_grad()
def text_perplexity(model: nn.Module, tok, text: str, context: str = "") -> float:
    """exp(mean NLL) of ``text``'s tokens, each predicted from the context and the text before it."""
    ctx = tok.encode(context, add_special_tokens=False).ids if context else []
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids or (not ctx and len(ids) < 2):
        raise PlaitError(f"text {text[:40]!r} is too short to score")
    full = (ctx + ids)[-cast("ModelArgs", model.args).max_seq_len :]
    scored = min(len(ids), len(full) - 1)
    x = torch.tensor([full[:-1]], device=_device(model))
    y = torch.tensor([full[1:]], device=_device(model))
    logits = model(x)[:, -scored:].float()
    return math.exp(F.cross_entropy(logits.flatten(0, 1), y[:, -scored:].flatten()).item())


def _normalise(text: str, words: int | None) -> str:
    parts = text.lower().split()
    return " ".join(parts[:words] if words else parts)


def run_suite(model: nn.Module, tok, suite: Suite) -> Report:
    """Run every test; the model is left in the mode it was in."""
    was_training = model.training
    model.eval()
    report = Report(suite.name)
    try:
        for case in suite.cases:
            outs = [complete(model, tok, p, case.max_new_tokens, case.temperature) for p in case.prompts]
            if outs:
                report.completions[case.name] = outs
            for check in case.checks:
                report.results.append(_evaluate(check, case, outs, model, tok))
    finally:
        model.train(was_training)
    return report


def _evaluate(check: Check, case: Case, outs: list[str], model, tok) -> Result:
    kind, arg = check.kind, check.arg
    label = f"{kind}: {arg!r}" if kind != "equivalent" else "equivalent"
    if kind == "max_perplexity":
        assert case.text is not None  # parse_suite refuses max_perplexity without a 'text'
        ppl = text_perplexity(model, tok, case.text, case.prompts[0] if case.prompts else "")
        return Result(case.name, label, ppl <= arg, f"perplexity {ppl:.2f} (bound {arg})")
    if kind == "equivalent":
        words = arg.get("words") if isinstance(arg, dict) else None
        forms = [_normalise(o, words) for o in outs]
        same = len(set(forms)) == 1
        detail = "all paraphrases agree" if same else "differ: " + " | ".join(repr(f[:40]) for f in forms)
        return Result(case.name, label, same, detail)
    tests = {
        "contains": lambda o: arg in o,
        "not_contains": lambda o: arg not in o,
        "regex": lambda o: re.search(str(arg), o) is not None,
        "not_regex": lambda o: re.search(str(arg), o) is None,
        "exact": lambda o: o.strip() == arg.strip(),
        "max_length": lambda o: len(o) <= arg,
    }
    failing = [o for o in outs if not tests[kind](o)]
    if not failing:
        return Result(case.name, label, True, "" if kind != "max_length" else f"longest {max(map(len, outs))} chars")
    shown = failing[0]
    detail = f"{len(shown)} chars" if kind == "max_length" else f"got {shown[:60]!r}{'...' if len(shown) > 60 else ''}"
    if len(outs) > 1:
        detail = f"{len(failing)}/{len(outs)} paraphrases fail; {detail}"
    return Result(case.name, label, False, detail)


# ----------------------------------------------------------------------------------------------- perplexity


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


@torch.no_grad()
def perplexity(
    model: nn.Module,
    data_dir: str | Path,
    *,
    split: str = "val",
    seq_len: int = 256,
    batch_size: int = 4,
    max_batches: int = 8,
) -> dict[str, float]:
    """exp(mean token NLL) over the first windows of a prepared split (loss-masked targets are not counted)."""
    from plait.data import TokenDataset, TokenLoader

    args = cast("ModelArgs", model.args)
    dataset: TokenDataset  # or its RetrievalDataset
    if args.retrieval_ids:  # RETRO: each window with its chunks' neighbours, the window a whole number of chunks
        from plait.data.retrieval import RetrievalDataset

        dataset = RetrievalDataset(data_dir, split, chunk=args.retrieval_chunk, k=args.retrieval_k)
        if args.retrieval_learned:  # its neighbours found by its own encoder, as it is now
            from plait.data.retrieval import read_database
            from plait.data.retrieval_live import LiveIndex
            from plait.lifecycle.retrieval import learned_table

            dataset.live = LiveIndex(data_dir, read_database(data_dir), chunk=args.retrieval_chunk, k=args.retrieval_k)
            dataset.live.start(-1, learned_table(model))
        seq_len = max(
            args.retrieval_chunk, min(seq_len, args.max_seq_len) // args.retrieval_chunk * args.retrieval_chunk
        )
    else:
        dataset = TokenDataset(data_dir, split)
    seq_len = min(seq_len, args.max_seq_len, max(1, dataset.num_tokens - 1))
    batch_size = max(1, min(batch_size, dataset.num_samples(seq_len)))
    loader = TokenLoader(
        dataset, seq_len=seq_len, global_batch_size=batch_size, shuffle=False, prefetch=0, device=_device(model)
    )
    batches = max(1, min(max_batches, loader.steps_per_epoch))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for _, (x, y) in zip(range(batches), loader, strict=False):
        logits = model(x).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += int((y != -100).sum())
    model.train(was_training)
    loss = total / max(1, count)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
