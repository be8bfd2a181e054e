"""Hugging Face interop checked against the real `transformers` library, and the `plait ckpt` command.

The oracle is numerical parity: a plait model and the `transformers` model holding the same weights must
give the same logits on the same tokens.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from plait.cli.ckpt import cmd_ckpt
from plait.core.errors import PlaitError
from plait.engine.checkpoint import list_checkpoints
from plait.engine.checkpoint.weights import load_checkpoint_model
from plait.engine.trainer import build_model
from plait.interop import export_hf, export_safetensors, import_hf, load_hf_model, load_safetensors
from plait.model import ModelArgs
from plait.model.llama import rope_tables

transformers = pytest.importorskip("transformers")

# Both sides compute in fp32 with the same formulas; what differs is the order of operations and that
# plait builds its rotary tables in fp64 (HF in fp32). Measured differences are ~1e-7 on logits of
# magnitude ~1; 1e-5 leaves room for other BLAS builds while any wrong mapping shows up as ~1e-1.
LOGITS_ATOL = 1e-5

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)
CASES = {
    "gqa": {},
    "mha": {"n_kv_heads": 4},
    "tied": {"tie_embeddings": True},
    "llama3-rope": {"rope_scaling_factor": 8.0, "rope_original_max_seq_len": 16, "rope_theta": 500000.0},
    # A window of 8 over the test's 64 tokens: most queries see only part of their past.
    "sliding-window": {"sliding_window": 8},
    "qkv-bias": {"qkv_bias": True},
    "qkv-bias-sliding-window": {"qkv_bias": True, "sliding_window": 8, "tie_embeddings": True},
    # Mixture of experts (every block): 4 experts of width 48, top 2, a window of 8.
    "moe": {"moe_experts": 4, "moe_top_k": 2, "moe_hidden_dim": 48, "sliding_window": 8},
    # Qwen3: per-head q/k norms, a head size of 32 apart from dim / n_heads = 16.
    "qk-norm": {"qk_norm": True, "attention_head_dim": 32},
    # Qwen3-MoE: a dense first block, then 4 experts of width 24, top 2 without renormalising.
    "qk-norm-moe": {"qk_norm": True, "attention_head_dim": 32, "moe_experts": 4, "moe_top_k": 2}
    | {"moe_hidden_dim": 24, "moe_dense_layers": 1, "moe_norm_topk": False},
}
# The transformers class that computes what plait's model does: the one export_hf writes.
ARCHITECTURES = {
    "sliding-window": "MistralForCausalLM",
    "qkv-bias": "Qwen2ForCausalLM",
    "qkv-bias-sliding-window": "Qwen2ForCausalLM",
    "moe": "MixtralForCausalLM",
    "qk-norm": "Qwen3ForCausalLM",
    "qk-norm-moe": "Qwen3MoeForCausalLM",
}


@pytest.fixture(autouse=True, scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        transformers.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()
        yield


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    model = build_model(ModelArgs(**{**TINY, **overrides}), torch.device("cpu"), seed)
    randomize_norms_and_biases(model, seed)
    return model


def randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at one and biases at zero; make them distinct so a swapped or dropped mapping
    cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def tokens(seq_len: int = 64, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def max_logits_diff(plait_model, hf_model, x: torch.Tensor) -> float:
    plait_model.eval()
    return (plait_model(x) - hf_model(x).logits).abs().max().item()


def hf_from_pretrained(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------- plait -> transformers


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_transformers_the_same_logits(case, tmp_path):
    model = tiny_model(**CASES[case])
    out = export_hf(model, tmp_path / "hf", tokenizer_path=None)
    hf = hf_from_pretrained(out)
    assert type(hf).__name__ == ARCHITECTURES.get(case, "LlamaForCausalLM")
    assert hf.config.tie_word_embeddings == model.args.tie_embeddings
    assert max_logits_diff(model, hf, tokens()) < LOGITS_ATOL
    names = set(load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in names) != model.args.tie_embeddings


@torch.no_grad()
def test_sliding_window_changes_the_logits():
    """Otherwise the sliding-window cases would pass with full causal attention. The first window-many
    positions see all their past either way; every later one sees less of it."""
    windowed = tiny_model(**CASES["sliding-window"]).eval()
    full = tiny_model().eval()
    full.load_state_dict(windowed.state_dict())
    x = tokens()
    diff = (windowed(x) - full(x)).abs().amax(dim=(0, 2))  # (T,)
    assert diff[:8].max() < LOGITS_ATOL and diff[8:].min() > 1e-3


def test_llama3_rope_scaling_matters_within_the_test_length():
    """Otherwise the llama3-rope case above would not test the scaling at all."""
    scaled = ModelArgs(**{**TINY, **CASES["llama3-rope"]})
    plain = ModelArgs(**{**TINY, "rope_theta": 500000.0})
    assert not torch.allclose(rope_tables(scaled)[0], rope_tables(plain)[0], atol=1e-3)


# ----------------------------------------------------------------------------------- transformers -> plait

HF_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def save_hf_model(kind: str, path: Path, **overrides) -> Path:
    """A randomly initialised transformers model of `kind` (random norms and biases too), saved as safetensors."""
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = configs[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**HF_SHAPE, **overrides}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path


# kind, config overrides, the plait settings they mean, test sequence length
HF_CASES = {
    "llama-llama3-rope": (
        "llama",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        {},
        64,
    ),
    # A window of 8 over 32 tokens (max_position_embeddings 64 is kept: no cap at the window).
    "mistral-sliding-window": ("mistral", dict(sliding_window=8), dict(sliding_window=8), 32),
    # Qwen2 always has q/k/v biases: random non-zero ones here. Its window is off by default.
    "qwen2-bias": ("qwen2", {}, dict(qkv_bias=True), 32),
    # use_sliding_window with max_window_layers=0: every layer windowed.
    "qwen2-tied-sliding-window": (
        "qwen2",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=0),
        dict(qkv_bias=True, sliding_window=8),
        32,
    ),
    # 4 experts of width 48 (intermediate_size), top 2; Mixtral's sliding_window is null by default.
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48), {}, 32),
    "qwen3": ("qwen3", dict(head_dim=32), {}, 32),
    # A dense first block (mlp_only_layers), then 4 experts of width 24, top 2, weights not renormalised.
    "qwen3_moe": (
        "qwen3_moe",
        dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0]),
        {},
        32,
    ),
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_model_imports_with_the_same_logits(case, tmp_path):
    """transformers -> plait -> transformers: the same logits at each step, the same family and tensors."""
    kind, overrides, settings, seq_len = HF_CASES[case]
    path = save_hf_model(kind, tmp_path / kind, **overrides)
    hf = hf_from_pretrained(path)
    model = load_hf_model(path)
    assert model.args.max_seq_len == 64
    assert (model.args.sliding_window, model.args.qkv_bias) == (
        settings.get("sliding_window", 0),
        settings.get("qkv_bias", False),
    )
    x = tokens(seq_len)
    assert max_logits_diff(model, hf, x) < LOGITS_ATOL
    out = export_hf(model, tmp_path / "export", tokenizer_path=None)
    exported = hf_from_pretrained(out)
    assert type(exported).__name__ == HF_CLASSES[kind]
    assert max_logits_diff(model, exported, x) < LOGITS_ATOL
    original, written = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == written.keys() and all(torch.equal(original[k], written[k]) for k in original)
    if kind == "qwen2":
        assert original["model.layers.0.self_attn.q_proj.bias"].count_nonzero() > 0


@pytest.mark.parametrize("case", ["llama-llama3-rope", "qwen3", "mistral-sliding-window"])
@torch.no_grad()
def test_document_masked_logits_equal_transformers_on_each_document(case, tmp_path):
    """data.document_mask on an imported model: a packed row of documents (each ending with EOS) gives, for
    each document, the logits transformers gives that document alone."""
    kind, overrides, _, _ = HF_CASES[case]
    path = save_hf_model(kind, tmp_path / kind, **overrides)
    hf, model = hf_from_pretrained(path), load_hf_model(path).eval()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, 128, (n,), generator=gen) for n in (9, 4, 13, 6)]
    for d in docs:
        d[-1] = 0
    model.document_eos = 0
    packed = model(torch.cat(docs)[None])
    alone = torch.cat([hf(d[None]).logits for d in docs], dim=1)
    assert (packed - alone).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("case", ["mistral-sliding-window", "qwen2-bias", "qwen2-tied-sliding-window"])
def test_greedy_generation_matches_transformers(case, tmp_path):
    """plait's KV-cache decoding against transformers' generate, from the original directory and from
    plait's export: a 12-token prompt (longer than the window of 8) and 24 new tokens."""
    from plait.engine.generate import generate

    kind, overrides, _, _ = HF_CASES[case]
    path = save_hf_model(kind, tmp_path / kind, **overrides)
    model = load_hf_model(path)
    prompts = tokens(12)
    ours = generate(model, prompts.tolist(), max_new_tokens=24, temperature=0.0)
    assert {len(row) for row in ours} == {36}
    exported = export_hf(model, tmp_path / "export", tokenizer_path=None)
    for hf in (hf_from_pretrained(path), hf_from_pretrained(exported)):
        theirs = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=None,  # run the full length on both sides
            pad_token_id=0,
        )
        assert theirs.tolist() == ours


QWEN2_MIXED = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)


def test_qwen2_with_a_window_on_some_layers_only_is_refused(tmp_path):
    """Layer 0 full, layer 1 windowed: plait has one attention pattern for all layers, so it refuses (and a
    config whose windowed layers have no window, which transformers cannot build either)."""
    path = save_hf_model("qwen2", tmp_path / "qwen2", **QWEN2_MIXED)
    with pytest.raises(PlaitError, match=r"layer_types puts the sliding window on 1 of 2 layers"):
        import_hf(path)
    _edit_config(path, layer_types=None)  # as older configs: transformers derives them from max_window_layers
    with pytest.raises(PlaitError, match=r"max_window_layers=1 puts the sliding window on 1 of 2 layers"):
        import_hf(path)
    _edit_config(path, use_sliding_window=False, layer_types=["sliding_attention"] * 2)
    with pytest.raises(PlaitError, match=r"names sliding_attention layers but use_sliding_window is false"):
        import_hf(path)


def test_sharded_checkpoint_imports(tmp_path):
    path = save_hf_model("llama", tmp_path / "llama")
    hf = hf_from_pretrained(path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    _, whole = import_hf(path)
    _, parts = import_hf(sharded)
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("case", ["gqa", "tied", "sliding-window", "qkv-bias", "qkv-bias-sliding-window"])
def test_hf_round_trip_is_bitwise(case, tmp_path):
    model = tiny_model(**CASES[case])
    args, tensors = import_hf(export_hf(model, tmp_path / "hf", tokenizer_path=None))
    assert args.tie_embeddings == model.args.tie_embeddings and args.hidden_dim == model.args.hidden_dim
    assert (args.sliding_window, args.qkv_bias) == (model.args.sliding_window, model.args.qkv_bias)
    params = dict(model.named_parameters())
    assert tensors.keys() == params.keys()
    assert all(torch.equal(tensors[k], params[k]) for k in params)
    reloaded = load_hf_model(tmp_path / "hf")
    assert torch.equal(reloaded(tokens()), model(tokens()))


def test_safetensors_round_trip(tmp_path):
    model = tiny_model(tie_embeddings=True, **CASES["llama3-rope"])
    path = export_safetensors(model, tmp_path / "m.safetensors")
    loaded = load_safetensors(path)
    assert loaded.args == model.args
    assert all(torch.equal(p, dict(loaded.named_parameters())[k]) for k, p in model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["model_args"])["rope_theta"] == 500000.0
    bf16 = export_safetensors(model, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    emb = load_file(bf16)["tok_embeddings.weight"]
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, model.tok_embeddings.weight.bfloat16())


def test_export_refuses_to_overwrite(tmp_path):
    model = tiny_model()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(PlaitError, match=r"hf exists and is not empty; pass overwrite=True"):
        export_hf(model, out, tokenizer_path=None)
    assert (out / "keep.txt").read_text() == "precious"
    export_hf(model, out, tokenizer_path=None, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary directory left behind
    with pytest.raises(PlaitError, match="exists; pass overwrite=True"):
        export_safetensors(model, out / "model.safetensors")


# ------------------------------------------------------------------------------------------------ mismatches


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_safetensors(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")


K_PROJ = "model.layers.0.self_attn.k_proj.weight"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
BROKEN = {
    "missing tensor": (
        lambda p: _edit_tensors(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight",
    ),
    "unexpected tensor": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)})),
        r"unexpected tensors: model\.layers\.0\.extra\.weight",
    ),
    "wrong shape": (
        lambda p: _edit_tensors(p, lambda t: t.update({K_PROJ: torch.zeros(16, 64)})),
        r"shape mismatches: model\.layers\.0\.self_attn\.k_proj\.weight \(16, 64\) \(expected \(32, 64\)\)",
    ),
    "pickle only": (_drop_safetensors, r"only PyTorch pickle weights \(pytorch_model\.bin\).*safetensors"),
    "yarn rope": (
        lambda p: _edit_config(p, rope_scaling=YARN),
        r"rope_scaling type 'yarn' is not supported; supported: llama3, none",
    ),
    # a head size of its own is supported (Qwen3's): here the weights are not shaped for it
    "head_dim": (
        lambda p: _edit_config(p, head_dim=32),
        r"shape mismatches: model\.layers\.0\.self_attn\.q_proj\.weight \(64, 64\) \(expected \(128, 64\)\)",
    ),
    "head_dim not an integer": (lambda p: _edit_config(p, head_dim="32"), r"head_dim must be a positive integer"),
    "model type": (lambda p: _edit_config(p, model_type="gpt2"), r"model_type 'gpt2' is not supported"),
    "llama o_proj bias": (
        lambda p: _edit_config(p, attention_bias=True),
        r"attention_bias=true puts biases on q/k/v and o_proj; plait's attention has q/k/v biases only",
    ),
    "llama mlp bias": (lambda p: _edit_config(p, mlp_bias=True), r"mlp_bias=true is not supported"),
    "stray bias": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
        r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj\.bias",
    ),
    "untied head missing": (
        lambda p: _edit_tensors(p, lambda t: t.pop("lm_head.weight")),
        r"missing tensors: lm_head\.weight",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_mismatched_checkpoint_is_refused_with_its_problem(case, tmp_path):
    break_it, message = BROKEN[case]
    path = export_hf(tiny_model(), tmp_path / "hf", tokenizer_path=None)
    break_it(path)
    with pytest.raises(PlaitError, match=message):
        load_hf_model(path)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    model = tiny_model(tie_embeddings=True)
    path = export_hf(model, tmp_path / "hf", tokenizer_path=None)
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": torch.ones(128, 64)}))
    with pytest.raises(PlaitError, match="tie_word_embeddings is true but lm_head.weight differs"):
        import_hf(path)
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert import_hf(path)[1].keys() == dict(model.named_parameters()).keys()  # an equal copy is fine


def test_every_problem_is_listed_at_once(tmp_path):
    path = export_hf(tiny_model(), tmp_path / "hf", tokenizer_path=None)

    def edit(t):
        t.pop("model.norm.weight")
        t["extra"] = torch.zeros(1)
        t["model.embed_tokens.weight"] = torch.zeros(3, 64)

    _edit_tensors(path, edit)
    with pytest.raises(PlaitError) as err:
        import_hf(path)
    assert all(s in str(err.value) for s in ("missing tensors", "unexpected tensors", "shape mismatches"))


# ----------------------------------------------------------------------------------------------------- CLI

CORPUS = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run directory with a checkpoint from a real (tiny, 2-step) `plait train`."""
    from plait.cli import main

    root = tmp_path_factory.mktemp("run")
    for i in range(8):
        (root / f"doc{i}.txt").write_text(CORPUS * (3 + i) + f"Document {i}.\n")
    data = root / "data"
    assert main(["data", "prepare", str(root), "--out", str(data), "--vocab-size", "300"]) == 0
    vocab = json.loads((data / "manifest.json").read_text())["vocab_size"]
    args = [
        "--model.preset=debug",
        "--model.n_layers=2",
        f"--model.vocab_size={vocab}",
        f"--data.source={data}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=2",
        "--optim.warmup_steps=1",
        "--eval.every_steps=0",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.prompt=",
        f"--run.out_dir={root}",
        "--run.name=t",
    ]
    assert main(["train", *args]) == 0
    return root / "t"


def test_ckpt_inspect(trained_run, capsys):
    assert cmd_ckpt(["inspect", str(trained_run)]) == 0
    out = capsys.readouterr().out
    model = load_checkpoint_model(list_checkpoints(trained_run / "checkpoints")[-1])
    numel = sum(p.numel() for p in model.parameters())
    for text in ("step_00000002", "tokens", "256", f"{numel:,}", "AdamW", "8 samples consumed", "dim 64"):
        assert text in out, (text, out)


def test_ckpt_export_hf_loads_in_transformers(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cmd_ckpt(["export", str(trained_run), "--format", "hf", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load_checkpoint_model(list_checkpoints(trained_run / "checkpoints")[-1])
    hf = hf_from_pretrained(out)
    assert max_logits_diff(model, hf, tokens(32, model.args.vocab_size)) < LOGITS_ATOL
    # The tokenizer comes along and encodes exactly as plait's.
    from plait.data import EOS, load_tokenizer

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    plait_tok = load_tokenizer(trained_run / "checkpoints" / "step_00000002")
    assert hf_tok(CORPUS)["input_ids"] == plait_tok.encode(CORPUS).ids
    assert hf_tok.eos_token == EOS and hf.config.eos_token_id == plait_tok.token_to_id(EOS)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == hf.config.eos_token_id
    # An existing export is not replaced without --overwrite.
    with pytest.raises(PlaitError, match="--overwrite"):
        cmd_ckpt(["export", str(trained_run), "--out", str(out)])
    bf16 = tmp_path / "bf16"
    assert cmd_ckpt(["export", str(trained_run), "--out", str(bf16), "--dtype", "bf16"]) == 0
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # Both exports are in the run's lineage registry, children of the checkpoint, hashed as written.
    from plait.lifecycle.lineage import Registry
    from plait.lifecycle.models import load_model

    registry = Registry(trained_run.parent / "lineage.sqlite", create=False)
    ckpt = registry.by_path(trained_run / "checkpoints" / "step_00000002")
    for path in (out, bf16):
        export = registry.by_path(path)
        assert export.kind == "export" and export.parent_id == ckpt.id
        assert export.weights_hash == load_model(path).weights_hash()
    assert registry.by_path(out).weights_hash == ckpt.weights_hash != registry.by_path(bf16).weights_hash


def test_ckpt_export_safetensors(trained_run, tmp_path):
    assert cmd_ckpt(["export", str(trained_run), "--format", "safetensors", "--out", str(tmp_path)]) == 0
    loaded = load_safetensors(tmp_path / "model.safetensors")
    model = load_checkpoint_model(list_checkpoints(trained_run / "checkpoints")[-1])
    assert all(torch.equal(p, dict(loaded.named_parameters())[k]) for k, p in model.named_parameters())


def test_ckpt_import_makes_a_checkpoint_plait_loads(trained_run, tmp_path, capsys):
    from plait.engine.generate import load_for_generation

    hf_dir = tmp_path / "hf"
    assert cmd_ckpt(["export", str(trained_run), "--out", str(hf_dir)]) == 0
    run = tmp_path / "imported"
    assert cmd_ckpt(["import", str(hf_dir), "--out", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000000"
    assert list_checkpoints(run / "checkpoints") == [ckpt] and (run / "config.toml").is_file()
    meta = json.loads((ckpt / "plait.json").read_text())
    assert meta["weights_only"] and meta["imported_from"]["model_type"] == "llama"
    # the export is readable by others (safetensors alone writes 0600), and the import is in the lineage
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in hf_dir.iterdir()} == {
        f.name: "0o644" for f in hf_dir.iterdir()
    }
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["do_sample"] is False
    # the bundled tokenizer has no BOS: EOS separates (so precedes) every document, as GPT-2's <|endoftext|>
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert generation["bos_token_id"] == generation["eos_token_id"] == vocab["<|endoftext|>"]
    assert (
        generation["pad_token_id"]
        == vocab["<|pad|>"]
        == json.loads((hf_dir / "config.json").read_text())["pad_token_id"]
    )
    from plait.lifecycle.lineage import Registry
    from plait.lifecycle.lora import model_weights_hash

    (imported,) = Registry(tmp_path / "lineage.sqlite", create=False).all("import")
    assert imported.path == str(ckpt.resolve()) or Path(imported.path).resolve() == ckpt.resolve()
    model, tok, eos = load_for_generation(run, "cpu")
    assert imported.weights_hash == model_weights_hash(model)
    original = load_checkpoint_model(list_checkpoints(trained_run / "checkpoints")[-1])
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[k]) for k, p in original.named_parameters())
    capsys.readouterr()
    assert cmd_ckpt(["inspect", str(run)]) == 0
    assert "weights only" in capsys.readouterr().out
    with pytest.raises(PlaitError, match="--overwrite"):
        cmd_ckpt(["import", str(hf_dir), "--out", str(run)])
    assert cmd_ckpt(["import", str(hf_dir), "--out", str(tmp_path / "step_00000000")]) == 0
    assert (tmp_path / "step_00000000" / "plait.json").is_file()


def test_training_starts_from_an_imported_checkpoint(trained_run, tmp_path, capsys):
    from plait.cli import main

    hf_dir, run = tmp_path / "hf", tmp_path / "ft"
    assert cmd_ckpt(["export", str(trained_run), "--out", str(hf_dir)]) == 0
    assert cmd_ckpt(["import", str(hf_dir), "--out", str(run)]) == 0
    args = [
        f"--data.source={trained_run.parent / 'data'}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=1",
        "--eval.every_steps=0",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.prompt=",
    ]
    assert main(["train", str(run / "config.toml"), *args]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert (run / "checkpoints" / "step_00000001" / "plait.json").is_file()


def test_ckpt_errors_name_the_problem(tmp_path):
    with pytest.raises(PlaitError, match="does not exist"):
        cmd_ckpt(["inspect", str(tmp_path / "nope")])
    with pytest.raises(PlaitError, match="holds no complete checkpoint"):
        cmd_ckpt(["export", str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(PlaitError, match="has no config.json"):
        cmd_ckpt(["import", str(tmp_path), "--out", str(tmp_path / "run")])
    assert sorted(os.listdir(tmp_path)) == []
