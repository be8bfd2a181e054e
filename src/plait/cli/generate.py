"""`plait generate CHECKPOINT [--prompt TEXT] ...`: sample text from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from plait.cli.args import PlaitParser, check_input
from plait.core.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


def _parser() -> PlaitParser:
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
        "--database",
        "--data",
        dest="database",
        default="",
        help="A retrieval model: the prepared directory whose database it retrieves from (or its retrieval/ "
        "folder), any built with the model's encoder, tokenizer and chunk size (default: the one it trained on).",
    )
    parser.add_argument(
        "--show-neighbours",
        action="store_true",
        help="A retrieval model: print each passage retrieved whole (by default, its first words).",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="The prompt is a user's message: render it with the chat template the checkpoint carries (the one its "
        "run's data was rendered with), as the run learned to answer, and print the answer alone.",
    )
    return parser


def cmd_generate(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    check_input("", a.checkpoint, "a checkpoint directory or a run directory")  # before torch
    check_input("--database", a.database, "a prepared directory with a retrieval database (plait data retrieve)")
    _check_sampling(a)
    from plait.engine.checkpoint import resolve_checkpoint
    from plait.engine.generate import generate, load_for_generation
    from plait.engine.metrics import info
    from plait.lifecycle.retrieval import retrieved_passages

    found = resolve_checkpoint(a.checkpoint)
    model, tok, eos = load_for_generation(found, a.device)
    retrieve, used = _retrieval(a, model)  # a database the model cannot use: refused before anything is said
    info(f"sampling {_describe(found)}")
    ids, chat = _prompt_ids(a, found, tok, model.args.max_seq_len)
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
    report = retrieved_passages(retrieve, tok, outs, used) if retrieve is not None else []
    for i, out in enumerate(outs):
        if a.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tok.decode(out[len(ids) :] if chat else out))  # a chat: the answer alone
        if retrieve is not None:
            _print_passages([r for r in report if r.sample == i], retrieve, whole=a.show_neighbours)
    return 0


def _check_sampling(a) -> None:
    """The sampling settings in range, each refusal naming the flag and a valid value."""
    for flag, value, ok, valid in (
        ("--temperature", a.temperature, a.temperature >= 0, "0 or more (0: greedy), e.g. 0.8"),
        ("--top-k", a.top_k, a.top_k >= 0, "0 or more (0: off), e.g. 50"),
        ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1] (1: off), e.g. 0.95"),
        ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "at least 1, e.g. 200"),
        ("--num-samples", a.num_samples, a.num_samples >= 1, "at least 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range: {flag} must be {valid}")


def _prompt_ids(a, found, tok, max_seq_len: int):
    """(the prompt's token ids, the chat template it was rendered with or None): with --chat, the prompt as a
    user's message in the checkpoint's template; without it, the text as it is (and a hint where the checkpoint
    carries a template)."""
    from plait.engine.metrics import info

    chat = _chat_template(found, required=a.chat)
    if chat is not None and not a.chat:
        info(f"{found} carries the chat template its run learned with: --chat renders the prompt as a user's message")
        chat = None
    text = chat.render([{"role": "user", "content": a.prompt}], add_generation_prompt=True) if chat else a.prompt
    ids = tok.encode(text, add_special_tokens=chat is None).ids  # a template writes its own special tokens
    if not ids:
        raise ConfigError("--prompt is empty after tokenisation; give some text")
    if len(ids) >= max_seq_len:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the model supports {max_seq_len}")
    return ids, chat


def _retrieval(a, model):
    """(retrieve, used) for plait.engine.generate: a retrieval model's database (--database, else the one it
    trained on; refused where built with another encoder, tokenizer or chunk size) and the list its neighbours
    are noted in; (None, None) for a model that retrieves nothing, which refuses --database and
    --show-neighbours."""
    used: list[tuple[int, int, np.ndarray]] | None
    if model.args.retrieval_ids:
        from plait.lifecycle.retrieval import checkpoint_retriever

        retrieve, used = checkpoint_retriever(a.checkpoint, model, a.database, a.device), []
    else:
        retrieve, used = None, None
    if retrieve is None and (a.database or a.show_neighbours):
        raise ConfigError(
            f"{a.checkpoint} retrieves nothing (no model.retrieval_layers): drop --database / --show-neighbours"
        )
    return retrieve, used


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


PREVIEW_CHARS = 60
"""How much of a chunk's and a passage's text the report shows without --show-neighbours."""


def _print_passages(report: list, retrieve, *, whole: bool) -> None:
    """After a sample, the passages each complete chunk of it retrieved (plait.lifecycle.retrieval's
    ChunkPassages): a line per chunk (its number and first words), one per passage (its number in the
    database and its first words, or all of it with --show-neighbours)."""
    c, k = retrieve.chunk, retrieve.k
    print(f"passages retrieved from {retrieve.data_dir} (chunks of {c} tokens, {k} each):")
    if not report:
        print(f"  none: the text is shorter than one chunk of {c} tokens")
    for r in report:
        print(f"  chunk {r.chunk} {_preview(r.text, False)}")
        for p in r.passages:
            print(f"    database chunk {p.index}: {_preview(p.text, whole)}")


def _preview(text: str, whole: bool) -> str:
    """A text on one line (its repr: line breaks shown as \\n), cut to PREVIEW_CHARS unless whole."""
    if not whole and len(text) > PREVIEW_CHARS:
        return repr(text[:PREVIEW_CHARS]) + "..."
    return repr(text)
