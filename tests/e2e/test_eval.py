"""Evaluation: perplexity and behavioural suites on a real tiny model, passing and deliberately failing."""

import json
import math
import re

import pytest
import torch

from plait.cli import main
from plait.core.errors import PlaitError
from plait.data import load_tokenizer
from plait.engine.trainer import build_model
from plait.lifecycle.evaluate import complete, parse_suite, perplexity, run_suite, text_perplexity
from plait.lifecycle.lineage import Registry
from plait.model import ModelArgs

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Prepared data, a tiny model and its weights-only checkpoint (whose config names the data)."""
    from plait.config import Config, to_dict
    from plait.engine.checkpoint.weights import write_weights_checkpoint

    root = tmp_path_factory.mktemp("eval")
    docs = root / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(TEXT * (4 + i))
    assert main(["data", "prepare", str(docs), "--out", str(root / "data"), "--vocab-size", "300"]) == 0
    vocab = json.loads((root / "data" / "manifest.json").read_text())["vocab_size"]
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, multiple_of=16, max_seq_len=64)
    model = build_model(args, torch.device("cpu"), 0)
    cfg = Config()
    cfg.model, cfg.data.source, cfg.data.seq_len = args, str(root / "data"), 32
    ckpt = root / "run" / "checkpoints" / "step_00000000"
    ckpt.parent.mkdir(parents=True)
    write_weights_checkpoint(
        model, ckpt, config=to_dict(cfg), tokenizer_path=root / "data" / "tokenizer.json", extra={}
    )
    Registry(root / "lineage.sqlite")
    return root, model.eval(), load_tokenizer(root / "data" / "tokenizer.json")


def suite_for(model, tok) -> tuple[dict, str]:
    """A suite built around what the model actually says, with deliberate failures."""
    said = complete(model, tok, "First", 8)
    assert said  # greedy: deterministic
    return {
        "name": "mixed",
        "max_new_tokens": 8,
        "tests": [
            {"name": "exact", "prompt": "First", "expect": [{"exact": said}, {"contains": said[:2]}]},
            {"name": "regex-ok", "prompt": "First", "expect": [{"regex": "^" + re.escape(said[:1])}]},
            {"name": "wrong-exact", "prompt": "First", "expect": [{"exact": said + "!"}]},
            {"name": "forbidden", "prompt": "First", "expect": [{"not_contains": said[:2]}]},
            {"name": "too-long", "prompt": "First", "expect": [{"max_length": max(1, len(said) - 1)}]},
            {"name": "no-match", "prompt": "First", "expect": [{"regex": "ZZZ+"}, {"not_regex": "ZZZ+"}]},
            {"name": "same", "prompts": ["First", "First"], "expect": [{"equivalent": True}]},
            {"name": "loose-ppl", "prompt": "First", "text": " Citizen", "expect": [{"max_perplexity": 1e9}]},
            {"name": "tight-ppl", "text": TEXT, "expect": [{"max_perplexity": 1.0001}]},
        ],
    }, said


def test_assertions_pass_and_fail_as_they_should(setup):
    _, model, tok = setup
    spec, said = suite_for(model, tok)
    report = run_suite(model, tok, parse_suite(spec))
    outcome = {(r.test, r.assertion.split(":")[0]): r.passed for r in report.results}
    assert outcome == {
        ("exact", "exact"): True,
        ("exact", "contains"): True,
        ("regex-ok", "regex"): True,
        ("wrong-exact", "exact"): False,
        ("forbidden", "not_contains"): False,
        ("too-long", "max_length"): False,
        ("no-match", "regex"): False,
        ("no-match", "not_regex"): True,
        ("same", "equivalent"): True,
        ("loose-ppl", "max_perplexity"): True,
        ("tight-ppl", "max_perplexity"): False,
    }
    assert report.failed == 5 and report.completions["exact"] == [said]
    detail = next(r.detail for r in report.results if r.test == "tight-ppl")
    assert detail.startswith("perplexity ") and "bound 1.0001" in detail
    assert model.training is False


def test_paraphrases_that_disagree_fail_equivalence(setup):
    _, model, tok = setup
    outs = {p: complete(model, tok, p, 6) for p in ("First", "All:", "Speak", "hear me", "Before we")}
    assert len(set(outs.values())) > 1  # the prompts lead to different continuations
    spec = {"tests": [{"name": "para", "prompts": list(outs), "expect": [{"equivalent": True}]}]}
    result = run_suite(model, tok, parse_suite(spec)).results[0]
    assert not result.passed and result.detail.startswith("differ:")


def test_perplexity_matches_the_mean_token_loss(setup):
    root, model, tok = setup
    result = perplexity(model, root / "data", split="val", seq_len=16, batch_size=2, max_batches=1)
    assert math.isclose(result["perplexity"], math.exp(result["loss"])) and result["tokens"] == 32
    assert 1 < result["perplexity"] < 3 * model.args.vocab_size  # an untrained model: near uniform
    ids = tok.encode(TEXT, add_special_tokens=False).ids[:20]
    x = torch.tensor([ids])
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1])[0], x[0, 1:])
    assert math.isclose(text_perplexity(model, tok, tok.decode(ids)), math.exp(loss.item()), rel_tol=1e-4)


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"tests": [{"prompt": "x", "expect": [{"contain": "y"}]}]}, "unknown assertion 'contain'; valid: contains"),
        ({"tests": [{"expect": [{"contains": "y"}]}]}, "need a 'prompt'"),
        ({"tests": [{"prompt": "x", "expect": [{"equivalent": True}]}]}, "at least two 'prompts'"),
        ({"tests": [{"prompt": "x", "expect": [{"regex": "("}]}]}, "not a valid regular expression"),
        ({"tests": [{"prompt": "x", "expect": [{"max_perplexity": 3}]}]}, "scores the test's 'text'"),
        ({"tests": [{"prompt": "x", "expect": []}]}, "at least one assertion"),
        ({"tests": [{"prompt": "x", "expcet": [{"contains": "y"}]}]}, "unknown key 'expcet'"),
        ({"tests": []}, "non-empty 'tests' list"),
    ],
)
def test_suite_mistakes_are_named(spec, message):
    with pytest.raises(PlaitError, match=message):
        parse_suite(spec, "s.yaml")


def test_eval_cli_reports_json_exit_status_and_lineage(setup, tmp_path, capsys):
    import yaml

    root, model, tok = setup
    spec, _ = suite_for(model, tok)
    failing = tmp_path / "failing.yaml"
    failing.write_text(yaml.safe_dump(spec))
    passing = tmp_path / "passing.yaml"
    passing.write_text(yaml.safe_dump({**spec, "name": "ok", "tests": spec["tests"][:2]}))
    out = tmp_path / "report.json"
    run = str(root / "run")
    assert main(["eval", run, "--suite", str(passing), "--json", str(out), "--seq-len", "16", "--batches", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["passed"] == 3 and report["perplexity"]["perplexity"] > 1
    assert main(["eval", run, "--suite", str(failing), "--json", str(out), "--no-perplexity"]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "6 passed, 5 failed" in text
    assert json.loads(out.read_text())["failed"] == 5
    reg = Registry(root / "lineage.sqlite")
    evals = reg.all("eval")
    assert [e.metrics["failed"] for e in evals] == [0, 5]
    assert reg.get(evals[0].parent_id).path == str((root / "run" / "checkpoints" / "step_00000000").resolve())
    assert main(["eval", run, "--suite", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--parallel.tp_degree=2", "--parallel.pp_degree=2"])
def test_monitors_run_in_parallel_runs(setup, tmp_path, layout):
    """eval.suite under TP 2 and PP 2 (2 processes each): every rank gathers its stage's weights, pipeline
    stages travel over the pp axis, and the main rank's plain copy runs the suite at each evaluation. At the
    last one the copy is the final checkpoint's model: the recorded completions and verdicts equal a
    single-process run of the suite on that checkpoint."""
    import os
    import subprocess
    import sys

    from plait.lifecycle.evaluate import load_suite
    from plait.lifecycle.models import load_model

    root, model, tok = setup
    suite, _ = suite_for(model, tok)
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    args = [
        "train", "--nproc", "2", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
        "--model.n_kv_heads=2", "--model.multiple_of=16", f"--model.vocab_size={model.args.vocab_size}",
        f"--data.source={root / 'data'}", "--data.seq_len=32", "--train.global_batch_size=4",
        "--train.steps=4", "--eval.every_steps=2", f"--eval.suite={path}", layout,
        "--log.tensorboard=false", "--log.plot=false", "--sample.max_new_tokens=0", f"--run.out_dir={tmp_path}",
        "--run.name=tp",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "monitor mixed at step 4" in done.stderr
    reg = Registry(tmp_path / "lineage.sqlite")
    monitors = reg.events(reg.find("tp").id, "monitor")
    assert [m["step"] for m in monitors] == [2, 4]
    final = load_model(tmp_path / "tp").model
    expected = run_suite(final, tok, load_suite(path))
    got = monitors[-1]["payload"]
    assert got["completions"] == expected.completions
    assert [r["passed"] for r in got["results"]] == [r.passed for r in expected.results]
    assert got["failed"] == expected.failed > 0 and got["passed"] == expected.passed > 0


def test_eval_perplexity_of_a_run_is_its_validation_loss(data_dir, tmp_path):
    """`plait eval RUN` measures on the run's own validation setting (its data.seq_len, global batch size and
    eval.num_batches of the first validation windows), so its loss is the run's last validation loss."""
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    train(load_config(None, debug_run(data_dir, tmp_path, "r", 4, "eval.every_steps=4", "eval.num_batches=3")))
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in rows if "val/loss" in r][-1]
    out = tmp_path / "eval.json"
    assert main(["eval", str(tmp_path / "r"), "--json", str(out)]) == 0
    got = json.loads(out.read_text())["perplexity"]
    assert got["loss"] == pytest.approx(val, rel=1e-5) and got["tokens"] == 3 * 8 * 32
