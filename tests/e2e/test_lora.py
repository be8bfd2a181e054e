"""Fine-tuning: LoRA adapters (exactness, merging, freezing, base verification), shared-stem serving of many
adapters, instruction data with masked prompts, and fine-tunes through the real trainer (init_from, LoRA,
continued pre-training, monitors, lineage)."""

import json
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.core.errors import ConfigError, PlaitError
from plait.data import TokenDataset, TokenLoader, load_tokenizer
from plait.engine.trainer import build_model
from plait.lifecycle.finetune import prepare_instructions
from plait.lifecycle.lineage import Registry
from plait.lifecycle.lora import (
    apply_lora,
    base_weights_hash,
    load_adapter,
    lora_tensors,
    merge_lora,
    save_adapter,
)
from plait.lifecycle.models import load_model
from plait.lifecycle.serve import SharedStem
from plait.model import ModelArgs

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)
ALL = "wq,wk,wv,wo,w1,w2,w3"
# Merging computes x (W + s B A)^T where the adapter path computes x W^T + s (x A^T) B^T: the same sums in
# another order, so fp32 rounding only (measured ~3e-7 on logits of size ~1); a wrong merge is off by ~1e-2.
MERGE_ATOL = 1e-5
# Shared-stem rows run the same math as a lone adapter but through bmm on gathered, zero-padded matrices and a
# larger batch, which changes matmul blocking: fp32 rounding only (measured ~1e-7).
STEM_ATOL = 1e-5


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_model(ModelArgs(**TINY), torch.device("cpu"), seed)


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))


def randomize_adapters(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


# ------------------------------------------------------------------------------------------------ adapters


def test_zero_initialised_adapters_reproduce_the_base_logits_exactly():
    model = tiny()
    x = tokens()
    before = model(x)
    names = apply_lora(model, rank=4, alpha=8, targets=ALL)
    assert len(names) == 2 * 7 and all(n.startswith("layers.") for n in names)
    assert torch.equal(model(x), before)  # B = 0: the adapter adds exact zeros
    params = dict(model.named_parameters())
    assert "layers.0.attention.wq.weight" in params  # base names unchanged: base checkpoints still load
    trainable = sorted(n for n, p in params.items() if p.requires_grad)
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)


def test_merged_and_unmerged_outputs_agree():
    model = tiny()
    apply_lora(model, rank=4, alpha=8, targets=ALL, seed=3)
    randomize_adapters(model, 1)
    x = tokens()
    unmerged = model(x)
    assert (unmerged - tiny()(x)).abs().max() > 1e-3  # the adapters do change the model
    merge_lora(model)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert type(model.layers["0"].attention.wq) is torch.nn.Linear
    assert (model(x) - unmerged).abs().max() < MERGE_ATOL


def test_training_moves_only_the_adapters():
    model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, rank=2, alpha=4, targets="wq,wv", dropout=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        x = tokens()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items() if not k.startswith("rope"))
    assert any(v.abs().sum() > 0 for k, v in lora_tensors(model).items() if k.endswith("lora_b"))


def test_adapter_refuses_to_load_on_the_wrong_base(tmp_path):
    base = tiny(seed=0)
    base_hash = base_weights_hash(base)
    adapted = tiny(seed=0)
    apply_lora(adapted, rank=4, alpha=8, targets="wq,wo,w1")
    randomize_adapters(adapted, 2)
    path = save_adapter(
        adapted,
        tmp_path / "a.safetensors",
        base_hash=base_hash,
        rank=4,
        alpha=8,
        targets="wq,wo,w1",
        base_path="/runs/base/step_1",
    )
    assert path.stat().st_mode & 0o777 == 0o644  # readable by whoever serves it (safetensors writes 0600)
    with pytest.raises(
        PlaitError,
        match=r"belongs to base weights .* \(it was trained on /runs/base/step_1\), but "
        r"this model's weights hash to .*: load the adapter onto its own base",
    ):
        load_adapter(tiny(seed=1), path)
    right = tiny(seed=0)
    load_adapter(right, path)
    x = tokens()
    assert torch.equal(right(x), adapted(x))


# ---------------------------------------------------------------------------------------------- shared stem


def test_shared_stem_rows_equal_each_adapter_alone(tmp_path):
    base = tiny()
    base_hash = base_weights_hash(base)
    specs = {"a": ("wq,wv", 4, 8.0), "b": ("wq,wk,wv,wo,w1,w2,w3", 2, 2.0), "c": ("w2", 8, 16.0)}
    paths = {}
    for i, (name, (targets, rank, alpha)) in enumerate(specs.items()):
        m = tiny()
        apply_lora(m, rank, alpha, targets, seed=i)
        randomize_adapters(m, 10 + i)
        paths[name] = save_adapter(
            m, tmp_path / f"{name}.safetensors", base_hash=base_hash, rank=rank, alpha=alpha, targets=targets
        )

    def alone(name):
        m = tiny()
        if name is not None:
            load_adapter(m, paths[name])
        return m.eval()

    rows = ["a", "b", None, "c", "a"]
    x = tokens(batch=len(rows))
    stem = SharedStem(tiny(), paths)
    together = stem.logits(x, rows)
    for i, name in enumerate(rows):
        ref = alone(name)(x[i : i + 1])
        assert (together[i : i + 1] - ref).abs().max() < STEM_ATOL, (i, name)
    # Generation: greedy continuations per row are those of the adapter alone.
    prompts = [[5, 6, 7], [5, 6, 7], [9, 9, 9], [1, 2, 3]]
    names = ["a", "b", "c", None]
    outs = stem.generate(list(zip(prompts, names, strict=True)), max_new_tokens=6)
    from plait.engine.generate import generate

    for p, n, out in zip(prompts, names, outs, strict=True):
        assert out == generate(alone(n), [p], max_new_tokens=6, temperature=0)[0], n
    wrong = tmp_path / "wrong.safetensors"
    m = tiny(seed=5)
    apply_lora(m, 2, 2, "wq")
    save_adapter(m, wrong, base_hash=base_weights_hash(m), rank=2, alpha=2, targets="wq")
    with pytest.raises(PlaitError, match="belongs to base weights"):
        SharedStem(tiny(), {"ok": paths["a"], "wrong": wrong})


# ------------------------------------------------------------------------------------------ instruction data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    text = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n"
    docs = root / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"d{i}.txt").write_text(text * (3 + i) + f"Document {i}.\n")
    assert main(["data", "prepare", str(docs), "--out", str(root / "data"), "--vocab-size", "300"]) == 0
    words = ["hello", "speak", "citizen", "all", "first", "proceed", "further", "hear"]
    records = [{"prompt": f"Say {w} {i}", "response": f" {w} {w} {w}."} for i in range(3) for w in words]
    (root / "inst.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return root


def test_instruction_data_masks_the_prompt_out_of_the_loss(corpus, tmp_path):
    out = tmp_path / "inst"
    manifest = prepare_instructions(
        [corpus / "inst.jsonl"],
        out,
        tokenizer=corpus / "data" / "tokenizer.json",
        template="Q: {prompt}\nA:",
        val_fraction=0.2,
    )
    train = manifest["splits"]["train"]
    assert manifest["loss_mask"]["train_on_prompt"] is False
    assert 0 < train["num_target_tokens"] < train["num_tokens"]
    tok = load_tokenizer(out / "tokenizer.json")
    ds = TokenDataset(out, "train")
    assert ds.has_loss_mask
    n = ds.num_tokens - 1
    stream, mask = ds.sample(0, n), ds.sample(0, n, loss_mask=True)
    start = 0
    for end in (stream == ds.eos_id).nonzero()[0]:  # each example: masked prompt, then response + EOS
        doc, m = stream[start : end + 1], mask[start : end + 1]
        k = int((m == 0).sum())
        assert (m[:k] == 0).all() and (m[k:] == 1).all()
        prompt = tok.decode(doc[:k].tolist())
        assert prompt.startswith("Q: Say ") and prompt.endswith("\nA:"), prompt
        start = end + 1
    # Batch of one: the masked targets must not leak into the inputs (they may share memory).
    x, y = next(TokenLoader(ds, seq_len=n, global_batch_size=1, shuffle=False, prefetch=0))
    assert torch.equal(x[0], torch.from_numpy(stream[:-1]))
    assert torch.equal(y[0] == -100, torch.from_numpy(mask[1:] == 0))
    assert torch.equal(y[0][y[0] != -100], torch.from_numpy(stream[1:][mask[1:] == 1]))
    full = prepare_instructions(
        [corpus / "inst.jsonl"], tmp_path / "all", tokenizer=corpus / "data" / "tokenizer.json", train_on_prompt=True
    )
    assert full["splits"]["train"]["num_target_tokens"] == full["splits"]["train"]["num_tokens"]


# ------------------------------------------------------------------------------------------------ trainer


def args(corpus: Path, name: str, *extra: str) -> list[str]:
    vocab = json.loads((corpus / "data" / "manifest.json").read_text())["vocab_size"]
    return [
        "--model.preset=debug",
        "--model.n_layers=2",
        f"--model.vocab_size={vocab}",
        f"--data.source={corpus / 'data'}",
        "--data.seq_len=32",
        "--train.global_batch_size=4",
        "--train.steps=4",
        "--optim.warmup_steps=1",
        "--eval.every_steps=2",
        "--eval.num_batches=1",
        "--log.tensorboard=false",
        "--log.plot=false",
        "--sample.prompt=",
        f"--run.out_dir={corpus / 'runs'}",
        f"--run.name={name}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(corpus) -> dict[str, Path]:
    """A base run, then a LoRA fine-tune of it on instruction data with a monitor suite."""
    runs = corpus / "runs"
    assert main(["train", *args(corpus, "base")]) == 0
    assert (
        main(
            [
                "finetune",
                "prepare",
                str(corpus / "inst.jsonl"),
                "--out",
                str(corpus / "inst"),
                "--tokenizer",
                str(corpus / "data" / "tokenizer.json"),
            ]
        )
        == 0
    )
    (corpus / "suite.yaml").write_text(
        "name: monitors\nmax_new_tokens: 6\ntests:\n"
        "  - {name: short, prompt: 'Say hello', expect: [{max_length: 500}]}\n"
        "  - {name: impossible, prompt: 'Say hello', expect: [{contains: 'not in any completion'}]}\n"
    )
    lora = [
        f"--data.source={corpus / 'inst'}",
        f"--finetune.init_from={runs / 'base'}",
        "--finetune.lora_rank=4",
        "--finetune.lora_targets=wq,wv,w2",
        "--checkpoint.every_steps=2",
        f"--eval.suite={corpus / 'suite.yaml'}",
    ]
    assert main(["train", *args(corpus, "lora", *lora)]) == 0
    return {"base": runs / "base", "lora": runs / "lora"}


def test_lora_fine_tune_trains_adapters_on_a_frozen_base(runs):
    base = load_model(runs["base"]).model
    tuned = load_model(runs["lora"])
    assert tuned.config["finetune"]["lora_rank"] == 4
    base_params = dict(base.named_parameters())
    for name, p in tuned.model.named_parameters():
        if "lora" not in name:
            assert torch.equal(p, base_params[name]), name  # frozen
    assert any(v.abs().sum() > 0 for k, v in lora_tensors(tuned.model).items() if k.endswith("lora_b"))
    adapters = sorted((runs["lora"] / "adapters").glob("step_*.safetensors"))
    assert [p.name for p in adapters] == ["step_00000002.safetensors", "step_00000004.safetensors"]
    # The delta alone, loaded onto the base it names, is the fine-tuned model.
    via_adapter = load_model(adapters[-1])
    assert via_adapter.kind == "adapter"
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(via_adapter.model(x), tuned.model(x))
    # Merged into a plain model (plait run), it gives the same outputs within rounding.
    assert main(["finetune", "merge", str(adapters[-1]), "--out", str(runs["lora"].parent / "merged")]) == 0
    merged = load_model(runs["lora"].parent / "merged").model
    assert (merged(x) - tuned.model(x)).abs().max() < MERGE_ATOL


def test_every_path_that_samples_or_exports_a_lora_run_uses_its_adapters(runs, tmp_path):
    """generate, eval (load_model), the Python API, and the safetensors and Hugging Face exports of a LoRA run
    give the model it trained: its logits equal those of the base with the run's own adapter file loaded onto
    it (the training model's adapters, saved by the run), and differ from the base's."""
    import plait
    from plait.engine.generate import load_for_generation
    from plait.interop.hf import load_safetensors
    from test_interop import LOGITS_ATOL, hf_from_pretrained

    adapter = sorted((runs["lora"] / "adapters").glob("step_*.safetensors"))[-1]
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = load_model(adapter).model(x)
        base = load_model(runs["base"]).model(x)
        assert (trained - base).abs().max() > 100 * MERGE_ATOL  # the adapters change the logits
        assert torch.equal(load_for_generation(runs["lora"], "cpu")[0](x), trained)  # plait generate
        assert torch.equal(load_model(runs["lora"]).model(x), trained)  # plait eval, compress, serve
        assert torch.equal(plait.load_model(runs["lora"]).model(x), trained)  # Python
        assert (
            main(["ckpt", "export", str(runs["lora"]), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
        )
        assert (load_safetensors(tmp_path / "st" / "model.safetensors")(x) - trained).abs().max() < MERGE_ATOL
        assert main(["ckpt", "export", str(runs["lora"]), "--out", str(tmp_path / "hf")]) == 0
        assert (hf_from_pretrained(tmp_path / "hf")(x).logits - trained).abs().max() < MERGE_ATOL + LOGITS_ATOL


def test_plait_generate_of_a_lora_run_samples_the_adapted_model(runs, capsys):
    """The newcomer's reproduction: greedy `plait generate` of the LoRA run differs from the base's and equals
    `plait finetune generate BASE --adapter RUN`; the line before the text names the checkpoint and adapters."""
    prompt, n = "Say hello 2", "12"
    greedy = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", n, "--device", "cpu"]

    def said(argv: list[str]) -> tuple[str, str]:
        assert main(argv) == 0
        out = capsys.readouterr()
        return out.out, out.err

    tuned, err = said(["generate", str(runs["lora"]), *greedy])
    assert "the base with its r=4 LoRA adapters" in err and "step 4" in err, err
    base, _ = said(["generate", str(runs["base"]), *greedy])
    assert tuned != base
    served, _ = said(["finetune", "generate", str(runs["base"]), "--adapter", str(runs["lora"]),
                      "--prompt", prompt, "--max-new-tokens", n])  # fmt: skip
    header, continuation = served.split("\n", 2)[1:]
    assert header == f"--- adapter1: {prompt!r}"
    assert tuned == prompt + continuation


def test_lora_run_is_recorded_back_to_its_base_with_monitors(runs):
    reg = Registry(runs["lora"].parent / "lineage.sqlite")
    run = reg.find("lora")
    chain = [a.kind for a in reg.ancestors(run.id)]
    assert chain == ["run", "checkpoint", "run"]  # lora run <- base checkpoint <- base run
    base_ckpt = reg.get(run.parent_id)
    assert run.base_hash == base_ckpt.weights_hash == base_weights_hash(load_model(runs["base"]).model)
    assert run.data["loss_mask"] and run.data["fingerprint"]
    assert run.code["plait"] and run.status == "finished"
    monitors = reg.events(run.id, "monitor")
    assert [m["step"] for m in monitors] == [2, 4]
    assert all(m["payload"]["passed"] == 1 and m["payload"]["failed"] == 1 for m in monitors)
    adapters = reg.all("adapter")
    assert len(adapters) == 2 and all(a.base_hash == run.base_hash for a in adapters)
    metrics = [json.loads(line) for line in (runs["lora"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["monitor/failed"] for m in metrics if "monitor/failed" in m] == [1, 1]


def test_continued_pretraining_starts_from_the_given_weights(runs, corpus):
    # A learning rate too small to move fp32 weights measurably: the result is the init_from model.
    extra = [f"--finetune.init_from={runs['base']}", "--optim.lr=1e-12", "--train.steps=1", "--eval.every_steps=0"]
    assert main(["train", *args(corpus, "continued", *extra)]) == 0
    start = load_model(runs["base"]).model.state_dict()
    after = load_model(corpus / "runs" / "continued").model.state_dict()
    assert all(torch.allclose(after[k], v, atol=1e-9) for k, v in start.items())


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--finetune.lora_rank=4"], "adapts a trained model: set finetune.init_from"),
        (["--finetune.lora_rank=4", "--finetune.init_from=x", "--parallel.tp_degree=2"], "parallel.tp_degree=1"),
        (["--finetune.lora_rank=4", "--finetune.init_from=x", "--finetune.lora_targets=wq,qq"], "lora_targets"),
        (["--finetune.lora_rank=4", "--finetune.init_from=x", "--finetune.lora_dropout=1.5"], "lora_dropout"),
    ],
)
def test_bad_finetune_settings_are_refused(extra, message):
    """By the config check, or (the layouts adapters train in: rules.lora_problem) the runtime's layout check."""
    from plait.config import load_config
    from plait.parallel import ParallelDims, validate_layout

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, [e.removeprefix("--") for e in extra])
        world = cfg.parallel.tp_degree * cfg.parallel.pp_degree
        validate_layout(cfg, ParallelDims.from_config(cfg.parallel, world, cfg.model))


def test_init_from_another_model_shape_is_refused(runs, corpus, capsys):
    bigger = [f"--finetune.init_from={runs['base']}", "--model.dim=128", "--train.steps=1"]
    assert main(["train", *args(corpus, "wrong-shape", *bigger)]) == 2
    assert "holds another model (model.dim: 64 there, 128 here" in capsys.readouterr().err


def test_lora_run_resumes(runs, corpus, capsys):
    """The same LoRA command with more steps resumes the run's newest checkpoint (step 4): the adapters go on
    from there, the base stays frozen, and only steps 5 and 6 are trained, as one more run of the directory."""
    extra = [
        f"--data.source={corpus / 'inst'}",
        f"--finetune.init_from={runs['base']}",
        "--finetune.lora_rank=4",
        "--finetune.lora_targets=wq,wv,w2",
        "--train.steps=6",
        "--eval.every_steps=0",
    ]
    before = lora_tensors(load_model(runs["lora"]).model)
    capsys.readouterr()
    assert main(["train", *args(corpus, "lora", *extra)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"resumed from {runs['lora'] / 'checkpoints' / 'step_00000004'} (step 4)" in err, err[-2000:]
    rows = [json.loads(line) for line in (runs["lora"] / "metrics.jsonl").read_text().splitlines()]
    newest = rows[-1]["run_id"]
    # one more run of the directory, which logged its last step (log.every_steps=10) and no step of the first
    assert sorted(r["step"] for r in rows if r["run_id"] == newest and "train/loss" in r) == [6]
    assert len({r["run_id"] for r in rows}) == 2
    resumed = load_model(runs["lora"])
    assert resumed.path.name == "step_00000006"
    base = dict(load_model(runs["base"]).model.named_parameters())
    for name, p in resumed.model.named_parameters():
        if "lora" not in name:
            assert torch.equal(p, base[name]), name  # still frozen
    after = lora_tensors(resumed.model)
    assert after.keys() == before.keys() and any(not torch.equal(after[k], before[k]) for k in after)  # trained on


@pytest.mark.parametrize("start", ["plait base", "PEFT adapter", "plait base, Muon"])
def test_lora_under_fsdp_reproduces_the_single_process_run(runs, corpus, tmp_path, start):
    """dp_shard=2: the frozen base sharded by FSDP2, the adapters replicated with averaged gradients; from a
    plait base, or continuing a PEFT adapter made by peft (on the base's transformers export); with AdamW, or
    Muon on the adapters. Same tolerance and reason as tests/parallel/test_parallel.py: a reordering of fp32
    sums only."""
    from parallel_harness import read_metrics, run_layouts
    from plait.api import train
    from plait.config import load_config

    init_from = runs["base"]
    if start == "PEFT adapter":
        peft = pytest.importorskip("peft")
        from test_interop import hf_from_pretrained

        assert main(["ckpt", "export", str(runs["base"]), "--out", str(tmp_path / "base-hf")]) == 0
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                 init_lora_weights=False)  # fmt: skip
        peft.get_peft_model(hf_from_pretrained(tmp_path / "base-hf"), config).save_pretrained(str(tmp_path / "peft"))
        init_from = tmp_path / "peft"

    job = [
        o.removeprefix("--")
        for o in args(corpus, "fsdp")
        if not o.startswith(("--run.", "--eval.", "--train.steps", "--optim.warmup"))
    ]
    job += [
        f"finetune.init_from={init_from}",
        "finetune.lora_rank=4",
        "finetune.lora_targets=wq,wv,w2",
        "train.steps=4",
        "optim.warmup_steps=1",
        "optim.lr=1e-3",
        "eval.every_steps=0",
        "log.every_steps=1",
        "data.prefetch=0",
        "run.device=cpu",
        "checkpoint.save_final=false",
        *(["optim.name=muon"] if "Muon" in start else []),
    ]
    train(load_config(None, [*job, f"run.out_dir={tmp_path}", "run.name=ref"]))
    ref = read_metrics(tmp_path / "ref")
    (got,) = run_layouts(2, [[*job, "parallel.dp_shard_degree=2"]])
    assert "error" not in got, got.get("error")
    for step, loss in ref["loss"].items():
        assert got["loss"][step] == pytest.approx(loss, rel=1e-5), step
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=1e-5), step


# ---------------------------------------------------------------------------------------------- PEFT format


def test_a_lora_run_exports_as_a_peft_adapter_that_peft_loads_to_the_same_logits(runs, tmp_path):
    """`plait ckpt export RUN --format peft`: PEFT's PeftModel loads it onto the transformers export of the
    base, and gives the fine-tuned plait model's logits (fp32; test_interop's LOGITS_ATOL)."""
    peft = pytest.importorskip("peft")
    from test_interop import LOGITS_ATOL, hf_from_pretrained

    base_hf, adapter = tmp_path / "base-hf", tmp_path / "adapter"
    assert main(["ckpt", "export", str(runs["base"]), "--out", str(base_hf)]) == 0
    assert main(["ckpt", "export", str(runs["lora"]), "--format", "peft", "--out", str(adapter),
                 "--base", str(base_hf)]) == 0  # fmt: skip
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        16.0,
        ["down_proj", "q_proj", "v_proj"],
    )
    assert {oct(p.stat().st_mode & 0o777) for p in adapter.iterdir()} == {"0o644"}
    served = peft.PeftModel.from_pretrained(hf_from_pretrained(base_hf), str(adapter)).eval()
    tuned = load_model(runs["lora"]).model
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (served(x).logits - tuned(x)).abs().max() < LOGITS_ATOL
        assert (hf_from_pretrained(base_hf)(x).logits - tuned(x)).abs().max() > 100 * LOGITS_ATOL  # it adapts


def test_a_peft_adapter_trained_elsewhere_continues_in_plait(runs, corpus, tmp_path):
    """An adapter made by PEFT (random A and B) is loaded by finetune.init_from: the plait model equals
    PeftModel's logits, a run continues training it, and other LoRA settings are refused naming the adapter's."""
    peft = pytest.importorskip("peft")
    from plait.config import load_config
    from plait.lifecycle.finetune import apply_finetune
    from test_interop import LOGITS_ATOL, hf_from_pretrained

    base_hf, adapter = tmp_path / "base-hf", tmp_path / "elsewhere"
    assert main(["ckpt", "export", str(runs["base"]), "--out", str(base_hf)]) == 0
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trained = peft.get_peft_model(hf_from_pretrained(base_hf), config).eval()
    trained.save_pretrained(str(adapter))
    settings = ["--finetune.lora_rank=4", "--finetune.lora_alpha=8", "--finetune.lora_targets=wq,wv"]
    cfg = load_config(
        None, [a.removeprefix("--") for a in args(corpus, "peft", f"--finetune.init_from={adapter}", *settings)]
    )
    model = load_model(runs["base"]).model
    apply_finetune(cfg, [model])
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (trained(x).logits - model(x)).abs().max() < LOGITS_ATOL
    assert main(["train", *args(corpus, "peft", f"--finetune.init_from={adapter}", *settings)]) == 0
    continued = load_model(corpus / "runs" / "peft").model
    start = dict(lora_tensors(model))
    assert any(not torch.equal(v, start[k]) for k, v in lora_tensors(continued).items())  # it trained on
    with pytest.raises(
        ConfigError, match="continue it with finetune.lora_rank=4 finetune.lora_alpha=8 finetune.lora_targets=wq,wv"
    ):
        apply_finetune(
            load_config(
                None,
                [
                    a.removeprefix("--")
                    for a in args(corpus, "x", f"--finetune.init_from={adapter}", "--finetune.lora_rank=8")
                ],
            ),
            [load_model(runs["base"]).model],
        )
