"""`plait generate CHECKPOINT [--prompt TEXT] ...`: sample text from a checkpoint."""

from __future__ import annotations

from plait.cli.args import PlaitParser
from plait.core.errors import ConfigError


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
    a = parser.parse_args(argv)
    for flag, value, ok, valid in (
        ("--temperature", a.temperature, a.temperature >= 0, "0 or more (0: greedy), e.g. 0.8"),
        ("--top-k", a.top_k, a.top_k >= 0, "0 or more (0: off), e.g. 50"),
        ("--top-p", a.top_p, 0 < a.top_p <= 1, "in (0, 1] (1: off), e.g. 0.95"),
        ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "at least 1, e.g. 200"),
        ("--num-samples", a.num_samples, a.num_samples >= 1, "at least 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range: {flag} must be {valid}")
    from plait.engine.generate import generate, load_for_generation

    model, tok, eos = load_for_generation(a.checkpoint, a.device)
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise ConfigError("--prompt is empty after tokenisation; give some text")
    if len(ids) >= model.args.max_seq_len:
        raise ConfigError(f"--prompt has {len(ids)} tokens; the model supports {model.args.max_seq_len}")
    outs = generate(
        model,
        [ids] * a.num_samples,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_id=eos,
        seed=a.seed,
    )
    for i, out in enumerate(outs):
        if a.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tok.decode(out))
    return 0
