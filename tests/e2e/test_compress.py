"""Compression: int8/int4 weight-only quantization, magnitude and structured pruning with a fine-tune after,
distillation; each reports size, speed and perplexity before and after."""

import copy
import json
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.engine.trainer import build_model
from plait.lifecycle.compress import QuantLinear, quantize_model
from plait.lifecycle.lineage import Registry
from plait.lifecycle.models import load_model
from plait.model import ModelArgs

transformers = pytest.importorskip("transformers")

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n"
# Both sides compute in fp32 (see tests/e2e/test_interop.py for the same bound and its reason).
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, data) of a tiny model trained for a few steps, so perplexity means something."""
    root = tmp_path_factory.mktemp("compress")
    docs = root / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"d{i}.txt").write_text(TEXT * (4 + i) + f"Document {i}.\n")
    data = root / "data"
    assert main(["data", "prepare", str(docs), "--out", str(data), "--vocab-size", "300"]) == 0
    vocab = json.loads((data / "manifest.json").read_text())["vocab_size"]
    args = [
        "--model.preset=debug",
        "--model.n_layers=2",
        f"--model.vocab_size={vocab}",
        f"--data.source={data}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=12",
        "--optim.warmup_steps=2",
        "--eval.every_steps=0",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.prompt=",
        f"--run.out_dir={root / 'runs'}",
        "--run.name=teacher",
    ]
    assert main(["train", *args]) == 0
    return root / "runs" / "teacher", data


def report(out: Path) -> dict:
    return json.loads((out / "compress.json").read_text())


def test_quantized_layers_match_their_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=False)
    x = torch.randn(3, 5, 96)
    q8 = QuantLinear.from_linear(linear, 8, 0)
    # The forward dequantizes and runs one matmul: the reference does the same in another order.
    assert (q8(x) - torch.nn.functional.linear(x, q8.dequantize())).abs().max() < 1e-5
    assert ((q8.dequantize() - linear.weight).abs() <= q8.scales[:, None] / 2 + 1e-7).all()
    q4 = QuantLinear.from_linear(linear, 4, 32)
    assert q4.qweight.dtype == torch.uint8 and q4.qweight.shape == (40, 48)  # two codes per byte
    scales = q4.scales.repeat_interleave(32, dim=1)  # (out, in): each column's group scale
    assert ((q4.dequantize() - linear.weight).abs() <= scales / 2 + 1e-7).all()
    assert q4.group_size == 32 and QuantLinear(96, 8, 4, 64).group_size == 32  # 64 does not divide 96


def test_tied_output_is_not_quantized_twice():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, tie_embeddings=True)
    model = quantize_model(build_model(args, torch.device("cpu"), 0), 8)
    assert model.output.weight is model.tok_embeddings.weight and isinstance(
        model.layers["0"].attention.wq, QuantLinear
    )


@torch.no_grad()
def test_quantization_keeps_the_qkv_biases(tmp_path):
    """Qwen2-style q/k/v biases stay as they are (fp32) through quantizing, saving and loading."""
    from plait.lifecycle.compress import load_quantized, save_quantized

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, qkv_bias=True)
    model = build_model(args, torch.device("cpu"), 0)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.normal_(0, 0.5)
    quant = quantize_model(copy.deepcopy(model), 8)
    assert torch.equal(quant.layers["0"].attention.wk.bias, model.layers["0"].attention.wk.bias)
    save_quantized(quant, tmp_path, bits=8, group_size=0, meta={}, tokenizer=None)
    loaded, _ = load_quantized(tmp_path)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(x), quant(x))
    without = copy.deepcopy(quant)
    for name in ("wq", "wk", "wv"):
        getattr(without.layers["0"].attention, name).bias = None
    assert not torch.allclose(without(x), quant(x))  # the biases do matter to the output


@pytest.mark.parametrize("bits,max_size_ratio,max_ppl_change", [(8, 0.5, 0.02), (4, 0.4, 0.25)])
def test_quantize_reports_size_speed_and_perplexity_deltas(trained, tmp_path, bits, max_size_ratio, max_ppl_change):
    run, data = trained
    out = tmp_path / f"int{bits}"
    argv = ["compress", "quantize", str(run), "--bits", str(bits), "--group-size", "32", "--format", "plait"]
    assert main([*argv, "--out", str(out)]) == 0
    r = report(out)
    before, after = r["before"], r["after"]
    # Embeddings stay fp32; every linear shrinks 4x (int8) or ~7x (int4 with fp32 group scales).
    assert after["size_mb"] / before["size_mb"] < max_size_ratio
    assert abs(after["perplexity"] / before["perplexity"] - 1) < max_ppl_change
    assert after["tokens_per_s"] > 0 and before["tokens_per_s"] > 0
    loaded = load_model(out)
    assert loaded.kind == "quantized" and loaded.meta["bits"] == bits
    assert main(["eval", str(out), "--seq-len", "32", "--batches", "2"]) == 0
    reg = Registry(run.parent / "lineage.sqlite")
    art = reg.find(str(out))
    assert art.kind == "quantized" and reg.get(art.parent_id).kind == "checkpoint"
    assert art.metrics["perplexity_after"] == after["perplexity"]


@pytest.mark.parametrize("bits", [8, 4])
def test_torchao_quantized_models_load_in_transformers_and_generate_plaits_greedy_tokens(trained, tmp_path, bits):
    """The default --format torchao: a transformers directory that from_pretrained loads quantized (torchao's
    tensors), whose greedy tokens equal plait's own evaluation of the same quantization; the report gives
    perplexity and size against the source and bf16."""
    transformers = pytest.importorskip("transformers")
    from plait.engine.generate import generate
    from plait.lifecycle.compress import torchao_quantize

    run, _ = trained
    out = tmp_path / f"ao{bits}"
    assert main(["compress", "quantize", str(run), "--bits", str(bits), "--group-size", "32", "--out", str(out)]) == 0
    r = report(out)
    info, before, after = r["info"], r["before"], r["after"]
    assert info["format"] == "torchao" and info["loads_in_transformers"] and info["bf16_mb"] > 0
    assert after["size_mb"] < before["size_mb"] and abs(after["perplexity"] / before["perplexity"] - 1) < 0.25
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    weight = hf.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__module__.startswith("torchao"), type(weight)  # loaded quantized, not dequantized
    plait = torchao_quantize(load_model(run).model, bits, 32)
    prompts = torch.randint(1, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    theirs = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=16)  # fmt: skip
    ours = generate(plait, prompts.tolist(), max_new_tokens=16, temperature=0.0)
    assert theirs.tolist() == ours
    with torch.no_grad():
        assert (hf(prompts).logits - plait(prompts)).abs().max() < LOGITS_ATOL  # the same kernels on the same weights


def test_quantize_prints_no_library_noise_and_publishes_readable_files(trained, tmp_path):
    """A fresh process (the libraries' start-up lines print once per process): no torchao "Failed to load"
    kernels line, no torch register_constant deprecation, no transformers progress bars; every file written
    is readable by others (safetensors writes 0600), as in every other published directory."""
    import subprocess
    import sys

    run, _ = trained
    out = tmp_path / "ao"
    cmd = [sys.executable, "-m", "plait.cli", "compress", "quantize", str(run), "--group-size", "32", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("Failed to load", "register_constant", "Loading weights", "Writing model shards", "Warning"):
        assert noise not in done.stderr + done.stdout, (noise, done.stderr[-2000:])
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}


@pytest.mark.parametrize("fmt,writer", [("plait", "save_quantized"), ("torchao", "save_torchao")])
def test_a_crash_while_a_quantized_model_is_written_leaves_no_partial_directory(trained, tmp_path, fmt, writer,
                                                                                 monkeypatch):  # fmt: skip
    """The quantized directory is written beside --out and renamed into place whole: a crash after its weights
    are written (before the directory is complete) leaves no --out at all, and nothing beside it."""
    from plait.lifecycle import compress as C

    real = getattr(C, writer)

    def crash(model, out_dir, **kw):
        real(model, out_dir, **kw)  # every file written, then the process dies
        raise RuntimeError("crash")

    monkeypatch.setattr(C, writer, crash)
    run, _ = trained
    out = tmp_path / "q"
    with pytest.raises(RuntimeError, match="crash"):
        main(["compress", "quantize", str(run), "--format", fmt, "--group-size", "32", "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def test_a_crash_while_a_pruned_run_is_written_leaves_no_partial_directory(trained, tmp_path, monkeypatch):
    """A pruned model's run directory (its checkpoint, then config.toml) is written beside --out and renamed into
    place whole (plait.lifecycle.model_run.write_run, which `plait finetune merge` shares): a crash after the
    checkpoint is written leaves no --out at all, and nothing beside it."""
    from plait.lifecycle import model_run

    real = model_run.write_weights_checkpoint

    def crash(*args, **kw):
        real(*args, **kw)  # the checkpoint written, not yet config.toml: then the process dies
        raise RuntimeError("crash")

    monkeypatch.setattr(model_run, "write_weights_checkpoint", crash)
    run, _ = trained
    out = tmp_path / "p"
    with pytest.raises(RuntimeError, match="crash"):
        main(["compress", "prune", str(run), "--method", "structured", "--sparsity", "0.5", "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def test_magnitude_pruning_keeps_its_zeros_through_the_fine_tune(trained, tmp_path):
    run, data = trained
    out = tmp_path / "pruned"
    assert (
        main(
            [
                "compress",
                "prune",
                str(run),
                "--method",
                "magnitude",
                "--sparsity",
                "0.5",
                "--finetune-steps",
                "4",
                "--lr",
                "1e-3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = report(out)
    model = load_model(out).model
    for name, p in model.named_parameters():
        if name.endswith(("wq.weight", "w2.weight")):
            assert (p == 0).float().mean() >= 0.5, name
    assert r["after"]["nonzero_m"] < 0.8 * r["before"]["nonzero_m"]
    assert r["info"]["pruned_only"]["perplexity"] > 0 and r["after"]["perplexity"] > 0
    assert (out / "config.toml").is_file()  # an ordinary plait run: train, generate, export as usual


def test_structured_pruning_gives_a_smaller_model_transformers_loads(trained, tmp_path):
    run, data = trained
    out, hf = tmp_path / "structured", tmp_path / "structured-hf"
    assert (
        main(
            [
                "compress",
                "prune",
                str(run),
                "--method",
                "structured",
                "--sparsity",
                "0.5",
                "--out",
                str(out),
                "--hf-out",
                str(hf),
            ]
        )
        == 0
    )
    r = report(out)
    model = load_model(out).model
    teacher = load_model(run).model
    assert model.args.hidden_dim < teacher.args.hidden_dim
    assert r["after"]["size_mb"] < r["before"]["size_mb"] and r["after"]["params_m"] < r["before"]["params_m"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    x = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_model(x).logits - model(x)).abs().max() < LOGITS_ATOL


def test_distillation_trains_a_student_on_the_teachers_logits(trained, tmp_path):
    run, data = trained
    out, hf = tmp_path / "student", tmp_path / "student-hf"
    assert (
        main(
            [
                "compress",
                "distill",
                "--teacher",
                str(run),
                "--student",
                "model.n_layers=1",
                "--steps",
                "8",
                "--temperature",
                "2.0",
                "--out",
                str(out),
                "--hf-out",
                str(hf),
            ]
        )
        == 0
    )
    r = report(out)
    first, last = r["info"]["loss"]
    assert last < first  # the KL to the teacher went down
    assert r["after"]["params_m"] < r["before"]["params_m"]
    student = load_model(out).model
    assert student.args.n_layers == 1
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    x = torch.randint(0, student.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf_model(x).logits - student(x)).abs().max() < LOGITS_ATOL
    reg = Registry(run.parent / "lineage.sqlite")
    art = reg.find("student")
    assert art.kind == "distilled" and [c.kind for c in reg.children(art.id)] == ["export"]


def test_a_copy_is_quantized_not_the_source(trained):
    run, _ = trained
    model = load_model(run).model
    before = copy.deepcopy(model.state_dict())
    quantize_model(copy.deepcopy(model), 8)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# The trainer's KL is a small difference (~0.01) of fp32 log-probabilities of size ~6: each carries ~6 x 6e-8
# of rounding, so its absolute error is a few 1e-7 (measured 2.6e-7) against this test's fp64 formula.
KL_ATOL = 1e-6


def test_distillation_on_the_trainer_reproduces_the_kl_of_its_first_batch(trained, tmp_path):
    """The distillation's first loss, as plait's trainer computed it, equals KL(teacher || student) x T^2
    written out here on the batch it trained on (the callback keeps its last micro-batch's tokens)."""
    import plait
    from plait.lifecycle import compress as C

    run, data = trained
    teacher = load_model(run).model.eval()
    args = copy.deepcopy(teacher.args)
    args.n_layers = 1
    student = C.student_from_teacher(teacher, args)
    teach = C.Distillation(teacher, temperature=2.0)
    losses = C.Losses()
    cfg = C.training_config(args, tmp_path / "kd", data, steps=1, lr=1e-3, seq_len=16, batch_size=2)
    plait.Trainer(cfg, loss=teach.loss, callbacks=[C.StartFrom(student), teach, losses]).fit()
    tokens = teach.tokens
    assert tokens is not None and tokens.shape == (2, 16)
    with torch.no_grad():
        p = torch.softmax(teacher(tokens).double() / 2.0, dim=-1)
        q = torch.softmax(student(tokens).double() / 2.0, dim=-1)  # the student as it was before the update
    expected = (p * (p.log() - q.log())).sum(-1).mean() * 4.0
    assert losses.values[0] == pytest.approx(expected.item(), abs=KL_ATOL)
    assert (tmp_path / "kd" / "metrics.jsonl").is_file()  # a plait run: metrics, config, checkpoint


def test_start_from_copies_the_weights_and_keep_zeros_keeps_the_zeros(trained, tmp_path):
    """StartFrom's weights are the run's step-0 weights; KeepZeros zeroes every pruned weight after each
    update (the update itself moves them: Adam's first step is lr x sign(grad))."""
    import plait
    from plait.lifecycle import compress as C

    run, data = trained
    model = load_model(run).model
    masks = C.magnitude_prune(model, 0.5)
    out = tmp_path / "ft"
    cfg = C.training_config(model.args, out, data, steps=2, lr=1e-2, seq_len=16, batch_size=2)
    seen = {}

    class Snapshot(plait.Callback):
        def on_model(self, run_state, parts):
            seen.update({k: v.detach().clone() for k, v in parts[0].state_dict().items()})

    plait.Trainer(cfg, callbacks=[C.StartFrom(model), Snapshot(), C.KeepZeros(masks)]).fit()
    assert all(torch.equal(seen[k], v) for k, v in model.state_dict().items() if not k.startswith("rope_"))
    tuned = load_model(out).model.state_dict()
    for name, mask in masks.items():
        assert torch.all(tuned[name][mask == 0] == 0), name
        assert not torch.equal(tuned[name], model.state_dict()[name]), f"{name} was not trained"
