"""Sampling from a trained model with a KV cache: temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from pathlib import Path

import torch

from plait.core.errors import PlaitError
from plait.model.llama import KVCache, Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator):
    """Pick one token per row of logits (B, vocab)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Continue each prompt (all of the same length) by up to max_new_tokens; stops early at eos_id.

    The prompt is run once (prefill); each new token then costs one single-position forward that reads
    the cached keys and values of all earlier positions.
    """
    model.eval()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    lengths = {len(p) for p in prompt_ids}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError("prompts must be non-empty and of equal length")
    prompt_len = lengths.pop()
    total = min(prompt_len + max_new_tokens, model.args.max_seq_len)
    cache = KVCache(model.args, len(prompt_ids), total, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(prompt_ids, device=device)
    out = [list(p) for p in prompt_ids]
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    logits = model(tokens, cache=cache)[:, -1]
    for _ in range(total - prompt_len):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = eos_id is not None and t == eos_id
        if bool(done.all()):
            break
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return out


def load_for_generation(path: str | Path, device: str = "auto"):
    """(model, tokenizer, eos id) from a checkpoint directory, or from a run directory's newest checkpoint."""
    from plait.core.hardware import resolve_device
    from plait.data import eos_id, load_tokenizer
    from plait.engine.checkpoint import load_model_weights, local_file, read_config, resolve_checkpoint

    found = resolve_checkpoint(path)
    cfg = read_config(found)
    if cfg.model.retrieval_ids:
        raise PlaitError(
            f"{found} is a retrieval model: generation with it (new neighbours every chunk, from its database) is "
            "not built yet; its validation loss is in the run's metrics (plait eval MODEL measures perplexity)"
        )
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=resolve_device(device))
    model.init_weights(0)  # rotary tables; the weights are overwritten below
    load_model_weights(model, found)
    tok_path = local_file(found / "tokenizer.json")
    if tok_path is None:
        raise PlaitError(f"checkpoint {found} has no tokenizer.json: plait generate needs one to read prompts")
    tok = load_tokenizer(tok_path)
    return model, tok, eos_id(tok)
