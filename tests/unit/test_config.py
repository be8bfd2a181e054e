"""Config: TOML + overrides, presets, type conversion, validation messages, the option surface."""

import re
from pathlib import Path

import pytest

from plait.config import Config, load_config, options_help, to_toml
from plait.core.errors import ConfigError
from plait.model import preset_args


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_resolution_order_preset_then_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "debug"\ndim = 128\n[optim]\nlr = 0.001\n')
    cfg = load_config(path, ["optim.lr=2e-4", "model.n_layers=3"])
    debug = preset_args("debug")
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (128, 3, debug.n_heads)
    assert cfg.optim.lr == 2e-4


def test_a_large_preset_sets_its_published_peak_lr_which_a_file_or_an_override_still_overrides(tmp_path):
    from plait.config.recipes import PRESET_LR
    from plait.model.presets import PRESETS

    default = Config().optim.lr
    assert set(PRESET_LR) <= set(PRESETS)
    assert all(lr < default for lr, _ in PRESET_LR.values())  # a large model takes a smaller step
    assert load_config(None, ["model.preset=llama3-8b"]).optim.lr == 3e-4
    assert load_config(None, ["model.preset=tiny"]).optim.lr == default  # the small presets: the default
    assert load_config(None, ["optim.lr=1e-3", "model.preset=llama3-8b"]).optim.lr == 1e-3  # in either order
    path = tmp_path / "c.toml"
    path.write_text('[optim]\nlr = 0.001\n[model]\npreset = "llama3-70b"\n')  # optim's table first
    assert load_config(path).optim.lr == 1e-3
    path.write_text('[model]\npreset = "llama3-70b"\n')
    assert load_config(path).optim.lr == 1.5e-4
    assert "published peak" in options_help()


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lrr=1", r"unknown setting 'optim.lrr'; did you mean 'optim.lr'\?"),
        ("log.every=5", r"unknown setting 'log.every'; did you mean 'log.every_steps'\?"),
        ("train.lr=1", r"unknown setting 'train.lr'; did you mean 'optim.lr'\?"),
        ("optimizer.lr=1", r"unknown config section 'optimizer'; did you mean 'optim'\?"),
        ("optim.lr=fast", r"optim.lr expects a number, got 'fast'"),
        ("optim.lr=-1", r"optim.lr=-1.0 must be positive"),
        ("optim.lr=nan", r"optim.lr must be a finite number"),
        ("train.steps=2.5", r"train.steps expects an integer, got '2.5'"),
        ("train.mixed_precision=fp8", r"train.mixed_precision='fp8' is not allowed; choose one of 'auto'"),
        ("log.tensorboard=maybe", r"log.tensorboard expects a boolean"),
        (
            "data.seq_len=4096",
            r"data.seq_len=4096 is longer than the model supports \(model.max_seq_len=1024\)",
        ),
        ("model.n_kv_heads=4", r"model.n_kv_heads=4 does not divide model.n_heads=6; choose n_kv_heads in"),
        ("model.n_heads=5", r"model.dim=192 is not divisible by model.n_heads=5"),
        ("model.preset=huge", r"model.preset='huge' is not a preset; valid: debug, tiny"),
        (
            "train.micro_batch_size=5",
            r"train.global_batch_size=16 is not a multiple of train.micro_batch_size=5",
        ),
        ("parallel.tp_degree=0", r"parallel.tp_degree must be at least 1"),
        ("optim.lr", r"must look like section.key=value"),
    ],
)
def test_bad_settings_name_the_field_and_a_valid_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_toml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[optim]\nlr = 'high'\n")
    with pytest.raises(ConfigError, match="optim.lr expects a number, got 'high'"):
        load_config(wrong)


def test_every_option_is_documented():
    text = options_help()
    options = re.findall(r"--(\w+\.\w+) ", text)
    cfg = Config()
    expected = [f"{s}.{k}" for s, body in cfg.__dict__.items() for k in body.__dict__] + ["model.preset"]
    assert sorted(options) == sorted(expected)
    for line in text.splitlines():
        if line.startswith("  --"):
            assert len(line.split("  ", 2)[-1]) > 10, f"undocumented: {line}"


def test_option_surface_snapshot():
    """Adding or removing an option is a deliberate choice: update tests/options.txt with it."""
    snapshot = Path(__file__).parents[1] / "options.txt"
    current = "\n".join(sorted(re.findall(r"--(\w+\.\w+) ", options_help()))) + "\n"
    assert current == snapshot.read_text(), "the option list changed: update tests/options.txt"


def test_a_warmup_as_long_as_the_run_is_warned_about():
    """The defaults' 30 warm-up steps on a 20-step run: the LR never reaches optim.lr nor decays. Said at
    start-up (a warning, not a refusal: a deliberately short probe is legitimate), with a value that works."""
    from plait.config import OptimConfig
    from plait.engine.optim import lr_factor, schedule_problem

    cfg = OptimConfig(lr=3e-3, warmup_steps=30)
    problem = schedule_problem(cfg, 20)
    top = lr_factor(19, cfg=cfg, total_steps=20) * 3e-3
    assert top < 3e-3 and f"(to {top:.2e} at the last step, below optim.lr=0.003)" in problem
    assert "optim.warmup_steps=30 is not below train.steps=20" in problem and "(e.g. 2)" in problem
    assert schedule_problem(OptimConfig(warmup_steps=2), 20) is None
    assert schedule_problem(OptimConfig(warmup_steps=0), 1) is None
