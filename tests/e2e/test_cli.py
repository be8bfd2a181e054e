"""The command line end to end on a tiny model: train, resume, generate, data prepare, config show, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli import main

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak.\n"
    "All: Speak, speak.\nFirst Citizen: You are all resolved rather to die than to famish?\n"
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (root / f"doc{i}.txt").write_text(TEXT * (3 + i) + f"Document number {i}.\n")
    out = root / "prepared"
    assert main(["data", "prepare", str(root), "--out", str(out), "--vocab-size", "300"]) == 0
    return out


def tiny_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    return [
        "--model.preset=debug",
        f"--model.vocab_size={vocab}",
        f"--data.source={data_dir}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=6",
        "--optim.warmup_steps=2",
        "--eval.every_steps=3",
        "--eval.num_batches=2",
        "--log.every_steps=1",
        "--sample.max_new_tokens=5",
        f"--run.out_dir={run_dir}",
        "--run.name=t",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "t" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_train_writes_metrics_tensorboard_checkpoint_and_sample(data_dir, tmp_path, capsys):
    assert main(["train", *tiny_args(data_dir, tmp_path)]) == 0
    run = tmp_path / "t"
    assert (run / "checkpoints" / "step_00000006" / "plait.json").is_file()
    assert (run / "config.toml").is_file()
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/mfu", "val/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("val/loss")] == [3, 6]
    assert "sample" in capsys.readouterr().err  # the rule above the printed sample
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # plait plot overlays runs; it never replaces a file without --overwrite
    out = tmp_path / "both.png"
    assert main(["plot", str(run), str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    assert main(["plot", str(run), "--out", str(out)]) == 2 and out.read_bytes() == before
    assert main(["plot", str(tmp_path / "nothing"), "--out", str(tmp_path / "n.png")]) == 2
    assert main(["plot", str(run), "--out", str(tmp_path / "x.jpg")]) == 2


def test_resume_continues_exactly(data_dir, tmp_path):
    """Stop at step 3 (checkpoint), restart with the full step count: the same losses as one run."""
    straight, split = tmp_path / "a", tmp_path / "b"
    assert main(["train", *tiny_args(data_dir, straight)]) == 0
    assert main(["train", *tiny_args(data_dir, split, "--train.steps=6", "--checkpoint.every_steps=3")]) == 0
    # Remove the final checkpoint and the last steps' metrics: as if the job died after step 3's save.
    import shutil

    shutil.rmtree(split / "t" / "checkpoints" / "step_00000006")
    assert main(["train", *tiny_args(data_dir, split)]) == 0
    resumed = losses(split)
    assert resumed == losses(straight)  # bitwise: same data order, same optimizer state, same schedule


def test_generate_from_run_dir(data_dir, tmp_path):
    assert main(["train", *tiny_args(data_dir, tmp_path, "--sample.prompt=")]) == 0
    result = run_cli(
        "generate",
        str(tmp_path / "t"),
        "--prompt",
        "First",
        "--max-new-tokens",
        "8",
        "--num-samples",
        "2",
        "--temperature",
        "0",
    )
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split("--- sample")[1:]
    assert len(samples) == 2 and samples[0].split("\n", 1)[1] == samples[1].split("\n", 1)[1]  # greedy
    assert "First" in samples[0]


def test_config_show_prints_resolved_toml():
    result = run_cli("config", "show", "--model.preset=debug", "--optim.lr=0.01")
    assert result.returncode == 0, result.stderr
    assert "[model]\ndim = 64" in result.stdout and "lr = 0.01" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--optim.lrr=1"], "unknown setting 'optim.lrr'"),
        (["train", "--train.steps=many"], "train.steps expects an integer"),
        (["train", "--optim.lr=-0.1"], "optim.lr=-0.1 must be positive"),
        (["train", "--data.seq_len=5000"], "longer than the model supports"),
        (["train", "--data.source=/nonexistent/data"], "plait data prepare"),
        (["train", "missing.toml"], "does not exist"),
        (["generate", "/nonexistent/run"], "does not exist"),
        (["data", "prepare", "/nonexistent.txt", "--out", "x"], "nonexistent.txt"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    result = run_cli("data", "prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "empty.txt" in result.stderr
    assert not (tmp_path / "out").exists()


def test_existing_outputs_are_never_overwritten(data_dir, tmp_path):
    # A prepared directory is not replaced without --overwrite.
    marker = tmp_path / "prepared" / "keep.txt"
    marker.parent.mkdir()
    marker.write_text("precious")
    src = tmp_path / "in.txt"
    src.write_text(TEXT * 20)
    result = run_cli("data", "prepare", str(src), "--out", str(marker.parent), "--vocab-size", "300")
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert marker.read_text() == "precious"
    # A run directory holding another model's checkpoint is not resumed or replaced.
    assert main(["train", *tiny_args(data_dir, tmp_path, "--train.steps=2")]) == 0
    before = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir())
    result = run_cli("train", *tiny_args(data_dir, tmp_path, "--model.dim=128"))
    assert result.returncode == 2 and "different model" in result.stderr and "model.dim" in result.stderr
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir()) == before


def test_the_cli_answers_without_importing_torch():
    """`--help`, `config show` and the refusal of a bad setting need no torch (2-5 s of imports): they
    answer in a fraction of a second. A fresh interpreter shows what each path imports."""
    code = (
        "import sys, contextlib, io\n"
        "from plait.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['--help']), main(['train', '--help']), main(['config', 'show']),\n"
        "             main(['train', '--model.n_heads=5']),\n"
        "             main(['train', '--nproc', '2', '--parallel.tp_degree=4'])]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "[0, 0, 0, 2, 2] False", done.stdout + done.stderr[-2000:]


def test_resume_reports_changed_settings_and_refuses_unsafe_ones(data_dir, tmp_path, capsys):
    """A resume says which settings changed (steps, LR: allowed, with a warning); other data or seed would
    make the resumed run wrong and is refused (exit 2, nothing on disk touched). A fresh start in a
    directory with metrics but no checkpoint moves them aside instead of appending."""
    no_sample = "--sample.max_new_tokens=0"
    assert main(["train", *tiny_args(data_dir, tmp_path, no_sample)]) == 0
    run = tmp_path / "t"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", *tiny_args(data_dir, tmp_path, no_sample, "--data.seq_len=16", "--train.steps=8")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "with other data or seed would make the run wrong (data.seq_len: checkpoint 32 -> now 16)" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before

    assert main(["train", *tiny_args(data_dir, tmp_path, no_sample, "--train.steps=8", "--optim.lr=1e-3")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "with changed settings: train.steps: checkpoint 6 -> now 8 (the LR schedule now spans" in err
    assert "optim.lr: checkpoint 0.003 -> now 0.001" in err
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6, 7, 8]

    import shutil

    shutil.rmtree(run / "checkpoints")  # a directory with metrics but no checkpoint: a fresh start
    assert main(["train", *tiny_args(data_dir, tmp_path, no_sample, "--train.steps=2")]) == 0
    assert sorted(losses(tmp_path)) == [1, 2]  # not appended to the old ones
    (aside,) = run.glob("previous-*")
    assert sorted(json.loads(x)["step"] for x in (aside / "metrics.jsonl").read_text().splitlines())[-1] == 8


@pytest.mark.parametrize(
    "argv,shown",
    [
        (["generate", "--help"], ["(default: 200)", "(default: OTHELLO.)", "(default: 0)", "(default: auto)"]),
        (["data", "prepare", "--help"], ["(default: 4096)", "(default: 0.05)"]),
        (["ckpt", "export", "--help"], ["(default: fp32)", "(default: hf)"]),
        (["ckpt", "import", "--help"], ["config.json and safetensors"]),
        (["eval", "--help"], ["(default: "]),
        (["plan", "--help"], ["usage: plait plan (--model PRESET --global-batch-tokens N | --config CONFIG.toml)"]),
    ],
)
def test_every_subcommand_help_shows_defaults(argv, shown, capsys):
    from plait.interop.hf.names import ARCHITECTURES

    if argv[:2] == ["ckpt", "export"] or argv[:2] == ["ckpt", "import"]:  # every family plait reads and writes
        shown = [*shown, *ARCHITECTURES.values()]
    assert main(argv) == 0  # argparse's SystemExit becomes the return code
    out = " ".join(capsys.readouterr().out.split())
    for text in shown:
        assert text in out, (text, out)
    assert "(default: None)" not in out and "(default: False)" not in out


def test_train_and_validation_loss_share_one_panel():
    from plait.engine.plot import figure

    rows = [{"step": s, "train/loss": 5 - s / 10, "train/grad_norm": 1.0} for s in range(1, 11)]
    rows += [{"step": 5, "val/loss": 4.8}, {"step": 10, "val/loss": 4.6}]
    loss = figure({"run": rows}).axes[0]
    assert loss.get_title() == "loss" and [line.get_label() for line in loss.get_lines()] == ["train", "validation"]
    two = figure({"a": rows, "b": rows}).axes[0]
    assert [line.get_label() for line in two.get_lines()] == ["a train", "a validation", "b train", "b validation"]


def test_a_running_job_redraws_its_plot_at_most_once_a_minute_and_never_above_its_share(tmp_path):
    """The picture is host work the accelerator waits for: an evaluation redraws it once PLOT_REFRESH_S have
    passed and the last drawing took at most PLOT_SHARE of the time since; a run starts as just drawn."""
    from plait.engine.plot import PLOT_REFRESH_S, PLOT_SHARE, PlotRefresh

    now = [100.0]
    refresh = PlotRefresh(clock=lambda: now[0])
    assert not refresh.due()
    now[0] += PLOT_REFRESH_S
    assert refresh.due()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 5.0}\n')

    def slow_clock():  # each reading 10 s later: the drawing "takes" 10 s
        now[0] += 10
        return now[0]

    refresh.clock = slow_clock
    assert refresh.draw(tmp_path) == tmp_path / "loss.png" and refresh.cost == 10
    refresh.clock = lambda: now[0]
    now[0] += PLOT_REFRESH_S  # a minute later, but 10 s of drawing is above PLOT_SHARE of it
    assert PLOT_SHARE * PLOT_REFRESH_S < 10 and not refresh.due()
    now[0] += 10 / PLOT_SHARE
    assert refresh.due()


@pytest.mark.parametrize(
    "args, toml, said",
    [
        (["generate", "run", "--promt", "x"], None, "unrecognized arguments: --promt x; did you mean --prompt?"),
        (["fit", "--world-size", "2", "--stpes", "3"], None, "did you mean --steps?"),
        (["ckpt", "export", "run", "--out", "x", "--formt", "hf"], None, "did you mean --format?"),
        (["compile", "--json=c.json", "--rnak", "1"], None, "did you mean --rank?"),
        (
            ["config", "show", "my.toml"],
            "[optim]\nlrr = 0.1\n",
            "unknown setting 'optim.lrr' ([optim] lrr); did you mean 'optim.lr'?",
        ),
        (["config", "show", "my.toml"], "lr = 0.1\n", "'lr' is outside any section; did you mean it under [optim]"),
        (["config", "show", "my.toml"], "[trainn]\nsteps = 3\n", "unknown section [trainn]; did you mean 'train'?"),
        (["config", "show", "my.toml"], '[model]\npreset = "smal"\n', "did you mean 'small'?"),
    ],
)
def test_a_typo_gets_the_nearest_name(args, toml, said, tmp_path, monkeypatch, capsys):
    """Plain flags (of a command and of its subcommands) and a TOML file's sections and keys suggest the
    nearest valid name, as --section.key settings and commands do."""
    monkeypatch.chdir(tmp_path)
    if toml is not None:
        (tmp_path / "my.toml").write_text(toml)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err, err
    if toml is not None and "preset" not in toml:  # the file is named with what is wrong in it
        assert "config file 'my.toml'" in err


def tour_lines() -> list[str]:
    """The README's "A quick tour" block, line by line as a user pastes it (comments and all)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## A quick tour", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.full
@pytest.mark.slow
def test_the_readme_tour_runs_verbatim_in_order(tmp_path):
    """Each line of the tour, unchanged, through bash, top to bottom, in a fresh directory holding what the
    tour says is the user's own (books/ of .txt files, notes.jsonl): every line exits 0, and what one line
    writes (my.toml, runs/mine-toml, data/mine) is what the next one reads."""
    import gzip
    import shutil

    corpus = Path(__file__).resolve().parents[2] / "src/plait/data/corpus/shakespeare.jsonl.gz"
    with gzip.open(corpus, "rt") as f:
        rows = [json.loads(line) for line in f][:6]
    (tmp_path / "books").mkdir()
    for i, row in enumerate(rows[:3]):
        (tmp_path / "books" / f"book{i}.txt").write_text(row["text"])
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows[3:]))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this interpreter's `plait`
    assert shutil.which("plait", path=env["PATH"]), "the plait command is not installed (pip install -e .)"
    for line in tour_lines():
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1800)  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert "[model]" in (tmp_path / "my.toml").read_text()
    for run in ("mine-toml", "mine", "mix"):
        assert (tmp_path / "runs" / run / "checkpoints" / "step_00000100").is_dir(), run
