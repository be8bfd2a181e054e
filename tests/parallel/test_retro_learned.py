"""The retriever that learns (model.retrieval_learned; plait.model.retrieval_learned, plait.data.retrieval_live,
plait.engine.retrieval_refresh): the pointer's likelihood is marginalised over the neighbours with the learned
encoder's prior (checked against a hand-built mixture, gradients included), the encoder starts as the database's
lexical one (the same embeddings and the same neighbours as the built database), a run refreshes its index in
the background, resumes bitwise across a pending refresh, and every layout retrieval takes equals one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel_harness import read_metrics, run_layouts
from test_parallel import GRAD_NORM_RTOL, LOSS_RTOL
from test_retro import C, K, fused_head_matches, model, packed, pointer_by_hand

DIM = 8  # the learned table's width in the model tests


def _bag(chunk: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A chunk's embedding by hand: each distinct token once, weighted log(1 + its count), normalised."""
    ids, counts = chunk.unique(return_counts=True)
    v = (torch.log1p(counts.float())[:, None] * table[ids]).sum(0)
    return v / v.norm()


def test_the_learned_prior_marginalises_the_pointer_over_the_neighbours():
    """The pointer's distribution with a learned retriever is sum_z p(z | x) x its attention within neighbour z,
    p(z | x) the softmax of 10 e^w times the cosines of the chunk's and each neighbour's bag of table rows (built
    here by hand); the loss through the fused head and every gradient, the table's and the scale's included,
    agree with it; the table is counted in the parameters."""
    torch.manual_seed(0)
    m = model(retrieval_copy=True, retrieval_pointer=True, retrieval_learned=True, retrieval_dim=DIM)
    assert sum(p.numel() for p in m.parameters()) == m.args.num_params()
    T = 16
    tokens, neighbours = torch.randint(0, 12, (2, T)), torch.randint(0, 12, (2, T // C, K, 2 * C))
    targets = torch.roll(tokens, -1, 1)
    x = packed(tokens, neighbours)
    pointer, r = m.neighbour_pointer, m.neighbour_pointer.retriever
    with torch.no_grad():
        m.neighbour_copy.weight.copy_(torch.tensor([0.1, 0.2]))
        copied = m(x)  # the pointer's share at 0: the copy's distribution
        pointer.weight.fill_(0.6)
        pointer.follow.fill_(0.3)
        r.scale.fill_(0.2)
    logp = m(x)

    def marginal(scores: torch.Tensor, b: int, u: int) -> torch.Tensor:
        query = _bag(tokens[b, u * C : (u + 1) * C], r.table)
        cosines = torch.stack([_bag(neighbours[b, u, z, :C], r.table) @ query for z in range(K)])
        prior = torch.softmax(10 * np.exp(0.2) * cosines, 0)
        return (prior[:, None] * torch.softmax(scores.view(K, 2 * C), -1)).flatten()

    want = pointer_by_hand(m, x, tokens, neighbours, copied, marginal)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)
    got = fused_head_matches(m, x, targets, logp)
    for name in ("retriever.table", "retriever.scale"):
        assert got[f"neighbour_pointer.{name}"].abs().amax() > 0, name


# ------------------------------------------------------------------------------------------- with data

LEARNED = [
    "model.retrieval_layers=1", "model.retrieval_chunk=8", "model.retrieval_k=2",
    "model.retrieval_encoder_layers=1", "model.retrieval_copy=true", "model.retrieval_pointer=true",
    "model.retrieval_learned=true", "model.retrieval_dim=32", "model.retrieval_refresh_steps=3",
]  # fmt: skip


@pytest.fixture(scope="module")
def lexical_data(tmp_path_factory, data_dir) -> Path:
    """Speeches of the bundled text with a lexical database of 8-token chunks, k 2, 32 dimensions."""
    pytest.importorskip("faiss")
    from plait.cli import main
    from runs import prepared_speeches

    data = prepared_speeches(tmp_path_factory.mktemp("learned"), 3000, Path(data_dir) / "tokenizer.json")
    assert main(["data", "retrieve", str(data), "--encoder", "lexical", "--chunk", "8", "--k", "2", "--dim", "32"]) == 0
    return data


def test_the_learned_retriever_starts_as_the_lexical_one(lexical_data):
    """The lexical table (idf x the projection) in the learned encoder embeds every chunk as the lexical encoder
    does, and the live index built with it finds the built database's neighbours."""
    from plait.data.lexical import lexical_encoder, lexical_table
    from plait.data.retrieval import chunk_split, neighbours, read_database
    from plait.data.retrieval_live import LiveIndex, embed_chunks

    db = read_database(lexical_data)
    table = lexical_table(lexical_data, 8, 32)
    chunks = chunk_split(lexical_data, "train", 8).tokens
    encode, _ = lexical_encoder(lexical_data, 8, 32)
    np.testing.assert_allclose(embed_chunks(chunks, table), encode(chunks), rtol=0, atol=2e-6)
    live = LiveIndex(lexical_data, db, chunk=8, k=2)
    live.start(0, table)
    for split in ("train", "val"):
        built = neighbours(lexical_data, split, db)
        found = live.neighbours(split, 0, len(built))
        same = (found == built).all(1).mean()
        assert same > 0.995, (split, same)  # the rest: ties of equal cosines, ordered by float rounding
    live.close()


def test_the_learned_retriever_starts_as_the_lexical_one_over_another_corpus(lexical_data, tmp_path, data_dir):
    """With a database of other text (`plait data retrieve DATA --database OTHER`) the live index searches OTHER's
    chunks, with OTHER's lexical table, for DATA's chunks (none left out), and finds the neighbours the command
    found."""
    from plait.cli import main
    from plait.data.lexical import lexical_table
    from plait.data.retrieval import neighbours, read_database
    from plait.data.retrieval_live import LiveIndex
    from runs import prepared_speeches

    data = prepared_speeches(tmp_path, 400, Path(data_dir) / "tokenizer.json")
    assert main(["data", "retrieve", str(data), "--database", str(lexical_data)]) == 0
    db = read_database(data)
    live = LiveIndex(data, db, chunk=8, k=2)
    assert live.home == lexical_data and not live.own
    live.start(0, lexical_table(lexical_data, 8, 32))
    for split in ("train", "val"):
        built = neighbours(data, split, db)
        assert (live.neighbours(split, 0, len(built)) == built).all(1).mean() > 0.995, split
    live.close()


def job(data: Path, out: Path, name: str, *extra: str) -> list[str]:
    from runs import debug_run

    return [*debug_run(data, out, name, 6, "eval.every_steps=3", "eval.num_batches=2", "checkpoint.every_steps=3"),
            *LEARNED, *extra]  # fmt: skip


@pytest.mark.slow
def test_the_learned_retriever_refreshes_resumes_bitwise_and_every_layout_equals_one_process(lexical_data, tmp_path):
    """6 steps, the index refreshed every 3 (snapshots at steps 3 and 6, the first searched from step 4): the
    table moves, the step-3 checkpoint holds the pending snapshot, and the run resumed from it ends bitwise as
    the uninterrupted one; FSDP 2, DDP 2 and TP 2 equal one process within test_parallel's tolerances; `plait
    eval` scores the checkpoint with its own encoder's neighbours."""
    from plait.api import train
    from plait.cli import main
    from plait.config import load_config
    from plait.data.lexical import lexical_table
    from plait.engine.checkpoint import resolve_checkpoint
    from plait.engine.generate import load_for_generation

    train(load_config(None, job(lexical_data, tmp_path, "ref")))
    ref = read_metrics(tmp_path / "ref")
    model, _, _ = load_for_generation(resolve_checkpoint(tmp_path / "ref" / "checkpoints" / "step_00000003"))
    r = model.neighbour_pointer.retriever
    assert r.index_steps.tolist() == [0, 3]  # the index of the start, the step-3 snapshot pending
    lexical, start = torch.from_numpy(lexical_table(lexical_data, 8, 32)), torch.zeros_like(r.table)
    start[: len(lexical)] = lexical
    torch.testing.assert_close(r.index_table, start)
    assert (r.pending_table - start).abs().amax() > 1e-4  # trained for 3 steps
    from plait.data.retrieval import read_database
    from plait.data.retrieval_live import LiveIndex

    live = LiveIndex(lexical_data, read_database(lexical_data), chunk=8, k=2)
    found = []
    for step, table in ((0, r.index_table), (3, r.pending_table)):
        live.start(step, table.numpy())
        found.append(live.neighbours("train", 0, 4000))
    assert (found[0] != found[1]).any(1).mean() > 0.01  # the refresh finds other neighbours (2.5% of chunks)
    live.close()
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ref", cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "metrics.jsonl").write_text(
        "".join(l + "\n" for l in (cut / "metrics.jsonl").read_text().splitlines() if json.loads(l).get("step", 0) <= 3)
    )
    train(load_config(None, job(lexical_data, tmp_path, "cut")))
    resumed = read_metrics(cut)
    assert resumed["loss"] == ref["loss"] and resumed["val_loss"] == ref["val_loss"]  # bitwise
    assert main(["eval", str(tmp_path / "ref"), "--seq-len", "32", "--batches", "2"]) == 0
    base = [c for c in job(lexical_data, tmp_path, "x") if not c.startswith("run.")]
    layouts = {"FSDP 2": ["parallel.dp_shard_degree=2"], "DDP 2": ["parallel.dp_replicate_degree=2"],
               "TP 2 (sequence parallel)": ["parallel.tp_degree=2"]}  # fmt: skip
    results = run_layouts(2, [[*base, *extra] for extra in layouts.values()])
    for name, got in zip(layouts, results, strict=True):
        assert "error" not in got, (name, got.get("error"))
        for step in ref["loss"]:
            assert got["loss"][step] == pytest.approx(ref["loss"][step], rel=LOSS_RTOL), (name, step)
            assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=GRAD_NORM_RTOL), (name, step)


@pytest.mark.parametrize(
    "change,message",
    [
        (["model.retrieval_pointer=false"], "set model.retrieval_pointer=true too"),
        (["model.retrieval_refresh_steps=0"], "model.retrieval_refresh_steps"),
        (["model.retrieval_dim=0"], "model.retrieval_dim"),
        (["model.retrieval_dim=16"], "model.retrieval_dim=16, but the lexical database of"),
        (["model.retrieval_layers="], "model.retrieval_copy=true copies from the neighbours"),
        (["model.retrieval_learned=false"], "model.retrieval_dim=32 sets the learned retriever, which is off"),
    ],
)
def test_what_the_learned_retriever_cannot_take_is_refused(lexical_data, tmp_path, capsys, change, message):
    """Refused before training, exit 2, one line that names the setting."""
    from plait.cli import main

    settings = [f"--{c}" for c in job(lexical_data, tmp_path, "bad", *change)]
    assert main(["train", *settings]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(message in line for line in err), err
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_database_of_another_encoder_is_refused_for_the_learned_retriever(lexical_data, tmp_path, capsys):
    """The learned encoder starts as the lexical one: a database built with a model's encoder is refused by name."""
    from plait.cli import main

    other = tmp_path / "data"
    shutil.copytree(lexical_data, other)
    manifest = other / "retrieval" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["encoder"] = {"path": "/models/encoder", "kind": "checkpoint", "weights_hash": "0" * 64, "dim": 32}
    manifest.write_text(json.dumps(record))
    assert main(["train", *[f"--{c}" for c in job(other, tmp_path, "bad")]]) == 2
    err = capsys.readouterr().err
    assert "starts from the database's lexical encoder" in err and "/models/encoder" in err, err
