"""plait's Python API: `plait.Trainer` with your own model, data, loss and callbacks (examples/custom_model.py
runs under FSDP 2 and in one process with the same losses), the callback protocol, and clear refusals."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.core.errors import ConfigError
from plait.data.samples import SampleLoader
from plait.engine.callbacks import Callbacks
from plait.parallel import ParallelDims

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_model.py"

# FSDP 2 vs one process, fp32: the same arithmetic except the order of the gradient reduce-scatter's sums and
# of the loss's mean over ranks (a few ulp per step, grown over the steps by the optimizer).
FSDP_LOSS_RTOL = 1e-5


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_custom_model_example_under_fsdp2_equals_one_process_and_resumes(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    fsdp = _run([*torchrun, str(EXAMPLE), "--out", "fsdp", "--steps", "12"], tmp_path)
    assert "dp_shard=2" in fsdp.stderr and "your data" in fsdp.stderr  # plait's console writes to stderr
    single = _run([sys.executable, str(EXAMPLE), "--out", "single", "--steps", "12"], tmp_path)
    a = json.loads((tmp_path / "fsdp/custom-model/losses.json").read_text())
    b = json.loads((tmp_path / "single/custom-model/losses.json").read_text())
    assert len(a) == len(b) == 12
    assert a["12"] < a["1"] - 1.0  # it learns
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=FSDP_LOSS_RTOL), step
    assert "final loss" in single.stdout

    resumed = _run([*torchrun, str(EXAMPLE), "--out", "fsdp", "--steps", "24"], tmp_path)
    assert "resumed from" in resumed.stderr and "step_00000012" in resumed.stderr
    steps = json.loads((tmp_path / "fsdp/custom-model/losses.json").read_text())
    assert sorted(map(int, steps)) == list(range(13, 25))  # the callback saw only the new steps
    assert (tmp_path / "fsdp/custom-model/checkpoints/step_00000024").is_dir()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class Recorder(plait.Callback):
    def __init__(self, withhold_step=0):
        self.calls, self.withhold_step = [], withhold_step

    def on_setup(self, run):
        self.calls.append("setup")

    def on_model(self, run, parts):
        self.calls.append(f"model:{type(parts[0]).__name__}")

    def on_start(self, run):
        self.calls.append("start")

    def before_step(self, run, step):
        self.calls.append(f"before:{step}")

    def should_step(self, run, loss, grad_norm):
        if run.state.step + 1 == self.withhold_step:
            run.withhold_step("the test withholds it")

    def after_step(self, run, step, result):
        self.calls.append(f"after:{step}:{int(result.stepped)}")

    def after_eval(self, run, step, val_loss):
        self.calls.append(f"eval:{step}")

    def after_checkpoint(self, run, step, saved):
        if saved:
            self.calls.append(f"ckpt:{step}")

    def close(self, run):
        self.calls.append("close")

    def on_end(self, run, final):
        self.calls.append("end")


def _cfg(tmp_path, **extra):
    cfg = plait.Config()
    cfg.run.out_dir, cfg.run.name, cfg.run.health_check_enabled = str(tmp_path), "api", False
    cfg.data.seq_len, cfg.train.steps, cfg.train.global_batch_size = 8, 4, 4
    cfg.eval.every_steps, cfg.checkpoint.every_steps, cfg.log.tensorboard = 2, 2, False
    for key, value in extra.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _samples(n=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (9,), generator=g).tolist() for _ in range(n)]


def test_trainer_runs_your_model_data_loss_and_callbacks_in_order(tmp_path):
    recorder = Recorder(withhold_step=3)
    seen = []

    def loss(logits, targets):
        seen.append(tuple(logits.shape))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    final = plait.Trainer(
        _cfg(tmp_path, checkpoint__async_enabled=False),  # async saves report when published, at a later step
        model=TinyLM,
        data=_samples(),
        val_data=_samples(8),
        loss=loss,
        callbacks=[recorder],
    ).fit()
    assert recorder.calls == [
        "setup", "model:TinyLM", "start",
        "before:1", "after:1:1", "before:2", "after:2:1", "eval:2",
        "ckpt:2", "before:3", "after:3:0", "before:4", "after:4:1", "eval:4", "ckpt:4",
        "close", "end",
    ]  # fmt: skip
    assert seen[0] == (4, 8, 32) and "val_loss" in final
    assert (tmp_path / "api" / "checkpoints" / "step_00000004").is_dir()


class RollBack(plait.Callback):
    """Rolls the run back once, at `step`'s after_step."""

    def __init__(self, step):
        self.step, self.done = step, False

    def after_step(self, run, step, result):
        if step == self.step and not self.done:
            self.done = run.roll_back() is not None


@pytest.mark.parametrize("recorder_first", [False, True])
def test_the_loop_logs_evaluates_and_saves_whatever_the_callbacks_order(tmp_path, recorder_first):
    """The loop, not a callback, logs, evaluates and saves a step, and fires after_eval and after_checkpoint:
    a callback sees them wherever it stands in the list. A step rolled back is neither logged, evaluated nor
    saved, and the callbacks after the one that rolled it back do not see it."""
    recorder, roll_back = Recorder(), RollBack(3)
    cfg = _cfg(tmp_path, checkpoint__async_enabled=False, eval__every_steps=1, log__every_steps=1)
    callbacks = [recorder, roll_back] if recorder_first else [roll_back, recorder]
    plait.Trainer(cfg, model=TinyLM, data=_samples(), val_data=_samples(8), callbacks=callbacks).fit()
    assert roll_back.done
    seen_rolled_back = ["after:3:1"] if recorder_first else []  # before the callback that rolled it back
    assert recorder.calls == [
        "setup", "model:TinyLM", "start",
        "before:1", "after:1:1", "eval:1", "before:2", "after:2:1", "eval:2", "ckpt:2",
        "before:3", *seen_rolled_back, "before:3", "after:3:1", "eval:3", "before:4", "after:4:1", "eval:4", "ckpt:4",
        "close", "end",
    ]  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "api" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], k) for r in rows for k in ("train/loss", "val/loss", "checkpoint/saved_step") if k in r]
    assert logged == [
        (1, "train/loss"), (1, "val/loss"), (2, "train/loss"), (2, "val/loss"), (2, "checkpoint/saved_step"),
        (3, "train/loss"), (3, "val/loss"), (4, "train/loss"), (4, "val/loss"), (4, "checkpoint/saved_step"),
    ]  # fmt: skip  # step 3 once: the replay


def test_messages_go_through_the_plait_logger(tmp_path):
    """A Python user takes plait's messages over with the stdlib logging module."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("plait")
    saved = logger.handlers[:]
    logger.handlers[:] = [handler]
    try:
        cfg = _cfg(tmp_path)
        cfg.train.steps = 2
        plait.Trainer(cfg, model=TinyLM, data=_samples()).fit()
        cfg.train.steps = 3
        plait.Trainer(cfg, model=TinyLM, data=_samples()).fit()
    finally:
        logger.handlers[:] = saved
    text = [r.getMessage() for r in records]
    assert any("parameters, 1 x" in t and "your data" in t for t in text), text
    assert any(t.startswith("resumed from") and "step_00000002" in t for t in text), text


def test_refusals_name_the_setting(tmp_path):
    class Buffered(TinyLM):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.ones(4))

    with pytest.raises(ConfigError, match="buffers \\(mask\\).*init_weights"):
        plait.Trainer(_cfg(tmp_path), model=Buffered, data=_samples()).fit()
    with pytest.raises(ConfigError, match="parallelize= is the plan for your own model"):
        plait.Trainer(_cfg(tmp_path), parallelize=lambda *a: None)
    with pytest.raises(TypeError, match="not a plait.Callback"):
        Callbacks([object()])

    from plait.parallel.parallelize import parallelize_own

    meshes = type("M", (), {"dims": ParallelDims(1, 1, 2, 1)})()
    with pytest.raises(ConfigError, match="parallel.tp_degree=2: .*Trainer\\(parallelize=fn\\)"):
        parallelize_own(TinyLM(), meshes, _cfg(tmp_path), torch.device("cpu"))
    no_blocks = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    one = type("M", (), {"dims": ParallelDims(1, 1, 1, 1)})()
    with pytest.raises(ConfigError, match="activation_checkpoint=full: your model has no blocks"):
        parallelize_own(no_blocks, one, _cfg(tmp_path, parallel__activation_checkpoint="full"), torch.device("cpu"))


def test_sample_loader_reads_dicts_labels_and_resumes_an_iterable():
    rows = [{"input_ids": list(range(i, i + 6)), "labels": [-100, -100, *range(i + 2, i + 6)]} for i in range(8)]
    loader = SampleLoader(rows, seq_len=4, global_batch_size=2)
    x, y = next(loader)
    assert x.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]
    assert y.tolist() == [[-100, 2, 3, 4], [-100, 3, 4, 5]]
    state = loader.state_dict()

    stream = SampleLoader(iter(rows), seq_len=4, global_batch_size=2, dp_rank=1, dp_degree=2)
    stream.samples = rows  # an iterable that can be iterated again (as a generator function's result cannot)
    stream.indexed = False
    stream.load_state_dict(state)
    x2, _ = next(stream)
    assert x2.tolist() == [[3, 4, 5, 6]]  # rank 1's row of the second global batch
    with pytest.raises(ConfigError, match="sample 0 has 3 tokens; data.seq_len=4 needs at least 5"):
        next(SampleLoader([[1, 2, 3]], seq_len=4, global_batch_size=1))


def test_import_plait_is_light_and_hands_out_the_api():
    code = "import sys, plait; assert 'torch' not in sys.modules; print(plait.Trainer.__module__, plait.Config)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["plait.api", "<class", "'plait.config.sections.Config'>"]


def _edited(**fields):
    """A default Config with fields set as a Python user would (no validation on the way)."""
    cfg = plait.Config()
    for key, value in fields.items():
        section, name = key.split("__")
        if name:
            setattr(getattr(cfg, section), name, value)
        else:
            setattr(cfg, section, value)
    return cfg


class _Mine(plait.Callback):
    pass


# (id, the call, the words its one error must contain): each raises ConfigError (or ArgumentError, which is a
# ConfigError and a TypeError) at once, before a process group, a health check, a model or a directory.
API_MISUSES = [
    ("config: an int", lambda: plait.Trainer(5), "the config given is an int"),
    ("config: the class", lambda: plait.Trainer(plait.Config), "the class Config itself: give an instance"),
    ("config: a list", lambda: plait.Trainer(["train.steps=3"]), "not a plait.Config"),
    ("config: a dict, unknown key", lambda: plait.Trainer({"train": {"stepz": 3}}), "unknown setting 'train.stepz'"),
    ("config: a dict, unknown section", lambda: plait.Trainer({"trian": {"steps": 3}}), "did you mean 'train'"),
    ("config: a dict, not a table", lambda: plait.Trainer({"train": 3}), "'train' must be a table"),
    ("config: missing file", lambda: plait.Trainer("missing.toml"), "'missing.toml' does not exist"),
    ("section: a dict", lambda: plait.Trainer(_edited(train__={"steps": 3})), "section 'train' is a dict"),
    ("section: None", lambda: plait.Trainer(_edited(model__=None)), "section 'model' is a NoneType"),
    ("steps: a word", lambda: plait.Trainer(_edited(train__steps="abc")), "train.steps expects an integer"),
    ("steps: a float", lambda: plait.Trainer(_edited(train__steps=2.5)), "train.steps expects an integer"),
    ("lr: a word", lambda: plait.Trainer(_edited(optim__lr="fast")), "optim.lr expects a number"),
    ("lr: not finite", lambda: plait.Trainer(_edited(optim__lr=float("nan"))), "optim.lr must be a finite"),
    ("shuffle: a number", lambda: plait.Trainer(_edited(data__shuffle=3)), "data.shuffle expects a boolean"),
    ("precision: unknown", lambda: plait.Trainer(_edited(train__mixed_precision="fp8")), "'fp8' is not allowed"),
    ("run name: a number", lambda: plait.Trainer(_edited(run__name=5)), "run.name expects a string"),
    ("steps: zero", lambda: plait.Trainer(_edited(train__steps=0)), "train.steps"),
    ("callbacks: an int", lambda: plait.Trainer(callbacks=5), "callbacks= takes a list of plait.Callback"),
    ("callbacks: a string", lambda: plait.Trainer(callbacks="guards"), "callbacks= takes a list"),
    ("callbacks: one, not a list", lambda: plait.Trainer(callbacks=_Mine()), "callbacks=[_Mine()]"),
    ("callbacks: a class", lambda: plait.Trainer(callbacks=[_Mine]), "callbacks[0] is the class _Mine"),
    ("callbacks: not a Callback", lambda: plait.Trainer(callbacks=[object()]), "callbacks[0] is object"),
    ("model: a name", lambda: plait.Trainer(model="llama"), "model= takes a function (or class), got str"),
    ("model: a built module", lambda: plait.Trainer(model=TinyLM()), "got a built TinyLM: pass TinyLM"),
    ("model: not a module class", lambda: plait.Trainer(model=dict), "model=dict is not an nn.Module class"),
    ("parallelize: not callable", lambda: plait.Trainer(model=TinyLM, parallelize=5), "parallelize= takes"),
    ("parallelize: without model", lambda: plait.Trainer(parallelize=lambda *a: None), "give model= too"),
    ("loss: a name", lambda: plait.Trainer(model=TinyLM, loss="ce"), "loss= takes a function"),
    ("data: an int", lambda: plait.Trainer(model=TinyLM, data=5), "data= takes a sequence or iterable"),
    ("data: a path", lambda: plait.Trainer(model=TinyLM, data="corpus/"), "set cfg.data.source instead"),
    ("data: empty", lambda: plait.Trainer(model=TinyLM, data=[]), "data= is empty"),
    ("data: one sample dict", lambda: plait.Trainer(model=TinyLM, data={"input_ids": [1]}), "data= takes"),
    ("val_data: without data", lambda: plait.Trainer(val_data=_samples(4)), "val_data= goes with your own data="),
    ("val_data: an int", lambda: plait.Trainer(model=TinyLM, data=_samples(), val_data=3), "val_data= takes"),
    ("env: a device name", lambda: plait.Trainer(env="cpu"), "env= takes a plait.parallel.DistEnv"),
    ("standard: a word", lambda: plait.Trainer(standard="yes"), "standard= takes True"),
    ("api.train(): an int", lambda: plait.api.train(7), "the config given is an int"),
]


@pytest.mark.parametrize("case", API_MISUSES, ids=[c[0] for c in API_MISUSES])
def test_python_api_misuse_is_one_clear_error_and_writes_nothing(case, tmp_path, monkeypatch):
    name, call, words = case
    monkeypatch.chdir(tmp_path)  # the default run directory (./runs) would appear here
    with pytest.raises(ConfigError) as e:
        call()
    text = str(e.value)
    assert words in text and "\n" not in text and len(text) < 400, (name, text)
    if "takes" in words or "callbacks" in words:  # the arguments' kind: a TypeError too, as Python callers expect
        assert isinstance(e.value, TypeError), name
    assert list(tmp_path.iterdir()) == [], f"{name}: something was written"


def test_there_are_at_least_25_api_misuses():
    assert len(API_MISUSES) >= 25


def test_a_hook_that_returns_a_value_is_refused_naming_what_to_call():
    class OldStyle(plait.Callback):
        def should_step(self, run, loss, grad_norm):
            return False  # plait's older protocol

    class OldRollback(plait.Callback):
        def after_step(self, run, step, result):
            return True

    one = torch.zeros(())
    with pytest.raises(TypeError, match=r"OldStyle.should_step returned False: .*call run.withhold_step\(why\)"):
        Callbacks([OldStyle()]).should_step(None, one, one)
    with pytest.raises(TypeError, match=r"OldRollback.after_step returned True: .*call run.roll_back\(\)"):
        Callbacks([OldRollback()]).after_step(None, 1, None)
