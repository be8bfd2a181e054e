"""The lineage registry: several processes writing at once, processes killed mid-write, lookups, trees, diffs."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from plait.cli import main
from plait.cli import views_lineage as views
from plait.core.errors import PlaitError
from plait.lifecycle.lineage import Registry, data_fingerprint, effective_status, find_registry
from plait.lifecycle.lineage_diff import diff_rows

WRITER = """
import sys, time
from plait.lifecycle.lineage import Registry

db, mode, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
reg = Registry(db)
if mode == "hold":  # take the write lock, insert half a record, and wait to be killed inside the transaction
    with reg._write() as conn:
        conn.execute("INSERT INTO artifacts (id, kind, name, created, updated, status) "
                     "VALUES ('held', 'run', 'held', 0, 0, 'running')")
        print("inside", flush=True)
        time.sleep(120)
i = 0
while mode == "forever" or i < n:
    reg.record("run", name=f"{tag}-{i}", extra={"writer": tag, "i": i},
               events=[(j, "progress", {"i": i, "j": j}) for j in range(3)])
    i += 1
print("done", flush=True)
"""


def spawn(script: Path, db: Path, mode: str, tag: str, n: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(db), mode, tag, str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_concurrent_writers_and_killed_processes_leave_a_consistent_registry(tmp_path):
    db = tmp_path / "lineage.sqlite"
    Registry(db)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    # 1. A process dies inside an open write transaction while four writers wait for the lock.
    holder = spawn(script, db, "hold", "holder")
    assert holder.stdout.readline().strip() == "inside", holder.stderr.read()
    n = 30
    writers = [spawn(script, db, "write", f"w{k}", n) for k in range(4)]
    time.sleep(0.5)  # the writers are now blocked on the lock (busy timeout), not failing
    assert all(w.poll() is None for w in writers)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # 2. Another process is killed at an arbitrary moment of a loop of writes.
    victim = spawn(script, db, "forever", "victim")
    reg = Registry(db)
    deadline = time.time() + 60
    while len([a for a in reg.all() if a.name.startswith("victim-")]) < 5 and time.time() < deadline:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0 and out.strip() == "done", err
    assert reg.integrity() == "ok"
    arts = reg.all()
    by_writer: dict[str, set[int]] = {}
    for a in arts:
        by_writer.setdefault(a.extra["writer"], set()).add(a.extra["i"])
        # all-or-nothing: every artifact came with its three events, none half-written
        assert [e["step"] for e in reg.events(a.id)] == [0, 1, 2], a.name
    assert all(by_writer[f"w{k}"] == set(range(n)) for k in range(4))
    assert len(by_writer["victim"]) >= 5 and by_writer["victim"] == set(range(len(by_writer["victim"])))
    assert not any(a.name == "held" for a in arts)  # the killed transaction was rolled back
    reg.record("run", name="after")  # and the lock it held is gone
    assert reg.find("after").kind == "run"


def test_a_run_whose_process_died_shows_as_died(tmp_path):
    reg = Registry(tmp_path / "l.sqlite")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = reg.record("run", name="dead", status="running", extra={"pid": gone.pid, "host": socket.gethostname()})
    alive = reg.record("run", name="alive", status="running", extra={"pid": os.getpid(), "host": socket.gethostname()})
    assert effective_status(reg.get(dead)) == "died"
    assert effective_status(reg.get(alive)) == "running"


@pytest.fixture
def family(tmp_path) -> tuple[Registry, dict[str, str]]:
    """import -> run A -> ckpt -> adapter + eval; run B (other data, other config) from the same import."""
    data_a, data_b = tmp_path / "data_a", tmp_path / "data_b"
    for d, content in ((data_a, "aaa"), (data_b, "bbb")):
        d.mkdir()
        (d / "manifest.json").write_text(
            '{"format": "plait-tokens-v1", "tokenizer_sha256": "tok", "splits": {"train": {"num_tokens": 3, '
            f'"shards": [{{"file": "train_00000.bin", "sha256": "{content}"}}]}}}}}}'
        )
    reg = Registry(tmp_path / "runs" / "lineage.sqlite")
    ids = {}
    ids["import"] = reg.record(
        "import",
        name="smol",
        path=tmp_path / "smol",
        weights_hash="a" * 64,
        extra={"imported_from": {"path": "/models/smol-hf"}},
    )
    cfg = {"optim": {"lr": 0.001}, "finetune": {"lora_rank": 8}, "run": {"name": "a"}}
    ids["run_a"] = reg.record(
        "run",
        name="a",
        path=tmp_path / "runs" / "a",
        parent=ids["import"],
        config=cfg,
        data=data_fingerprint(data_a),
        code={"plait": "0.1.0", "git_commit": "c1"},
        base_hash="a" * 64,
        metrics={"loss": 2.0},
        status="finished",
    )
    ids["ckpt"] = reg.record(
        "checkpoint",
        name="a/step_4",
        path=tmp_path / "runs" / "a" / "step_4",
        parent=ids["run_a"],
        weights_hash="b" * 64,
        metrics={"step": 4},
    )
    ids["adapter"] = reg.record(
        "adapter", name="a/step_4/adapter", parent=ids["ckpt"], weights_hash="c" * 64, base_hash="a" * 64
    )
    ids["eval"] = reg.record("eval", name="smoke", parent=ids["adapter"], metrics={"passed": 3, "failed": 1})
    reg.add_event(ids["run_a"], "monitor", {"passed": 2, "failed": 1}, step=2)
    cfg_b = {"optim": {"lr": 0.0003}, "finetune": {"lora_rank": 8}, "run": {"name": "b"}}
    ids["run_b"] = reg.record(
        "run",
        name="b",
        parent=ids["import"],
        config=cfg_b,
        data=data_fingerprint(data_b),
        code={"plait": "0.1.0", "git_commit": "c2"},
        status="finished",
    )
    return reg, ids


def render(fn, *args) -> str:
    console = Console(record=True, width=200)
    fn(*args, console)
    return console.export_text()


def test_show_draws_the_tree_back_to_the_import(family):
    reg, ids = family
    text = render(views.show, reg, reg.get(ids["eval"]))
    lines = text.splitlines()
    assert lines[0].startswith("import smol") and "from /models/smol-hf" in lines[0]
    order = [
        next(i for i, line in enumerate(lines) if key in line)
        for key in ("run a", "checkpoint a/step_4", "adapter a/step_4/adapter", "eval smoke", "run b")
    ]
    assert order == sorted(order[:4]) + [order[4]]  # nested chain, then the sibling run
    eval_line = next(line for line in lines if "eval smoke" in line)
    assert eval_line.rstrip().endswith("◀") and "passed 3, failed 1" in eval_line
    adapter_line = next(line for line in lines if "adapter a/" in line)
    assert f"base {'a' * 12} = {ids['import'][:8]}" in adapter_line  # the adapter's base, found by hash
    assert "monitors x1, last at step 2: 2 passed, 1 failed" in text


def test_diff_names_config_keys_data_parents_and_code(family):
    reg, ids = family
    rows = diff_rows(reg, reg.get(ids["run_a"]), reg.get(ids["run_b"]))
    keys = {(aspect, key) for aspect, key, *_ in rows}
    assert {("config", "optim.lr"), ("config", "run.name"), ("data", "fingerprint"), ("code", "git_commit")} <= keys
    assert ("config", "finetune.lora_rank") not in keys  # equal values are not differences
    assert ("data", "shards with other content") in keys
    common = next(r for r in rows if r[1] == "common ancestor")
    assert "import smol" in common[2]
    # A checkpoint inherits its run's config for the comparison; descent is reported.
    rows = diff_rows(reg, reg.get(ids["adapter"]), reg.get(ids["run_a"]))
    assert any(r[1] == "relation" and "descends from B (2 generations)" in r[2] for r in rows)
    assert not any(r[0] == "config" for r in rows)


def test_lookups_by_id_prefix_path_hash_and_name(family, tmp_path):
    reg, ids = family
    assert reg.find(ids["ckpt"][:6]).id == ids["ckpt"]
    assert reg.find(str(tmp_path / "runs" / "a")).id == ids["run_a"]
    assert reg.find("b" * 8).id == ids["ckpt"]
    assert reg.find("a").id == ids["run_a"]
    with pytest.raises(PlaitError, match="nothing named 'zzz' in the lineage registry"):
        reg.find("zzz")
    assert find_registry(tmp_path / "runs" / "a" / "step_4") == tmp_path / "runs" / "lineage.sqlite"
    # a directory holding recorded artifacts (a run directory after `plait ckpt import --out runs/x`, whose
    # checkpoint is runs/x/checkpoints/step_00000000): its newest one
    imported = reg.record("import", name="x", path=tmp_path / "runs" / "x" / "checkpoints" / "step_00000000")
    assert reg.find(str(tmp_path / "runs" / "x")).id == imported
    assert reg.newest_under(tmp_path / "runs" / "x" / "checkpoints").id == imported
    assert reg.newest_under(tmp_path / "runs" / "xy") is None  # a prefix of the name is not the directory


def test_lineage_cli(family, tmp_path, capsys):
    reg, ids = family
    assert main(["lineage", "show", ids["adapter"][:8], "--registry", str(reg.path)]) == 0
    out = capsys.readouterr().out
    assert "import smol" in out and "◀" in out
    assert main(["lineage", "diff", "a", "b", "--registry", str(reg.path)]) == 0
    assert "optim.lr" in capsys.readouterr().out
    assert main(["lineage", "list", "--kind", "run", "--registry", str(reg.path)]) == 0
    assert main(["lineage", "show", "nope", "--registry", str(reg.path)]) == 2
    assert "nothing named 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_hash_is_taken_from_shards_and_is_layout_independent(tmp_path):
    """The weights hash of a save comes from the shards each rank holds (no read-back, nothing gathered) and
    equals the hash of the same weights loaded whole in one process, under FSDP and under TP."""
    from parallel_harness import run_layouts
    from plait.data import ensure_prepared
    from plait.engine.checkpoint import list_checkpoints, read_meta
    from plait.lifecycle.lora import model_weights_hash, weights_hash
    from plait.lifecycle.models import load_model

    data = ensure_prepared("shakespeare", tmp_path / "cache", 4096)
    base = [
        "model.preset=debug",
        f"data.source={data}",
        "data.seq_len=32",
        "train.global_batch_size=4",
        "train.steps=3",
        "eval.every_steps=0",
        "sample.max_new_tokens=0",
        "log.tensorboard=false",
        "log.plot=false",
        "checkpoint.every_steps=2",
    ]
    layouts = {"fsdp": ["parallel.dp_shard_degree=2"], "tp": ["parallel.tp_degree=2"]}
    jobs = [[*base, *extra, f"checkpoint.dir={tmp_path / name}"] for name, extra in layouts.items()]
    run_layouts(2, jobs)
    for name in layouts:
        ckpts = list_checkpoints(tmp_path / name)
        assert [c.name for c in ckpts] == ["step_00000002", "step_00000003"], name
        for ckpt in ckpts:
            recorded = read_meta(ckpt)["weights_hash"]
            model = load_model(ckpt).model  # whole, in one process
            whole = {n: p.detach() for n, p in model.named_parameters()}
            assert recorded == model_weights_hash(model) == weights_hash(whole), (name, ckpt.name)


def test_a_base_checkpoint_is_kept_by_retention_while_something_is_made_from_it(data_dir, tmp_path, capsys):
    """An adapter and a fine-tune made from a training run's step-4 checkpoint pin it: that run's keep_last=1
    retention keeps it (saying so, naming them) and `plait lineage pins` lists it; a run resuming its own
    checkpoint pins nothing. Deleted by hand anyway, the error says what happened and what to do."""
    import shutil

    from plait.api import train
    from plait.config import load_config
    from plait.engine.checkpoint import list_checkpoints, resolve_checkpoint
    from runs import debug_run

    def base(steps: int):
        settings = debug_run(data_dir, tmp_path, "base", steps, "checkpoint.every_steps=2", "checkpoint.keep_last=1")
        train(load_config(None, settings))

    base(4)
    ckpts = tmp_path / "base" / "checkpoints"
    step4 = ckpts / "step_00000004"
    assert [c.name for c in list_checkpoints(ckpts)] == [step4.name]
    reg = Registry(tmp_path / "reg.sqlite")
    ckpt = reg.record("checkpoint", name="base/step_00000004", path=step4)
    reg.record("adapter", name="sft-1", path=tmp_path / "sft-1.safetensors", parent=ckpt)
    reg.record("run", name="ft", path=tmp_path / "ft", parent=ckpt, config={"finetune": {"init_from": str(step4)}})
    reg.record("run", name="base", path=tmp_path / "base", parent=ckpt, config={"finetune": {"init_from": ""}})
    assert len(list((ckpts / "pins").iterdir())) == 2
    capsys.readouterr()
    base(8)
    assert [c.name for c in list_checkpoints(ckpts)] == [step4.name, "step_00000008"]
    err = " ".join(capsys.readouterr().err.split())
    said = err[err.index(f"checkpoint {step4} kept past checkpoint.keep_last: ") :]  # dependents in pin order
    assert "adapter sft-1" in said and "run ft" in said, err
    assert err.count("kept past checkpoint.keep_last") == 1  # said once, not at every save
    assert main(["lineage", "pins", "--registry", str(reg.path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    listed = out[out.index(f"{step4}: kept for ") :]
    assert "adapter sft-1" in listed and "run ft" in listed, out
    shutil.rmtree(step4)
    with pytest.raises(PlaitError) as e:
        resolve_checkpoint(step4)
    text = str(e.value)
    assert "does not exist (any more)" in text and "step_00000008" in text and "retention" in text, text
