"""lm-evaluation-harness on plait models (`plait eval MODEL --lm-eval TASKS`): tasks made here (no downloads)
of each kind the harness has (multiple choice, rolling perplexity, generation until a stop), scored on a plait
run and, by the same harness's own transformers model, on the run's transformers export: the same scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main
from plait.config import load_config
from runs import debug_run

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("First Citizen: Before we proceed any further, hear me", [" speak.", " sing.", " dance."], 0),
    ("All: Speak,", [" speak.", " run.", " stop."], 0),
    ("ROMEO: What light through yonder", [" window breaks?", " door opens?", " fire burns?"], 0),
    ("To be, or not to be: that is the", [" question:", " answer:", " problem:"], 0),
    ("Now is the winter of our", [" discontent", " content", " summer"], 0),
    ("Friends, Romans, countrymen, lend me your", [" ears;", " eyes;", " hands;"], 0),
]


def tasks(root: Path) -> Path:
    """Three local tasks: multiple choice, rolling perplexity, greedy generation until a full stop."""
    root.mkdir()
    mc = root / "mc.jsonl"
    mc.write_text("\n".join(json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS) + "\n")
    text = root / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": q + c[0]}) for q, c, _ in QUESTIONS) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        f"task: plait_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "ppl.yaml").write_text(
        f"task: plait_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {text}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (root / "gen.yaml").write_text(
        f"task: plait_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


@pytest.mark.full
def test_lm_eval_scores_a_plait_run_as_its_transformers_export(data_dir, tmp_path):
    from lm_eval.tasks import TaskManager

    from plait.api import train

    train(load_config(None, debug_run(data_dir, tmp_path, "run", 200, "train.global_batch_size=16")))
    include = tasks(tmp_path / "tasks")
    names = ["plait_mc", "plait_ppl", "plait_gen"]
    report = tmp_path / "eval.json"
    argv = ["eval", str(tmp_path / "run"), "--lm-eval", ",".join(names), "--lm-eval-include", str(include)]
    assert main([*argv, "--no-perplexity", "--json", str(report)]) == 0
    ours = json.loads(report.read_text())["lm_eval"]
    assert main(["ckpt", "export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu",
        tasks=names,
        task_manager=TaskManager(include_path=str(include)),
        bootstrap_iters=0,
    )["results"]
    assert set(ours) == set(names)
    for task in names:
        for metric, value in theirs[task].items():
            if metric == "alias" or "stderr" in metric:
                continue
            assert ours[task][metric] == pytest.approx(value, rel=1e-4), (task, metric)  # fp32 logits to 1e-5
    assert ours["plait_ppl"]["word_perplexity,none"] > 1 and 0 < ours["plait_mc"]["acc,none"] < 1

    # generation: the very strings, not only their score
    from plait.data import load_tokenizer
    from plait.lifecycle.harness import plait_lm
    from plait.lifecycle.models import load_model

    loaded = load_model(tmp_path / "run")
    manager = TaskManager(include_path=str(include))
    runs = [
        lm_eval.simple_evaluate(
            model=model, model_args=args, tasks=["plait_gen"], task_manager=manager, bootstrap_iters=0, log_samples=True
        )["samples"]["plait_gen"]  # fmt: skip
        for model, args in (
            (plait_lm(loaded.model, load_tokenizer(loaded.tokenizer)), None),
            ("hf", f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu"),
        )
    ]
    generated = [[s["resps"] for s in samples] for samples in runs]
    assert generated[0] == generated[1] and any(r[0][0].strip() for r in generated[0])


def test_lm_eval_settings_need_tasks_and_unknown_tasks_are_named(data_dir, tmp_path, capsys):
    assert main(["eval", "nowhere", "--limit", "3"]) == 2
    assert "apply to --lm-eval TASKS" in capsys.readouterr().err
