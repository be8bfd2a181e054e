"""Document masking (data.document_mask): each document of a packed sequence is attended alone, its positions
from 0. The masked model's logits for a packed row equal each document run alone (fp32); a run with it
differs from one without on a corpus of short documents; every layout (DDP, FSDP, TP+SP, CP's ring, EP, PP,
compiled, and CP with each of the others) equals one process within test_parallel's tolerances; a model of
your own is refused, naming why."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from parallel_harness import read_metrics, run_layouts
from plait.config import load_config
from plait.core.errors import ConfigError
from plait.model.args import ModelArgs
from plait.model.llama import Transformer, document_ids, document_positions
from test_parallel import GRAD_NORM_RTOL, LOSS_RTOL, base


def model(**overrides) -> Transformer:
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    with torch.device("meta"):
        m = Transformer(ModelArgs(**{**args, **overrides}))
    m.to_empty(device="cpu")
    m.init_weights(0)
    return m


def test_ids_and_positions_restart_after_each_eos():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(tokens, 0)).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]


@pytest.mark.parametrize("overrides", [{}, dict(sliding_window=4), dict(qk_norm=True, n_kv_heads=1)])
def test_a_packed_row_equals_each_document_alone(overrides):
    torch.manual_seed(0)
    m = model(**overrides)
    docs = [torch.randint(1, 128, (n,)) for n in (5, 11, 1, 7)]
    for d in docs:
        d[-1] = 0  # each document ends with the EOS token
    packed = torch.cat(docs)[None]
    m.document_eos = 0
    masked = m(packed)
    m.document_eos = None
    alone = torch.cat([m(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)  # fp32: the same sums, other orders
    assert (m(packed) - alone).abs().max() > 1e-2  # unmasked, later documents see earlier ones


@pytest.mark.parametrize("overrides", [{}, dict(sliding_window=4)])
def test_the_block_sparse_path_equals_the_masked_one(monkeypatch, overrides):
    """Where flex_attention runs (CUDA, flex_runs), the model takes the documents' block mask instead of the
    (B, 1, T, T) one: the same logits. Forward on the CPU (flex_attention has no CPU backward); the GPU
    sessions run it with its backward (bench/gpu_session.py)."""
    from plait.model import llama

    torch.manual_seed(0)
    m = model(**overrides)
    m.document_eos = 0
    tokens = torch.randint(1, 128, (2, 40))
    tokens[0, [4, 17, 18, 30]] = 0
    tokens[1, [9]] = 0
    with torch.no_grad():
        masked = m(tokens)
        monkeypatch.setattr(llama, "flex_runs", lambda device: True)
        assert isinstance(m.documents(tokens)[0], llama.BlockMask)
        block_sparse = m(tokens)
    torch.testing.assert_close(block_sparse, masked, rtol=1e-5, atol=1e-5)  # fp32: the same sums, other orders


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU sessions run it)")
def test_cuda_block_sparse_path_equals_the_masked_one_forward_and_backward(monkeypatch):
    """On CUDA the block-sparse path (flex_attention, compiled, with the documents' block mask): logits and
    every gradient equal the (B, 1, T, T) masked SDPA path's (fp32; 1e-4: the kernels sum in other orders).
    Its pass on a torch release is what FLEX_VERIFIED_ON_CUDA records."""
    from plait.model import llama

    torch.manual_seed(0)
    m = model().cuda()
    m.document_eos = 0
    tokens = torch.randint(1, 128, (2, 64), device="cuda")
    tokens[0, [4, 17, 18, 30, 50]] = 0
    tokens[1, [33]] = 0
    results = []
    for flex in (True, False):
        monkeypatch.setattr(llama, "flex_runs", lambda device, flex=flex: flex)
        m.zero_grad()
        logits = m(tokens)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in m.parameters()]))
    (flex_logits, flex_grads), (ref_logits, ref_grads) = results
    torch.testing.assert_close(flex_logits, ref_logits, rtol=1e-4, atol=1e-4)
    for got, want in zip(flex_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory, data_dir) -> Path:
    """The bundled corpus cut into its speeches (blank-line separated): short documents, each ending with EOS
    (~30 tokens: most 32-token windows hold a boundary), with the bundled tokenizer."""
    from plait.data.prepare import bundled_corpus_path, prepare

    root = tmp_path_factory.mktemp("docs")
    with gzip.open(bundled_corpus_path(), "rt") as f:
        text = json.loads(f.readline())["text"]
    speeches = [s for s in text.split("\n\n") if s.strip()][:4000]
    with open(root / "speeches.jsonl", "w") as f:
        for s in speeches:
            f.write(json.dumps({"text": s}) + "\n")
    prepare([root / "speeches.jsonl"], root / "prepared", tokenizer=Path(data_dir) / "tokenizer.json")
    return root / "prepared"


def job(short_docs: Path, *extra: str) -> list[str]:
    return [*(c for c in base(short_docs) if not c.startswith("data.source=")), f"data.source={short_docs}", *extra]


@pytest.fixture(scope="module")
def masked_reference(short_docs, tmp_path_factory):
    from plait.api import train

    out = tmp_path_factory.mktemp("ref")
    for name, mask in (("masked", "true"), ("plain", "false")):
        cfg = job(short_docs, f"data.document_mask={mask}", f"run.out_dir={out}", f"run.name={name}")
        train(load_config(None, cfg))
    return read_metrics(out / "masked"), read_metrics(out / "plain")


def check(name: str, got: dict, ref: dict) -> None:
    assert "error" not in got, got.get("error")
    for step, loss in ref["loss"].items():
        assert got["loss"][step] == pytest.approx(loss, rel=LOSS_RTOL), f"{name} loss @ {step}"
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=GRAD_NORM_RTOL), name
    for step, loss in ref["val_loss"].items():
        assert got["val_loss"][step] == pytest.approx(loss, rel=LOSS_RTOL), f"{name} val loss @ {step}"


@pytest.mark.slow
def test_every_supported_layout_equals_one_process_with_documents_masked(short_docs, masked_reference):
    masked, plain = masked_reference
    assert abs(masked["loss"][1] - plain["loss"][1]) > 1e-3  # the mask changes what the model computes
    jobs = {
        "DDP 2": ["parallel.dp_replicate_degree=2"],
        "FSDP 2": ["parallel.dp_shard_degree=2"],
        "TP 2 + SP": ["parallel.tp_degree=2"],
        "FSDP 2, full AC": ["parallel.dp_shard_degree=2", "parallel.activation_checkpoint=full"],
        "TP 2, selective AC": ["parallel.tp_degree=2", "parallel.activation_checkpoint=selective"],
        "PP 2, 1F1B (the later stage given the token ids)": ["parallel.pp_degree=2", "parallel.pp_schedule=1f1b"],
        "PP 2, GPipe": ["parallel.pp_degree=2", "parallel.pp_schedule=gpipe"],
        "CP 2 (documents crossing the ranks' chunks)": ["parallel.cp_degree=2"],
        "CP 2, full AC": ["parallel.cp_degree=2", "parallel.activation_checkpoint=full"],
        "CP 2, compiled (the ring: an opaque op given the documents)": [
            "parallel.cp_degree=2",
            "compile.enabled=true",
            "compile.strict=true",
        ],
    }
    results = run_layouts(2, [job(short_docs, "data.document_mask=true", *extra) for extra in jobs.values()])
    for name, got in zip(jobs, results, strict=True):
        check(name, got, masked)


@pytest.mark.full
@pytest.mark.slow
def test_context_parallel_with_each_other_layout_equals_one_process_with_documents_masked(short_docs, masked_reference):
    jobs = {
        "FSDP 2 x CP 2": ["parallel.dp_shard_degree=2", "parallel.cp_degree=2"],
        "TP 2 x CP 2, selective AC": [
            "parallel.tp_degree=2",
            "parallel.cp_degree=2",
            "parallel.activation_checkpoint=selective",
        ],
        "PP 2 x CP 2 (each stage gathers its micro-batch's ids)": ["parallel.pp_degree=2", "parallel.cp_degree=2"],
    }
    results = run_layouts(4, [job(short_docs, "data.document_mask=true", *extra) for extra in jobs.values()])
    for name, got in zip(jobs, results, strict=True):
        check(name, got, masked_reference[0])


@pytest.mark.full
@pytest.mark.slow
def test_compiled_blocks_take_the_document_mask(short_docs, masked_reference, tmp_path):
    from plait.api import train

    cfg = job(short_docs, "data.document_mask=true", "compile.enabled=true", "compile.strict=true")
    train(load_config(None, [*cfg, f"run.out_dir={tmp_path}", "run.name=compiled"]))
    check("compiled", read_metrics(tmp_path / "compiled"), masked_reference[0])


@pytest.mark.slow
def test_expert_parallel_moe_equals_one_process_with_documents_masked(short_docs, tmp_path):
    from plait.api import train

    moe = ["model.preset=moe-debug", "model.ffn_hidden_dim=0", "data.document_mask=true"]
    train(load_config(None, [*job(short_docs, *moe), f"run.out_dir={tmp_path}", "run.name=moe"]))
    (got,) = run_layouts(2, [job(short_docs, *moe, "parallel.dp_shard_degree=2", "parallel.ep_degree=2")])
    check("EP 2", got, read_metrics(tmp_path / "moe"))


def test_a_model_of_your_own_is_refused(data_dir, tmp_path):
    from torch import nn

    from plait.engine.trainer import mask_documents

    with pytest.raises(ConfigError, match="applies to plait's model"):
        mask_documents([nn.Linear(2, 2)], 0)
    m = model()
    mask_documents([m], 7)
    assert m.document_eos == 7
