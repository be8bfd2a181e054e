"""Your own model, data, loss and callback, trained by plait from Python: FSDP over 2 CPU processes.

    torchrun --nproc-per-node 2 examples/custom_model.py --out runs-example

plait builds the model on the meta device, shards each block of `model.layers` and the root with FSDP2
(parallel.* settings apply: activation checkpointing, CPU offload, compile), allocates each rank's shards,
initialises them (the model's init_weights(), else each module's reset_parameters()), and runs the same loop,
checkpoints (resume by running the command again with more --steps), guards and metrics as `plait train`.
The data is any sequence of token sequences (here: windows of this file's bytes); a Hugging Face
`datasets.Dataset` with an "input_ids" column works the same way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import plait

SEQ_LEN = 64


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A small byte-level causal language model: nothing plait-specific."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, dim), nn.Embedding(SEQ_LEN, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))  # plait's FSDP units
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def byte_windows(text: bytes, seq_len: int) -> list[list[int]]:
    """Your dataset: overlapping windows of seq_len + 1 tokens (inputs and next-token targets)."""
    return [list(text[i : i + seq_len + 1]) for i in range(0, len(text) - seq_len - 1, seq_len // 2)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Your loss: the mean over the micro-batch (plait averages micro-batches and data-parallel ranks)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LossHistory(plait.Callback):
    """Your callback: every step's loss, written to <run>/losses.json by the main rank at the end."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def after_step(self, run, step, result) -> None:
        self.losses[step] = result.loss.item()  # (run.roll_back() would roll the run back to its last checkpoint)

    def on_end(self, run, final) -> None:
        if run.env.is_main:
            (run.cfg.run_dir / "losses.json").write_text(json.dumps(self.losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs", help="where runs/<name> goes (default: runs)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    cfg = plait.Config()
    cfg.run.out_dir, cfg.run.name = args.out, "custom-model"
    cfg.data.seq_len = SEQ_LEN
    cfg.train.steps, cfg.train.global_batch_size, cfg.train.micro_batch_size = args.steps, 8, 2
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 5
    cfg.eval.every_steps, cfg.checkpoint.every_steps = 20, 20
    cfg.sample.max_new_tokens = 0  # plait's sampler is for its own model

    text = Path(__file__).read_bytes()
    cut = len(text) * 9 // 10
    trainer = plait.Trainer(
        cfg,
        model=ByteLM,  # called on the meta device
        data=byte_windows(text[:cut], SEQ_LEN),
        val_data=byte_windows(text[cut:], SEQ_LEN),
        loss=loss_fn,
        callbacks=[LossHistory()],
    )
    final = trainer.fit()
    if trainer.env.is_main:
        print(f"final loss {final.get('loss', float('nan')):.3f}, validation {final.get('val_loss', float('nan')):.3f}")


if __name__ == "__main__":
    main()
