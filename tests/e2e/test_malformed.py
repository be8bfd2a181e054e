"""Every command meets malformed input with one clear line and exit 2: configs and TOML files, data, damaged
checkpoints, command-line misuse. Each case runs the real command (in this process: `plait.cli.main`) and
checks the exit status, that no traceback escapes, that the message names the problem, and that nothing on
disk changed (every file under the case's directory hashed before and after)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bad_inputs import judge
from plait.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    args = [
        "--model.preset=debug",
        f"--data.source={data_dir}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=2",
        "--eval.every_steps=0",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.max_new_tokens=0",
        "--data.prefetch=0",
        "--run.device=cpu",
        f"--run.out_dir={out}",
        "--run.name=t",
    ]
    assert main(["train", *args]) == 0
    return out / "t"


class Ctx:
    """What a case may use: a fresh directory (`d`), the bundled data, and a copy of a trained run."""

    def __init__(self, d: Path, data_dir: Path, trained: Path):
        self.d, self.data = d, data_dir
        self._trained = trained

    def run(self) -> Path:
        dst = self.d / "run"
        if not dst.exists():
            shutil.copytree(self._trained, dst)
        return dst

    def ckpt(self) -> Path:
        return sorted((self.run() / "checkpoints").iterdir())[-1]

    def meta(self, **changes) -> Path:
        """The run, its checkpoint's plait.json edited (None deletes a key; 'step' edits train_state)."""
        path = self.ckpt() / "plait.json"
        meta = json.loads(path.read_text())
        for key, value in changes.items():
            target = meta["train_state"] if key == "step" else meta
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        path.write_text(json.dumps(meta))
        return self.run()

    def wider(self) -> Path:
        """The run, its checkpoint's config asking for twice the model width its tensors have."""
        path = self.ckpt() / "plait.json"
        meta = json.loads(path.read_text())
        meta["config"]["model"]["dim"] *= 2
        path.write_text(json.dumps(meta))
        return self.run()

    def data_without(self, name: str) -> Path:
        """A copy of the prepared data without one of its files."""
        dst = self.d / "data"
        shutil.copytree(self.data, dst)
        (dst / name).unlink()
        return dst

    def damaged(self, name: str, data: bytes | str) -> Path:
        """The run, with one file of its checkpoint replaced by `data`."""
        (self.ckpt() / name).write_bytes(data.encode() if isinstance(data, str) else data)
        return self.run()

    def config(self) -> dict:
        return json.loads((self.ckpt() / "plait.json").read_text())["config"]

    def in_run(self) -> list[str]:
        """The settings that train in the copy of the trained run (the same model and data)."""
        run = self.run()
        return [f"--data.source={self.data}", f"--run.out_dir={run.parent}", f"--run.name={run.name}"]

    def held(self, *extra: str, lock: Path | None = None) -> list[str]:
        """Settings of a run whose lock (beside the trained run, or `lock`) a live run on another machine holds."""
        from plait.engine.runlock import identity

        settings = [*self.in_run(), *extra]
        lock = lock or self.run().with_name(self.run().name + ".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        holder = {**identity(), "host": "node-7", "boot": "b", "pid": 4242, "command": "plait train"}
        lock.write_text(json.dumps(holder))
        return settings

    def file(self, name: str, data: bytes | str) -> str:
        path = self.d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)


def t(*args: str) -> list[str]:
    """A `plait train` command line that would otherwise run in a moment."""
    return ["train", "--model.preset=debug", "--train.steps=1", "--run.device=cpu", *args]


GPIPE_V3 = '[model]\npreset = "llama3-8b"\n[parallel]\npp_degree = 2\npp_schedule = "gpipe"\npp_virtual_stages = 3\n'
LORA_BASE = ["--finetune.init_from=x", "--model.preset=debug"]

# (id, argv from a Ctx, words the message must contain)
CASES = [
    # ----------------------------------------------------------------------------- settings on the command line
    ("unknown setting", lambda c: t("--optim.lrr=1"), "unknown setting 'optim.lrr'"),
    ("unknown section", lambda c: t("--optimizer.lr=1"), "optimizer"),
    ("not an integer", lambda c: t("--train.steps=many"), "train.steps expects an integer"),
    ("not a number", lambda c: t("--optim.lr=fast"), "optim.lr"),
    ("not a boolean", lambda c: t("--data.shuffle=perhaps"), "data.shuffle"),
    ("negative lr", lambda c: t("--optim.lr=-0.1"), "optim.lr=-0.1 must be positive"),
    ("zero steps", lambda c: t("--train.steps=0"), "train.steps"),
    ("zero batch", lambda c: t("--train.global_batch_size=0"), "train.global_batch_size"),
    ("micro-batch not dividing", lambda c: t("--train.micro_batch_size=3"), "micro_batch_size=3"),
    ("sequence too long", lambda c: t("--data.seq_len=5000"), "longer than the model supports"),
    ("zero sequence", lambda c: t("--data.seq_len=0"), "data.seq_len"),
    ("unknown preset", lambda c: t("--model.preset=huge"), "model.preset='huge' is not a preset"),
    ("heads not dividing", lambda c: t("--model.n_heads=5"), "n_heads=5"),
    ("kv heads not dividing", lambda c: t("--model.n_kv_heads=3"), "n_kv_heads=3"),
    ("bad schedule", lambda c: t("--optim.schedule=linear"), "optim.schedule"),
    ("bad precision", lambda c: t("--train.mixed_precision=fp8"), "train.mixed_precision"),
    ("bad compile mode", lambda c: t("--compile.mode=fast"), "compile.mode='fast' is not allowed"),
    ("bad device", lambda c: t("--run.device=tpu"), "run.device"),
    ("negative keep_last", lambda c: t("--checkpoint.keep_last=-1"), "checkpoint.keep_last"),
    ("option without value", lambda c: t("--train.steps"), "needs a value"),
    ("two config files", lambda c: t(c.file("a.toml", ""), c.file("b.toml", "")), "b.toml"),
    ("run name ..", lambda c: t("--run.name=.."), "run.name"),
    ("run name with a slash", lambda c: t("--run.name=a/b"), "run.name"),
    ("empty run name", lambda c: t("--run.name="), "run.name"),
    ("tp more than processes", lambda c: t("--parallel.tp_degree=2"), "plait train --nproc 2"),
    ("tp not dividing heads", lambda c: t("--nproc", "8", "--parallel.tp_degree=8"), "tp_degree=8"),
    ("nproc zero", lambda c: t("--nproc", "0"), "--nproc=0 must be at least 1"),
    ("nproc not a number", lambda c: t("--nproc", "x"), "--nproc"),
    ("negative max restarts", lambda c: t("--max-restarts", "-1"), "--max-restarts"),
    ("bad layout", lambda c: t("--layout", "manual"), "--layout='manual'"),
    (
        "watchdog after the collective timeout",
        lambda c: t("--parallel.timeout_s=300"),
        "guard.hang_timeout_s=600 must be below parallel.timeout_s=300",
    ),
    ("data source missing", lambda c: t("--data.source=/nonexistent/data"), "plait data prepare"),
    ("cache dir is a file", lambda c: t(f"--data.cache_dir={c.file('f', 'x')}"), "data.cache_dir"),
    # ---------------------------------------------------------------------------------------------- TOML files
    ("config missing", lambda c: t("missing.toml"), "does not exist"),
    ("TOML of random bytes", lambda c: t(c.file("r.toml", os.urandom(200) + b"\xff")), "r.toml"),
    ("TOML in Latin-1", lambda c: t(c.file("l.toml", "[run]\nname = 'caf\xe9'\n".encode("latin-1"))), "l.toml"),
    ("TOML syntax error", lambda c: t(c.file("s.toml", "[model\n")), "s.toml"),
    ("TOML unknown section", lambda c: t(c.file("u.toml", "[foo]\nx = 1\n")), "foo"),
    ("TOML unknown key", lambda c: t(c.file("k.toml", "[train]\nstepz = 3\n")), "train.stepz"),
    ("TOML wrong type", lambda c: t(c.file("w.toml", '[optim]\nlr = "x"\n')), "optim.lr"),
    ("TOML section not a table", lambda c: t(c.file("n.toml", "train = 3\n")), "train"),
    ("TOML key outside its section", lambda c: t(c.file("o.toml", "lr = 1e-3\n")), "under [optim]"),
    ("TOML key misspelt", lambda c: t(c.file("m.toml", "[optim]\nlrr = 1e-3\n")), "optim.lrr"),
    (
        "plan: a pinned schedule the run refuses",  # the runtime's reason, not a plan with v = 1
        lambda c: ["plan", "--config", c.file("g.toml", GPIPE_V3), "--cluster", "h100", "--nodes", "1"],
        "pp_schedule='gpipe' runs one stage per rank",
    ),
    ("config is a directory", lambda c: t(str(c.d)), "directory"),
    # ------------------------------------------------------------------------------------------------- data
    (
        "prepare missing input",
        lambda c: ["data", "prepare", "/nonexistent.txt", "--out", str(c.d / "o")],
        "nonexistent.txt",
    ),
    (
        "prepare: a null text in JSONL",  # as in Parquet: refused with where it is, never dropped in silence
        lambda c: ["data", "prepare", c.file("n.jsonl", '{"text": "a b"}\n{"text": null}\n'), "--out", str(c.d / "o")],
        "n.jsonl:2: field 'text' is null",
    ),
    ("prepare empty corpus", lambda c: ["data", "prepare", c.file("e.txt", "  \n"), "--out", str(c.d / "o")], "e.txt"),
    (
        "prepare into a non-empty dir",
        lambda c: [
            "data",
            "prepare",
            c.file("x.txt", "some words " * 50),
            "--out",
            str(Path(c.file("o/keep.txt", "k")).parent),
        ],
        "o",
    ),
    (
        "prepare tiny vocabulary",
        lambda c: [
            "data",
            "prepare",
            c.file("x.txt", "some words " * 50),
            "--out",
            str(c.d / "o"),
            "--vocab-size",
            "10",
        ],
        "vocab",
    ),
    (
        "prepare JSONL without the field",
        lambda c: ["data", "prepare", c.file("x.jsonl", '{"body": "hi"}\n' * 5), "--out", str(c.d / "o")],
        "text",
    ),
    (
        "prepare invalid JSONL",
        lambda c: ["data", "prepare", c.file("x.jsonl", "{not json\n"), "--out", str(c.d / "o")],
        "x.jsonl",
    ),
    (
        "prepare corrupt gzip",
        lambda c: ["data", "prepare", c.file("x.jsonl.gz", b"\x1f\x8b garbage"), "--out", str(c.d / "o")],
        "x.jsonl.gz",
    ),
    (
        "prepare corrupt parquet",
        lambda c: ["data", "prepare", c.file("x.parquet", os.urandom(300)), "--out", str(c.d / "o")],
        "x.parquet",
    ),
    (
        "prepare missing tokenizer",
        lambda c: [
            "data",
            "prepare",
            c.file("x.txt", "words " * 50),
            "--out",
            str(c.d / "o"),
            "--tokenizer",
            "/nonexistent/tokenizer.json",
        ],
        "tokenizer",
    ),
    ("prepare unknown format", lambda c: ["data", "prepare", c.file("x.docx", "x"), "--out", str(c.d / "o")], "x.docx"),
    # ------------------------------------------------------------------------------------------ checkpoints
    ("generate: no such run", lambda c: ["generate", "/nonexistent/run"], "does not exist"),
    ("generate: empty directory", lambda c: ["generate", str(c.d)], "no complete checkpoint"),
    ("generate: step not an integer", lambda c: ["generate", str(c.meta(step="ten"))], "step"),
    ("generate: no config", lambda c: ["generate", str(c.meta(config=None))], "config"),
    ("generate: plait.json not JSON", lambda c: ["generate", str(c.damaged("plait.json", "{oops"))], "plait.json"),
    (
        "generate: metadata garbled",
        lambda c: ["generate", str(c.damaged(".metadata", b"\x80\x04garbage" * 5))],
        ".metadata",
    ),
    ("generate: bad temperature", lambda c: ["generate", str(c.run()), "--temperature", "-1"], "--temperature"),
    ("generate: negative samples", lambda c: ["generate", str(c.run()), "--num-samples", "-3"], "--num-samples -3"),
    ("generate: negative top-k", lambda c: ["generate", str(c.run()), "--top-k", "-1"], "--top-k -1"),
    (
        "generate: tensors of another shape",
        lambda c: ["generate", str(c.meta(config={**c.config(), "model": {**c.config()["model"], "dim": 128}}))],
        "shapes differ, e.g. model.",
    ),
    # ------------------------------------------------------------------------------------ the run directory
    ("train: run directory held by another run", lambda c: t(*c.held()), "is in use by another run: host node-7"),
    (
        "train: checkpoint.dir held by another run",
        lambda c: t(*c.held(f"--checkpoint.dir={c.d / 'ckpts'}", lock=c.d / "ckpts" / "run.lock")),
        "checkpoint directory",
    ),
    (
        "train: overwrite with missing data moves nothing",
        lambda c: t(*c.in_run(), "--run.overwrite=true", "--data.source=/nonexistent/data"),
        "plait data prepare",
    ),
    ("train: --nproc on a held directory", lambda c: t("--nproc", "2", *c.held()), "in use by another run"),
    ("generate: zero tokens", lambda c: ["generate", str(c.run()), "--max-new-tokens", "0"], "--max-new-tokens"),
    ("inspect: no config", lambda c: ["ckpt", "inspect", str(c.meta(config=None))], "config"),
    ("inspect: step not an integer", lambda c: ["ckpt", "inspect", str(c.meta(step="ten"))], "step"),
    ("inspect: no such path", lambda c: ["ckpt", "inspect", "/nonexistent"], "does not exist"),
    ("export: no config", lambda c: ["ckpt", "export", str(c.meta(config=None)), "--out", str(c.d / "hf")], "config"),
    (
        "export: bad dtype",
        lambda c: ["ckpt", "export", str(c.run()), "--out", str(c.d / "hf"), "--dtype", "fp16"],
        "--dtype",
    ),
    ("export: no --out", lambda c: ["ckpt", "export", str(c.run())], "--out"),
    ("generate --chat of a plain run", lambda c: ["generate", str(c.run()), "--chat"], "carries no chat template"),
    (
        "train: prepared data without its tokenizer",  # refused before training, not at the first checkpoint
        lambda c: t(f"--data.source={c.data_without('tokenizer.json')}", f"--run.out_dir={c.d}"),
        "has no tokenizer.json",
    ),
    (
        "export: a config of another width",  # every tensor differs: one short line, not four shapes
        lambda c: ["ckpt", "export", str(c.wider()), "--out", str(c.d / "hf")],
        "tensors differ, e.g. model.tok_embeddings.weight",
    ),
    (
        "import: not a directory",
        lambda c: ["ckpt", "import", "/nonexistent", "--out", str(c.d / "o")],
        "not a directory",
    ),
    ("import: no config.json", lambda c: ["ckpt", "import", str(c.d), "--out", str(c.d / "o")], "config.json"),
    (
        "train: only checkpoint damaged",
        lambda c: t(
            f"--run.out_dir={c.meta(config=None).parent}",
            "--run.name=run",
            f"--data.source={c.data}",
            "--data.seq_len=32",
            "--train.global_batch_size=4",
        ),
        "holds only damaged checkpoints",
    ),
    # ----------------------------------------------------------------------------------------- command misuse
    ("unknown command", lambda c: ["fly"], "unknown command 'fly'"),
    ("misspelt command", lambda c: ["trian"], "unknown command 'trian'; did you mean `plait train`?"),
    ("config without show", lambda c: ["config"], "usage"),
    ("ckpt without action", lambda c: ["ckpt"], "action"),
    ("eval: zero batches", lambda c: ["eval", str(c.run()), "--batches", "0"], "--batches"),
    (
        "finetune merge without adapters",
        lambda c: ["finetune", "merge", str(c.run()), "--out", str(c.d / "m")],
        "adapter",
    ),
    ("plan: no batch", lambda c: ["plan", "--model", "llama3-8b"], "--global-batch-tokens"),
    (
        "plan: infinite memory",
        lambda c: ["plan", "--model", "llama3-8b", "--global-batch-tokens", "4M", "--memory-gib", "inf"],
        "--memory-gib",
    ),
    (
        "plan: NaN peak",
        lambda c: ["plan", "--model", "llama3-8b", "--global-batch-tokens", "4M", "--peak-tflops", "nan"],
        "--peak-tflops",
    ),
    (
        "plan: write over a file",
        lambda c: [
            "plan",
            "--model",
            "llama3-8b",
            "--global-batch-tokens",
            "4M",
            "--write",
            c.file("mine.toml", "# mine\n"),
        ],
        "--overwrite",
    ),
    (
        "plan: write where it cannot",
        lambda c: [
            "plan",
            "--model",
            "llama3-8b",
            "--global-batch-tokens",
            "4M",
            "--write",
            c.file("afile", "x") + "/sub/x.toml",
        ],
        "afile",
    ),
    (
        "bench: --json is a directory",
        lambda c: [
            "bench",
            "--model.preset=debug",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--json",
            str(c.d),
            "--run.device=cpu",
        ],
        "--json",
    ),
    ("bench: zero steps", lambda c: ["bench", "--steps", "0"], "--steps"),
    ("launch: zero nodes", lambda c: ["launch", "slurm", "--nodes", "0"], "--nodes"),
    (
        "launch: script exists",
        lambda c: ["launch", "slurm", "--nodes", "1", "--out", c.file("job.sbatch", "x")],
        "exists",
    ),
    ("compile: rank past the job", lambda c: ["compile", "--world-size", "4", "--rank", "4"], "--rank"),
    ("compile: zero ranks", lambda c: ["compile", "--world-size", "0"], "--world-size"),
    ("compile: --json is a directory", lambda c: ["compile", "--json", str(c.d)], "--json"),
    (
        "compile: a layout the run refuses",  # the runtime's own reason (rules), before anything is compiled
        lambda c: ["compile", "--world-size=2", "--parallel.pp_degree=2", "--finetune.lora_rank=4", *LORA_BASE],
        "finetune.lora_rank=4 runs on one process or data parallel",
    ),
    ("plot: no such run", lambda c: ["plot", "/nonexistent/run", "--out", str(c.d / "p.png")], "metrics.jsonl"),
    ("plot: not a PNG", lambda c: ["plot", str(c.run()), "--out", str(c.d / "p.jpg")], "PNG"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_gets_one_clear_line(case, data_dir, trained, tmp_path, capsys):
    name, build, words = case
    judge(name, build(Ctx(tmp_path, data_dir, trained)), words, tmp_path, capsys)


def test_there_are_at_least_sixty_cases():
    assert len(CASES) >= 60
