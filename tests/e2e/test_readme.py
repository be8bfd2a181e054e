"""The README's commands do what it says. Every `plait` / `torchrun` line of its bash blocks is either run here,
in order, in a fresh working directory (with `--train.steps=2`-style caps appended so a 400-step job takes
seconds: later settings win, the code path is the same), or listed in SKIPPED with the reason. A README line
that is in neither fails the test, so the README cannot drift from what is checked."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_knowledge_walkthrough import walkthrough

ROOT = Path(__file__).resolve().parents[2]
CAP = ["--train.steps=2", "--eval.every_steps=2", "--eval.num_batches=1", "--sample.max_new_tokens=8"]

SLURM = "plait launch slurm --nodes 4 --gpus-per-node 8 --gpu h100 configs/seed_3d.toml --out job.sbatch"
# README line -> (arguments appended, words its output must contain)
RUN = {
    "plait train --replicas 3 --max-restarts 2 --model.preset=debug --run.name=ft": (
        CAP,
        ["3 replica groups", "runs/ft/replica_2/checkpoints/step_00000002"],
    ),
    "plait train --help": ([], ["--train.steps"]),
    "plait config show --model.preset=small": ([], ["[model]", "dim = 512"]),
    "plait train": (CAP, ["validation loss", "checkpoint: runs/default/checkpoints/step_00000002"]),
    'plait generate runs/mine-toml --prompt "IAGO." --temperature 0.7 --top-k 40': (
        ["--max-new-tokens", "8"],
        ["IAGO."],
    ),
    "plait train my.toml --optim.lr=1e-3 --train.steps=100": (CAP, ["runs/mine-toml/checkpoints/step_00000002"]),
    "plait data prepare books/ notes.jsonl --out data/mine --vocab-size 8192": ([], ["data/mine"]),
    "plait train --data.source=data/mine --model.vocab_size=8192 --train.steps=100 --run.name=mine": (
        CAP,
        ["runs/mine/checkpoints"],
    ),
    "plait data prepare books/ --out data/books --tokenizer data/mine/tokenizer.json": ([], ["data/books"]),
    "plait data prepare books/ notes.jsonl --out data/mine --vocab-size 8192 --workers 2": (
        ["--overwrite"],
        ["with 2 workers", "data/mine"],
    ),
    "plait train --data.source=data/mine --model.vocab_size=8192 --data.document_mask=true --run.name=mine-docs": (
        CAP,
        ["runs/mine-docs/checkpoints"],
    ),
    "plait train --data.sources=mine=data/mine:0.7,books=data/books:0.3 --model.vocab_size=8192 --train.steps=100 "
    "--run.name=mix": (
        CAP,
        ["data mixture mine 70%, books 30%", "runs/mix/checkpoints"],
    ),
    "plait ckpt inspect runs/default": ([], ["step_00000002", "model total"]),
    "plait ckpt export runs/default --format hf --out hf/": ([], ["wrote hf"]),
    "plait ckpt import hf/ --out runs/ft": ([], ["wrote runs/ft/checkpoints/step_00000000"]),
    "plait train configs/seed_3d.toml --parallel.pp_degree=1 --parallel.tp_degree=1": (CAP, ["pp=1"]),
    "plait train --model.preset=moe-debug --train.steps=50": (CAP + ["--run.name=moe"], ["runs/moe/checkpoints"]),
    "plait train --nproc 4 --model.preset=moe-debug --parallel.ep_degree=2": (
        CAP + ["--run.name=moe-ep"],
        ["dp_shard=4 tp=1 ep=2", "runs/moe-ep/checkpoints"],
    ),
    "plait train configs/seed_3d.toml --nproc 8": (CAP, ["pp=2 dp_replicate=1 dp_shard=2 tp=2"]),
    "torchrun --nproc-per-node 8 -m plait train configs/seed_3d.toml": (CAP, ["pp=2 dp_replicate=1 dp_shard=2 tp=2"]),
    "plait fit --model.preset=small --world-size 64 --parallel.dp_shard_degree=16 --parallel.tp_degree=4 "
    "--data.seq_len=1024 --train.global_batch_size=16": (
        ["--run.device=cpu"],
        ["rank 0 of 64 (dp_shard 0 of 16, tp 0 of 4)", "peak of the steps", "fits"],
    ),
    "plait train --optim.name=muon --train.steps=100 --run.name=muon": (
        CAP,
        ["optimizer: Muon for", "runs/muon/checkpoints"],
    ),
    SLURM: ([], ["wrote job.sbatch"]),
    "plait launch slurm --nodes 3 --gpus-per-node 8 configs/seed_3d.toml --parallel.pp_degree=6 "
    "--parallel.tp_degree=4": ([], ["--nnodes=3 --nproc-per-node=8", "--parallel.pp_degree=6 --parallel.tp_degree=4"]),
}
SMOLLM2_TRAIN = (
    "plait train runs/smollm2/config.toml --finetune.init_from=runs/smollm2 --finetune.lora_rank=8 "
    "--data.source=data-smollm2 --data.seq_len=128 --train.steps=12 --eval.suite=suite.yaml --run.name=smollm2-lora"
)
SKIPPED = {  # README line -> why it is not run here
    "plait train --replicas 3 --parallel.diloco_sync_every=10 --model.preset=debug --checkpoint.every_steps=100 "
    "--run.name=diloco": "2 capped steps are no round of 10: tests/parallel/test_replicas.py runs DiLoCo's groups",
    "plait lighthouse --port 29510": "a server that runs until stopped: `plait train --replicas` starts one above",
    "plait launch slurm --nodes 2 --gpus-per-node 8 --replicas 4 --lighthouse http://login1:29510 --out ft.sbatch": (
        "no Slurm here: tests/e2e/test_malformed_replicas.py checks the job array it writes"
    ),
    "plait config show --run.name=mine-toml > my.toml": (
        "a shell redirection: tests/e2e/test_cli.py's tour test runs the tour through bash; here my.toml is written "
        "by the test (the debug preset, to keep this one quick)"
    ),
    "plait train --data.source=s3://my-bucket/corpus --checkpoint.s3_endpoint=http://127.0.0.1:8333": (
        "needs an S3 server: tests/e2e/test_remote_data.py trains from the real one (SeaweedFS) on loopback"
    ),
    f"{SLURM} && sbatch job.sbatch": "no Slurm here: the plait half runs above and its script is checked (bash -n)",
    SMOLLM2_TRAIN: "the SmolLM2 example's own steps (examples/smollm2_lora.py downloads the model)",
    "plait eval runs/smollm2-lora --suite suite.yaml --json eval.json": "the SmolLM2 example's own steps",
    "plait lineage show runs/smollm2-lora": "the SmolLM2 example's own steps",
    "torchrun --nproc-per-node 2 examples/custom_model.py": "run by tests/parallel/test_api.py (FSDP 2 vs one process)",
    **{
        line: "the knowledge walk-through: tests/e2e/test_knowledge_walkthrough.py runs its block verbatim"
        for line in walkthrough()
        if line.startswith("plait ")
    },  # fmt: skip
}


def readme_commands() -> list[str]:
    """`plait ...` / `torchrun ...` lines of the README's bash blocks, continuation lines joined, comments cut."""
    text = (ROOT / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"\s+", " ", line)
            if line.startswith(("plait ", "torchrun ")) or line == "plait":
                lines.append(line)
            elif " && plait " in line:  # the first of the two commands: `pip install ... && plait train`
                lines.append(line.split(" && ", 2)[-1])
    return lines


def test_every_readme_command_is_checked():
    listed = readme_commands()
    unknown = [c for c in listed if c not in RUN and c not in SKIPPED]
    assert not unknown, f"README commands neither run nor skipped by this test: {unknown}"


@pytest.mark.slow
def test_readme_commands_do_what_it_says(tmp_path):
    cwd = tmp_path
    (cwd / "configs").symlink_to(ROOT / "configs")
    (cwd / "my.toml").write_text('[run]\nname = "mine-toml"\n\n[model]\npreset = "debug"\n')
    # a user's own corpus: plain text files in a folder and a JSONL file (from the bundled plays)
    with gzip.open(ROOT / "src/plait/data/corpus/shakespeare.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    (cwd / "books").mkdir()
    for row in rows[:3]:
        (cwd / "books" / f"{row.get('title', 'play')}.txt").write_text(row["text"])
    with open(cwd / "notes.jsonl", "w") as f:
        for row in rows[3:6]:
            f.write(json.dumps({"text": row["text"]}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PLAIT_TEST_README"] = "1"
    listed = readme_commands()
    order = [c for c in listed if c in RUN] + [SLURM] * (f"{SLURM} && sbatch job.sbatch" in listed)
    assert len(order) == len(set(RUN)), sorted(set(RUN) - set(order))
    for command in order:
        extra, expect = RUN[command]
        argv = shlex.split(command) + extra
        if argv[0] == "plait":
            argv = [sys.executable, "-m", "plait.cli", *argv[1:]]
        else:
            argv = [shutil.which("torchrun") or "torchrun", *argv[1:]]
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 0, f"{command}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        for words in expect:
            assert words in out, (command, words, out[-2000:])
    script = cwd / "job.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --signal=B:TERM@120" in script.read_text()
    assert (cwd / "runs" / "default" / "loss.png").is_file() and (cwd / "hf" / "model.safetensors").is_file()
