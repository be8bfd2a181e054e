"""RETRO's model (model.retrieval_layers, plait.model.retrieval): chunked cross-attention keeps causality at
chunk granularity (a chunk's neighbours reach only the tokens from its last one on), the neighbours change
what the model computes, the parameter count from the shape is the model's, and its FLOPs are counted."""

from __future__ import annotations

import re

import torch

from plait.model.args import ModelArgs
from plait.model.llama import Transformer

C, K = 4, 2
ARGS = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, retrieval_layers="1,2",
            retrieval_chunk=C, retrieval_k=K, retrieval_encoder_layers=1)  # fmt: skip


def model(**overrides) -> Transformer:
    """A retrieval model with its cross-attention switched on: its gates start at zero (so a retrieval model
    starts as the plain one: checked here), here opened."""
    with torch.device("meta"):
        m = Transformer(ModelArgs(**{**ARGS, **overrides}))
    m.to_empty(device="cpu")
    m.init_weights(0)
    gates = [block.cross.gate for block in m.layers.values() if block.cross is not None]
    assert gates and all(torch.equal(g.weight, torch.zeros(1)) for g in gates)
    with torch.no_grad():
        for g in gates:
            g.weight.fill_(1.0)
    return m.eval()


def packed(tokens: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    return torch.cat([tokens, neighbours.flatten(1)], dim=1)


def test_a_chunks_neighbours_reach_only_the_tokens_from_its_last_one_on():
    torch.manual_seed(0)
    m = model()
    T = 16
    tokens = torch.randint(0, 64, (2, T))
    neighbours = torch.randint(0, 64, (2, T // C, K, 2 * C))
    base = m(packed(tokens, neighbours))
    for u in range(T // C):
        other = neighbours.clone()
        other[:, u] = torch.randint(0, 64, other[:, u].shape)
        changed = (m(packed(tokens, other)) - base).abs().amax(dim=(0, 2)) > 1e-6
        first = (u + 1) * C - 1  # the chunk's last token: the first that may see its neighbours
        assert not changed[:first].any(), (u, changed)
        assert changed[first:].all(), (u, changed)  # later blocks carry it on to every later token


def test_each_token_meets_the_neighbour_token_it_predicts_one_position_on():
    """Relative positions in chunked cross-attention (RETRO's): a neighbour's tokens sit at 0 .. 2c - 1 and the
    tokens that see chunk u at c - 1 .. 2c - 2, so offset j of the group lines up with neighbour position
    c - 1 + j, the one before the continuation token c + j it predicts. Held with queries and keys of the same
    content everywhere (only position tells them apart) and values that name their position: each token's
    output is the value of neighbour position c - 1 + j in every neighbour."""
    from plait.model.retrieval import ChunkedCrossAttention
    from plait.model.rope import rope_tables

    args = ModelArgs(**{**ARGS, "dim": 16, "n_heads": 1, "n_kv_heads": 1, "attention_head_dim": 8})
    cross = ChunkedCrossAttention(args)
    eye = torch.eye(8)
    with torch.no_grad():  # q, k from dims 0..7 (content), v from dims 8..15 (a position's code), back to 8..15
        cross.wq.weight.copy_(torch.cat([eye, torch.zeros(8, 8)], 1))
        cross.wk.weight.copy_(torch.cat([eye, torch.zeros(8, 8)], 1))
        cross.wv.weight.copy_(torch.cat([torch.zeros(8, 8), eye], 1))
        cross.wo.weight.copy_(torch.cat([torch.zeros(8, 8), eye], 0))
        cross.gate.weight.fill_(20.0)  # open: tanh(20) is 1 in fp32
    content = 30.0 * torch.ones(8)  # large: a softmax as sharp as an argmax
    code = torch.eye(8)  # neighbour position p's value: e_p (2c = 8 positions)
    T = 3 * C
    x = torch.cat([content, torch.zeros(8)]).expand(1, T, 16)
    memory = torch.cat([content.expand(2 * C, 8), code], 1).repeat(K, 1).expand(1, T // C, K * 2 * C, 16)
    cos, sin = rope_tables(args)
    out = cross(x, memory, cos[: 2 * C], sin[: 2 * C])[0, :, 8:]
    assert out[: C - 1].abs().max() == 0  # the first chunk's tokens before its last one see no neighbours
    for t in range(C - 1, T):
        j = (t + 1) % C  # offset of token t within the group that sees chunk (t + 1) // C - 1
        torch.testing.assert_close(out[t], code[C - 1 + j], atol=1e-3, rtol=0)


def test_a_retrieval_model_starts_as_the_same_model_without_retrieval():
    """Its gates start at zero (Flamingo's tanh gate): whatever its neighbours, a freshly initialised retrieval
    model computes what the plain model of the same seed computes, and it is the gates' gradient that opens
    them (the cross-attention's own weights get none until a gate moves)."""
    with torch.device("meta"):
        retro, plain = Transformer(ModelArgs(**ARGS)), Transformer(ModelArgs(**{**ARGS, "retrieval_layers": ""}))
    for m in (retro, plain):
        m.to_empty(device="cpu")
        m.init_weights(0)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    neighbours = torch.randint(0, 64, (2, 16 // C, K, 2 * C))
    torch.testing.assert_close(retro(packed(tokens, neighbours)), plain(tokens), rtol=0, atol=0)
    retro(packed(tokens, neighbours)).float().pow(2).mean().backward()
    block = retro.layers["1"]
    assert block.cross.gate.weight.grad.abs().item() > 0
    assert not block.cross.wq.weight.grad.any() and not block.cross.wo.weight.grad.any()


def test_the_shapes_parameters_and_flops_are_counted():
    m = model()
    args = m.args
    assert sum(p.numel() for p in m.parameters()) == args.num_params()
    plain = ModelArgs(**{**ARGS, "retrieval_layers": ""})
    assert args.num_params() > plain.num_params() and args.flops_per_token(16) > plain.flops_per_token(16)
    assert args.retrieval_ids == (1, 2) and plain.retrieval_ids == ()
    assert m.layers["0"].cross is None and m.layers["1"].cross is not None


def fused_head_matches(m, x, targets, logp) -> dict[str, torch.Tensor]:
    """The training loss through the fused head equals the summed -log-probability of the targets under `logp`
    (the forward's mixed distribution), and every parameter's gradient equals that reference's. Returns the fused
    loss's gradients by parameter name."""
    scored = targets != -100
    reference = -logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0][scored].sum()
    grads = torch.autograd.grad(reference, list(m.parameters()), allow_unused=True)
    fused = m(x, targets=targets)
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=0)
    got = torch.autograd.grad(fused, list(m.parameters()), allow_unused=True)
    names = [n for n, _ in m.named_parameters()]
    for name, g, w in zip(names, got, grads, strict=True):
        if w is None or not w.any():
            continue
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)
    return {name: g for name, g in zip(names, got, strict=True) if g is not None}


def test_the_neighbour_copy_through_the_fused_head_is_the_mixed_distribution():
    """model.retrieval_copy: the training loss through the fused head (a TokenMixture, no (B, T, vocab)
    logits) equals the mixed distribution's log-probabilities that generation samples from (the model's
    softmax mixed with the neighbours' unigram and bigram caches, built here by hand from the ids), and so do
    the gradients of every parameter, the shares' included. A freshly initialised copy mixes nothing."""
    torch.manual_seed(0)
    m = model(retrieval_copy=True)
    T = 16
    tokens = torch.randint(0, 12, (2, T))  # a small alphabet: the neighbours hold the tokens and their bigrams
    neighbours = torch.randint(0, 12, (2, T // C, K, 2 * C))
    targets = torch.roll(tokens, -1, 1)
    targets[0, 3] = -100  # an unscored token
    x = packed(tokens, neighbours)
    with torch.no_grad():
        plain = torch.log_softmax(Transformer.forward(m, x), -1)  # shares at 0: the model's own distribution
        torch.testing.assert_close(m(x), plain, rtol=0, atol=1e-6)
        m.neighbour_copy.weight.copy_(torch.tensor([0.15, 0.3]))
    logp = m(x)
    want = torch.zeros_like(logp)  # the mixture by hand
    for b in range(2):
        for t in range(T):
            p = plain[b, t].exp()
            u = (t + 1) // C - 1
            if u >= 0:
                seen = neighbours[b, u]
                uni = torch.bincount(seen.flatten(), minlength=64).float() / seen.numel()
                after = seen[:, 1:][seen[:, :-1] == tokens[b, t]]
                wb = 0.3 if len(after) else 0.0
                bi = torch.bincount(after, minlength=64).float() / max(len(after), 1)
                p = (1 - 0.15 - wb) * p + 0.15 * uni + wb * bi
            want[b, t] = p.log()
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)
    got = fused_head_matches(m, x, targets, logp)
    assert got["neighbour_copy.weight"].abs().min() > 0


def test_the_pointer_through_the_fused_head_is_the_mixed_distribution():
    """model.retrieval_pointer (with the copy, as the knowledge bench runs it): the training loss through the
    fused head equals the log-probabilities generation samples from, built here by hand: each token's share s
    of its pointer's attention over the neighbour tokens it sees, each placing its weight on that token's id;
    the gradients of every parameter agree. A neighbour token after a copy of the token itself gets the follow
    bonus. A fresh pointer mixes nothing; it is counted in the parameters."""
    torch.manual_seed(0)
    m = model(retrieval_copy=True, retrieval_pointer=True)
    assert sum(p.numel() for p in m.parameters()) == m.args.num_params()
    T = 16
    tokens = torch.randint(0, 12, (2, T))
    neighbours = torch.randint(0, 12, (2, T // C, K, 2 * C))
    targets = torch.roll(tokens, -1, 1)
    targets[1, 6] = -100
    x = packed(tokens, neighbours)
    pointer = m.neighbour_pointer
    with torch.no_grad():
        m.neighbour_copy.weight.copy_(torch.tensor([0.1, 0.2]))
        copied = m(x)  # the pointer's share at 0: the copy's distribution
        without = model(retrieval_copy=True)  # the same weights (seeded by name), no pointer
        without.neighbour_copy.weight.copy_(torch.tensor([0.1, 0.2]))
        torch.testing.assert_close(copied, without(x), rtol=0, atol=0)
        pointer.weight.fill_(0.6)
        pointer.follow.fill_(0.3)  # a bonus of 3 for the neighbour tokens after a copy of the token
    logp = m(x)
    want = pointer_by_hand(m, x, tokens, neighbours, copied, lambda scores, b, u: torch.softmax(scores, -1))
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)
    assert (logp - copied).abs().amax() > 0.01  # the pointer moves it
    got = fused_head_matches(m, x, targets, logp)
    for name in ("weight", "follow", "wq.weight", "wk.weight", "switch.weight"):
        assert got[f"neighbour_pointer.{name}"].abs().amax() > 0, name


def pointer_by_hand(m, x, tokens, neighbours, copied, attend) -> torch.Tensor:
    """The opened pointer's (share 0.6 x its switch, follow bonus 3) mixed log-probabilities built by hand, token
    by token, over `copied` (the distribution without it): each token's scores over the k 2c neighbour tokens it
    sees (q . k / sqrt(d) plus the bonus after a copy of itself) turned into an attention by attend(scores, b,
    u), its weight placed on each token's id."""
    pointer, hidden = m.neighbour_pointer, {}
    m.norm.register_forward_hook(lambda mod, args, out: hidden.update(h=out.detach()))
    m(x)
    memory = m.embed_retrieved(x)[2].detach()
    want, d = copied.detach().clone(), ARGS["dim"] // ARGS["n_heads"]
    with torch.no_grad():
        for b in range(tokens.shape[0]):
            for t in range(C - 1, tokens.shape[1]):
                u = (t + 1) // C - 1
                q, keys = pointer.wq(hidden["h"][b, t]), pointer.wk(memory[b, u])
                before = torch.cat([torch.full((K, 1), -1), neighbours[b, u][:, :-1]], 1).flatten()
                attention = attend(keys @ q / d**0.5 + 3.0 * (before == tokens[b, t]), b, u)
                share = 0.6 * torch.sigmoid(pointer.switch(hidden["h"][b, t]))
                pointed = torch.zeros(64).index_add_(0, neighbours[b, u].flatten(), attention)
                want[b, t] = ((1 - share) * copied[b, t].exp() + share * pointed).log()
    return want


def _opened_pointer():
    """(the pointer model of the fused-head test, opened: copy shares 0.1 and 0.2, pointer share 0.6 and follow
    bonus 3; its batch and targets), the same on every rank."""
    torch.manual_seed(0)
    m = model(retrieval_copy=True, retrieval_pointer=True)
    with torch.no_grad():
        m.neighbour_copy.weight.copy_(torch.tensor([0.1, 0.2]))
        m.neighbour_pointer.weight.fill_(0.6)
        m.neighbour_pointer.follow.fill_(0.3)
    tokens, neighbours = torch.randint(0, 12, (2, 16)), torch.randint(0, 12, (2, 16 // C, K, 2 * C))
    targets = torch.roll(tokens, -1, 1)
    return m, packed(tokens, neighbours), targets


def _pointer_under_tp(rank: int, world: int, port: int) -> None:
    """Rank `rank` of TP `world`: the opened pointer model's loss and every parameter's gradient equal one
    process's (each rank computes the reference too)."""
    join_as_rank(rank, world, port)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from plait.model.retrieval import whole
    from plait.parallel.head import apply_head
    from plait.parallel.tensor_parallel import apply_tp

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ref, x, targets = _opened_pointer()
    want = ref(x, targets=targets)
    want.backward()
    m, _, _ = _opened_pointer()
    apply_tp(m, init_device_mesh("cpu", (world,)))
    apply_head(m, init_device_mesh("cpu", (world,)), chunk=1024, compiled=False, in_place=False)
    got = m(x, targets=targets)
    got.backward()
    torch.testing.assert_close(whole(got), want, rtol=1e-5, atol=0)
    for (name, p), (_, r) in zip(m.named_parameters(), ref.named_parameters(), strict=True):
        if r.grad is not None:
            torch.testing.assert_close(whole(p.grad), r.grad, rtol=1e-4, atol=1e-6, msg=name)
    dist.destroy_process_group()


def test_the_pointer_under_tensor_parallelism_takes_the_one_process_gradients():
    """TP 2 (sequence parallel) with the pointer open: the loss and every parameter's gradient, the pointer's
    included (computed whole on each tp rank: a gradient added once, not once per rank), equal one process's."""
    run_ranks(_pointer_under_tp, (2, free_port()), 2)


# ------------------------------------------------------------------------------------------- training

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from parallel_harness import free_port, join_as_rank, read_metrics, run_layouts, run_ranks  # noqa: E402
from test_parallel import GRAD_NORM_RTOL, LOSS_RTOL  # noqa: E402

RETRO = [
    "model.retrieval_layers=1",
    "model.retrieval_chunk=8",
    "model.retrieval_k=2",
    "model.retrieval_encoder_layers=1",
    "model.retrieval_copy=true",  # the copy from the neighbours too, through every layout's head
]


@pytest.fixture(scope="module")
def retro_data(tmp_path_factory, data_dir) -> Path:
    """Speeches of the bundled text, prepared, with a retrieval database of 8-token chunks (k = 2) built by a
    debug model trained a few steps on them."""
    pytest.importorskip("faiss")
    from plait.api import train
    from plait.config import load_config
    from plait.data.loader import read_manifest
    from plait.data.retrieval import build_database
    from plait.lifecycle.retrieval import load_encoder
    from runs import debug_run, prepared_speeches

    root = tmp_path_factory.mktemp("retro")
    prepared_speeches(root, 3000, Path(data_dir) / "tokenizer.json")
    train(load_config(None, debug_run(root / "data", root, "encoder", 10)))
    encode, described = load_encoder(str(root / "encoder"), read_manifest(root / "data"))
    build_database(root / "data", encode, encoder=described, chunk=8, k=2)
    return root / "data"


def job(data: Path, out: Path, name: str, *extra: str) -> list[str]:
    from runs import debug_run

    return [*debug_run(data, out, name, 6, "eval.every_steps=3", "eval.num_batches=2", "checkpoint.every_steps=3"),
            *RETRO, *extra]  # fmt: skip


def trains_and_resumes_bitwise(data: Path, tmp_path: Path, *extra: str) -> dict:
    """One process's run ("ref", 6 steps with validation), and its copy cut back to step 3 and resumed: checked
    to end bitwise as the uninterrupted run. Returns ref's metrics."""
    from plait.api import train
    from plait.config import load_config

    train(load_config(None, job(data, tmp_path, "ref", *extra)))
    ref = read_metrics(tmp_path / "ref")
    assert len(ref["loss"]) == 6 and ref["loss"][6] < ref["loss"][1] and ref["val_loss"]
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ref", cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "metrics.jsonl").write_text(
        "".join(
            line + "\n"
            for line in (cut / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("step", 0) <= 3
        )
    )
    train(load_config(None, job(data, tmp_path, "cut", *extra)))
    resumed = read_metrics(cut)
    assert resumed["loss"] == ref["loss"] and resumed["val_loss"] == ref["val_loss"]  # bitwise
    return ref


def equal_one_process(ref: dict, layouts: dict[str, list[str]], results: list[dict]) -> None:
    """Each layout's losses and gradient norms equal one process's within test_parallel's tolerances."""
    for name, got in zip(layouts, results, strict=True):
        assert "error" not in got, (name, got.get("error"))
        resumed = "resuming" in name
        assert sorted(got["loss"]) == ([4, 5, 6] if resumed else sorted(ref["loss"])), (name, got["loss"])
        for step in got["loss"]:
            loss = ref["loss"][step]
            assert got["loss"][step] == pytest.approx(loss, rel=LOSS_RTOL), (name, step)
            assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=GRAD_NORM_RTOL), (name, step)


@pytest.mark.slow
def test_a_retrieval_model_trains_resumes_bitwise_and_every_layout_equals_one_process(retro_data, tmp_path):
    """One process, 6 steps with validation; resumed from its step-3 checkpoint it ends bitwise as the
    uninterrupted run; FSDP 2, DDP 2 with full activation checkpointing, TP 2 (sequence parallel: the encoder and
    the cross-attention split too) and FSDP 2 with selective checkpointing and compiled blocks equal one process
    within test_parallel's tolerances, and so does TP 2 resuming the one-process run's step-3 checkpoint."""

    ref = trains_and_resumes_bitwise(retro_data, tmp_path)
    from plait.cli import main

    assert main(["eval", str(tmp_path / "ref"), "--seq-len", "32", "--batches", "2"]) == 0  # with its neighbours
    assert main(["ckpt", "export", str(tmp_path / "ref"), "--out", str(tmp_path / "hf")]) == 2  # no HF format
    base = [c for c in job(retro_data, tmp_path, "x") if not c.startswith("run.")]
    layouts = {
        "FSDP 2": ["parallel.dp_shard_degree=2"],
        "DDP 2, full AC": ["parallel.dp_replicate_degree=2", "parallel.activation_checkpoint=full"],
        "TP 2 (sequence parallel)": ["parallel.tp_degree=2"],
        "FSDP 2, selective AC, compiled blocks": [
            "parallel.dp_shard_degree=2",
            "parallel.activation_checkpoint=selective",
            "compile.enabled=true",
            "compile.strict=true",
        ],
    }
    other = tmp_path / "other-layout"
    shutil.copytree(tmp_path / "ref" / "checkpoints", other)
    shutil.rmtree(other / "step_00000006")
    layouts["TP 2, resuming one process's step 3"] = [  # the reference run's checkpoints, continued on purpose
        "parallel.tp_degree=2", f"checkpoint.dir={other}", "checkpoint.adopt=true",
    ]  # fmt: skip
    equal_one_process(ref, layouts, run_layouts(2, [[*base, *extra] for extra in layouts.values()]))


@pytest.mark.slow
def test_the_pointer_trains_resumes_bitwise_and_every_layout_equals_one_process(retro_data, tmp_path):
    """model.retrieval_pointer (with the copy): one process resumes bitwise from its step-3 checkpoint; FSDP 2,
    DDP 2 and TP 2 (sequence parallel: the pointer computed whole on each tp rank) equal one process within
    test_parallel's tolerances, the pointer's loss through each layout's head."""
    pointer = "model.retrieval_pointer=true"
    ref = trains_and_resumes_bitwise(retro_data, tmp_path, pointer)
    base = [c for c in job(retro_data, tmp_path, "x", pointer) if not c.startswith("run.")]
    layouts = {"FSDP 2": ["parallel.dp_shard_degree=2"], "DDP 2": ["parallel.dp_replicate_degree=2"],
               "TP 2 (sequence parallel)": ["parallel.tp_degree=2"]}  # fmt: skip
    equal_one_process(ref, layouts, run_layouts(2, [[*base, *extra] for extra in layouts.values()]))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["parallel.pp_degree=2"], "retrieval_layers with parallel.pp_degree=2 is not supported yet"),
        (["parallel.cp_degree=2"], "retrieval_layers with parallel.cp_degree=2 is not supported yet"),
        (
            ["parallel.tp_degree=8", "model.retrieval_chunk=2", "model.n_heads=8", "model.n_kv_heads=8"],
            "parallel.tp_degree=8 must divide a neighbour's 2 x model.retrieval_chunk=4 tokens",
        ),
        (["data.seq_len=30"], "not a multiple of model.retrieval_chunk=8"),
        (["model.retrieval_layers=9"], "must name blocks 0 to"),
        (["model.retrieval_layers="], "model.retrieval_copy=true copies from the neighbours of a retrieval model"),
        (
            ["model.retrieval_layers=", "model.retrieval_copy=false", "model.retrieval_pointer=true"],
            "model.retrieval_pointer=true copies from the neighbours of a retrieval model",
        ),
    ],
)
def test_what_a_retrieval_model_cannot_take_is_refused(extra, message):
    from plait.config import load_config
    from plait.core.errors import ConfigError
    from plait.parallel import ParallelDims, validate_layout

    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = load_config(None, ["model.preset=debug", "data.seq_len=32", *RETRO, *extra])
        world = cfg.parallel.tp_degree * cfg.parallel.pp_degree * cfg.parallel.cp_degree
        validate_layout(cfg, ParallelDims.from_config(cfg.parallel, world, cfg.model))


def test_a_retrieval_model_generates_with_the_neighbours_of_each_chunk(retro_data, tmp_path, capsys):
    """plait generate with a retrieval model: each complete chunk's neighbours come from the database it trained
    with (printed with --show-neighbours); greedy decoding is the choice of one forward of the whole text with
    every chunk's neighbours, as training sees it (so a token is conditioned on the chunks that end at or before
    it, and on no later one), and it repeats itself."""
    import numpy as np
    import torch

    from plait.api import train
    from plait.cli import main
    from plait.config import load_config
    from plait.engine.generate import generate, load_for_generation
    from plait.lifecycle.retrieval import checkpoint_retriever

    run = tmp_path / "gen"
    capsys.readouterr()
    train(load_config(None, job(retro_data, tmp_path, "gen", "sample.max_new_tokens=12", "sample.prompt=ROMEO:")))
    sample = capsys.readouterr().out  # the end of training samples with the database's neighbours too
    assert "ROMEO:" in sample and sample.split("ROMEO:", 1)[1].strip(), sample[-2000:]
    model, tok, _ = load_for_generation(run, "cpu")
    prompt, c, k = tok.encode("ROMEO:").ids, model.args.retrieval_chunk, model.args.retrieval_k
    new = next(n for n in range(20, 20 + c) if (len(prompt) + n) % c >= 2)  # the last tokens inside a chunk
    greedy = ["--prompt", "ROMEO:", "--max-new-tokens", str(new), "--temperature", "0"]
    assert main(["generate", str(run), *greedy, "--show-neighbours"]) == 0
    printed = capsys.readouterr().out
    assert "chunk 0" in printed and "chunk 1" in printed and "database chunk" in printed
    retrieve, used = checkpoint_retriever(str(run), model, "", "cpu"), []
    out = generate(model, [prompt], max_new_tokens=new, temperature=0, retrieve=retrieve, used=used)[0]
    assert tok.decode(out) in printed and len(out) % c >= 2  # the command's text
    chunks = len(out) // c
    assert [chunk for _, chunk, _ in used] == list(range(chunks))
    ids, tokens = retrieve(np.array(out[: chunks * c]).reshape(chunks, c))
    assert all((found == ids[chunk]).all() for _, chunk, found in used)
    padded = -(-len(out) // c) * c
    x = torch.zeros(1, padded + padded // c * k * 2 * c, dtype=torch.long)
    x[0, : len(out)] = torch.tensor(out)
    x[0, padded : padded + chunks * k * 2 * c] = torch.from_numpy(tokens.reshape(-1))
    with torch.no_grad():
        choice = model(x)[0, : len(out) - 1].argmax(-1).tolist()
    assert choice[len(prompt) - 1 :] == out[len(prompt) :]
    assert generate(model, [prompt], max_new_tokens=new, temperature=0, retrieve=retrieve)[0] == out
    # lineage: the run records the database it trained with; an export carries a pointer to it
    from plait.data.retrieval import read_database
    from plait.lifecycle.lineage import REGISTRY_FILE, Registry

    db = read_database(retro_data)
    recorded = Registry(tmp_path / REGISTRY_FILE).by_path(run, kinds=("run",)).data["retrieval"]
    assert recorded["present"] and recorded["corpus"] == db["corpus"] and recorded["encoder"] == db["encoder"]
    assert main(["ckpt", "export", str(run), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    pointer = json.loads((tmp_path / "st" / "model.retrieval.json").read_text())
    assert pointer["manifest_sha256"] == recorded["manifest_sha256"] and pointer["chunk"] == c
