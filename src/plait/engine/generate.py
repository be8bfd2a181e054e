"""Sampling from a trained model with a KV cache: temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.core.errors import PlaitError
from plait.model.llama import KVCache, Transformer

if TYPE_CHECKING:
    from plait.core.storage import Location


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
    retrieve: Retrieve | None = None,
    used: list[tuple[int, int, np.ndarray]] | None = None,
) -> list[list[int]]:
    """Continue each prompt (all of the same length) by up to max_new_tokens; stops early at eos_id.

    The prompt is run once (prefill); each new token then costs one single-position forward that reads
    the cached keys and values of all earlier positions. A retrieval model (model.retrieval_layers) needs
    `retrieve` (plait.data.retrieval.Retriever) and runs `_generate_retrieving` instead; `used` collects the
    neighbours it retrieved.
    """
    if model.args.retrieval_ids:
        if retrieve is None:
            raise PlaitError(
                "a retrieval model generates with neighbours from its database: pass retrieve=Retriever(...)"
            )
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, seed=seed)
        return _generate_retrieving(model, prompt_ids, max_new_tokens, retrieve, used, **sampling)
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


Retrieve = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # chunks (n, c) -> ids (n, k), tokens (n, k, 2c)


@torch.no_grad()
def _generate_retrieving(model: Transformer, prompt_ids, max_new_tokens: int, retrieve: Retrieve, used, **sampling):
    """RETRO's generation: each time a chunk of c tokens is complete, its k neighbours are retrieved (once per
    sample and chunk), and every new token is one forward of the whole sequence so far, right-padded to whole
    chunks, with the neighbours of its complete chunks (a token sees those of the chunks ending at or before
    it, so the padding and the last chunk's empty neighbours reach nothing before it: no cache of keys and
    values across chunk boundaries). `used` gets (sample, chunk, database chunk numbers) per retrieval."""
    model.eval()
    device = next(model.parameters()).device
    c, k = model.args.retrieval_chunk, model.args.retrieval_k
    if len({len(p) for p in prompt_ids}) != 1 or not prompt_ids[0]:
        raise ValueError("prompts must be non-empty and of equal length")
    rows, length = [list(p) for p in prompt_ids], len(prompt_ids[0])
    total = min(length + max_new_tokens, model.args.max_seq_len // c * c)
    gen = torch.Generator().manual_seed(sampling["seed"])
    out, done = [list(p) for p in prompt_ids], [False] * len(rows)
    found = np.zeros((len(rows), -(-total // c), k, 2 * c), dtype=np.int64)  # those of complete chunks, then 0
    retrieved = 0  # chunks whose neighbours are in `found`
    while length < total and not all(done):
        while length // c > retrieved:  # each complete chunk (a prompt may hold several; rows grow together)
            chunks = np.array([r[retrieved * c : (retrieved + 1) * c] for r in rows])
            ids, found[:, retrieved] = retrieve(chunks)
            for i, row_ids in enumerate(ids):
                if used is not None:
                    used.append((i, retrieved, row_ids))
            retrieved += 1
        padded = -(-length // c) * c
        tokens = torch.zeros(len(rows), padded, dtype=torch.long)
        tokens[:, :length] = torch.tensor(rows)
        neighbours = torch.from_numpy(found[:, : padded // c]).reshape(len(rows), -1)
        logits = model(torch.cat([tokens, neighbours], 1).to(device))[:, length - 1]
        nxt = sample_next(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"], gen).tolist()
        for i, t in enumerate(nxt):
            rows[i].append(t)
            if not done[i]:
                out[i].append(t)
                done[i] = sampling["eos_id"] is not None and t == sampling["eos_id"]
        length += 1
    return out


def load_for_generation(path: str | Location, device: str = "auto"):
    """(model, tokenizer, eos id) from a checkpoint directory, or from a run directory's newest checkpoint: the
    model as its run trained it (a LoRA run's base with its adapters; ``checkpoint_model``)."""
    from plait.core.hardware import resolve_device
    from plait.data import eos_id, load_tokenizer
    from plait.engine.checkpoint import checkpoint_model, local_file, resolve_checkpoint

    found = resolve_checkpoint(path)
    model = checkpoint_model(found, resolve_device(device))
    tok_path = local_file(found / "tokenizer.json")
    if tok_path is None:
        raise PlaitError(f"checkpoint {found} has no tokenizer.json: plait generate needs one to read prompts")
    tok = load_tokenizer(tok_path)
    return model, tok, eos_id(tok)
