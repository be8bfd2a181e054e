"""`plait generate CHECKPOINT [--prompt TEXT] ...`: sample text from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from plait.cli.args import PlaitParser, check_input
from plait.core.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


def cmd_generate(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait generate", description="Sample text from a checkpoint.")
    parser.add_argument("checkpoint", help="A checkpoint directory, or a run directory (its newest checkpoint).")
    parser.add_argument("--prompt", default="OTHELLO.", help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to generate per sample.")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding.")
    parser.add_argument("--top-k", type=int, default=50, help="0 disables top-k.")
    parser.add_argument("--top-p", type=float, default=0.95, help="1.0 disables nucleus sampling.")
    parser.add_argument("--num-samples", type=int, default=1, help="Independent samples of the prompt.")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed (the same seed, the same text).")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (a GPU if there is one).")
    parser.add_argument(
        "--data",
        default="",
        help="A retrieval model's prepared directory with its database (default: the one it trained on).",
    )
    parser.add_argument(
        "--show-neighbours", action="store_true", help="A retrieval model: print the neighbours each chunk retrieved."
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="The prompt is a user's message: render it with the chat template the checkpoint carries (the one its "
        "run's data was rendered with), as the run learned to answer, and print the answer alone.",
    )
    a = parser.parse_args(argv)
    check_input("", a.checkpoint, "a checkpoint directory or a run directory")  # before torch
    for flag, value, ok, valid in (
        ("--temperature", a.temperature, a.temperature >= 0, "0 or more (0: greedy), e.g. 0.8"),
        ("--top-k", a.top_k, a.top_k >= 0, "0 or more (0: off), e.g. 50"),
        ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1] (1: off), e.g. 0.95"),
        ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "at least 1, e.g. 200"),
        ("--num-samples", a.num_samples, a.num_samples >= 1, "at least 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range: {flag} must be {valid}")
    from plait.engine.checkpoint import resolve_checkpoint
    from plait.engine.generate import generate, load_for_generation
    from plait.engine.metrics import info

    found = resolve_checkpoint(a.checkpoint)
    model, tok, eos = load_for_generation(found, a.device)
    info(f"sampling {_describe(found)}")
    chat = _chat_template(found, required=a.chat)
    if chat is not None and not a.chat:
        info(f"{found} carries the chat template its run learned with: --chat renders the prompt as a user's message")
        chat = None
    text = chat.render([{"role": "user", "content": a.prompt}], add_generation_prompt=True) if chat else a.prompt
    ids = tok.encode(text, add_special_tokens=chat is None).ids  # a template writes its own special tokens
    if not ids:
        raise ConfigError("--prompt is empty after tokenisation; give some text")
    if len(ids) >= model.args.max_seq_len:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the model supports {model.args.max_seq_len}")
    used: list[tuple[int, int, np.ndarray]] | None
    retrieve, used = (
        (_retriever(a.checkpoint, a.data, model, a.device), []) if model.args.retrieval_ids else (None, None)
    )
    if retrieve is None and (a.data or a.show_neighbours):
        raise ConfigError(
            f"{a.checkpoint} retrieves nothing (no model.retrieval_layers): drop --data / --show-neighbours"
        )
    outs = generate(
        model,
        [ids] * a.num_samples,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_id=eos,
        seed=a.seed,
        retrieve=retrieve,
        used=used,
    )
    for i, out in enumerate(outs):
        if a.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tok.decode(out[len(ids) :] if chat else out))  # a chat: the answer alone
        if a.show_neighbours:
            _print_neighbours(tok, out, [(chunk, found) for row, chunk, found in used or [] if row == i], retrieve)
    return 0


def _chat_template(ckpt, *, required: bool):
    """The chat template a checkpoint carries beside its tokenizer.json. With --chat (`required`): a one-line
    refusal where there is none, and a damaged one's own error; without it, None in both cases (only a hint)."""
    from plait.core.errors import PlaitError
    from plait.data.chat import load_chat_template

    try:
        template = load_chat_template(ckpt) if isinstance(ckpt, Path) else None
    except PlaitError:
        if required:
            raise
        return None
    if template is None and required:
        raise ConfigError(
            f"--chat: {ckpt} carries no chat template (its run trained on plain text, or on prompt/response data "
            "without one); drop --chat, or fine-tune on data prepared with `plait finetune prepare --chat-template "
            "chatml`"
        )
    return template


def _describe(ckpt) -> str:
    """Which checkpoint, which step, and what it holds beyond the plain model (a LoRA run's adapters)."""
    from plait.engine.checkpoint import read_config, read_meta

    step = read_meta(ckpt).get("train_state", {}).get("step")
    tune = read_config(ckpt).finetune
    adapters = f", the base with its r={tune.lora_rank} LoRA adapters ({tune.lora_targets})" if tune.lora_rank else ""
    return f"{ckpt} (step {step}{adapters})"


def _retriever(checkpoint: str, data: str, model, device: str):
    """The database a retrieval model reads (--data, or the prepared directory it trained on), with the
    encoder it was built with."""
    from plait.core.hardware import resolve_device
    from plait.engine.checkpoint import read_config, resolve_checkpoint
    from plait.lifecycle.retrieval import database_retriever

    data = data or read_config(resolve_checkpoint(checkpoint)).data.source
    if data == "shakespeare" or "," in data:
        raise ConfigError(f"{checkpoint} trained on {data!r}, which has no retrieval database: give --data DIR")
    return database_retriever(data, model, str(resolve_device(device)))


def _print_neighbours(tok, out: list[int], found: list, retrieve) -> None:
    """Each retrieved chunk's text and its neighbours' (database chunk number, text of chunk + continuation)."""
    c = retrieve.chunk
    for chunk, ids in found:
        print(f"  chunk {chunk} {tok.decode(out[chunk * c : (chunk + 1) * c])!r} retrieved:")
        for j in ids.tolist():
            text = tok.decode(retrieve.store.tokens(j * c, (j + 2) * c).tolist())
            print(f"    database chunk {j}: {text!r}")
