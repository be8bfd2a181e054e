"""Your own dataset as plait batches: any sequence or iterable of samples, one sample per row.

A sample is a token sequence of at least seq_len + 1 tokens (a list, a 1-D tensor or array), or a dict with
"input_ids" (as a Hugging Face `datasets` dataset gives) and optionally "labels" (the same length, -100 where a
token is not scored). The first seq_len + 1 tokens are used: inputs are tokens[:-1], targets tokens[1:].

Every data-parallel rank takes its rows of each global batch (rank r: rows r, r + dp, r + 2 dp, ...), and the
position is one number, the samples consumed, saved with each checkpoint: a map-style dataset (len and
indexing, as `datasets.Dataset`) resumes by index, an iterable one by reading past that many samples. A
sequence is read in epochs (in order; shuffle it yourself if you want another order), an iterable once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import cast

import torch

from plait.core.errors import ConfigError


class SampleLoader:
    def __init__(
        self,
        samples: Iterable,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if global_batch_size % dp_degree:
            raise ConfigError(f"train.global_batch_size={global_batch_size} must be a multiple of dp={dp_degree}")
        self.samples, self.seq_len, self.global_batch_size = samples, seq_len, global_batch_size
        self.dp_rank, self.dp_degree, self.device = dp_rank, dp_degree, torch.device(device)
        self.indexed = hasattr(samples, "__len__") and hasattr(samples, "__getitem__")
        if self.indexed and len(cast(Sequence, samples)) == 0:
            raise ConfigError("the dataset given to the trainer is empty")
        self._consumed = 0
        self._iter: Iterator | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(cast(Sequence, self.samples)) // self.global_batch_size if self.indexed else 1 << 62

    def __iter__(self) -> SampleLoader:
        return self

    def _sample(self, i: int):
        if self.indexed:
            indexed = cast(Sequence, self.samples)  # it has __len__ and __getitem__
            return indexed[i % len(indexed)]
        if self._iter is None:  # (re)start: skip what a resumed run already consumed
            self._iter = iter(self.samples)
            for _ in range(i):
                next(self._iter)
        try:
            return next(self._iter)
        except StopIteration:
            raise StopIteration(f"the dataset ran out after {i} samples") from None

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._consumed
        rows = [self._row(self._sample(start + j), start + j) for j in range(self.global_batch_size)]
        self._consumed += self.global_batch_size
        mine = rows[self.dp_rank :: self.dp_degree]
        inputs = torch.stack([r[0] for r in mine]).to(self.device)
        targets = torch.stack([r[1] for r in mine]).to(self.device)
        return inputs, targets

    def _row(self, sample, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = None
        if isinstance(sample, dict):
            if "input_ids" not in sample:
                raise ConfigError(f"sample {index} is a dict without 'input_ids' (keys: {sorted(sample)[:6]})")
            sample, labels = sample["input_ids"], sample.get("labels")
        tokens = torch.as_tensor(sample, dtype=torch.long).flatten()
        if tokens.numel() < self.seq_len + 1:
            raise ConfigError(
                f"sample {index} has {tokens.numel()} tokens; data.seq_len={self.seq_len} needs at least "
                f"{self.seq_len + 1} (inputs and the next-token targets): pack or pad your samples"
            )
        tokens = tokens[: self.seq_len + 1]
        if labels is not None:  # aligned with input_ids, as Hugging Face's labels are
            return tokens[:-1], torch.as_tensor(labels, dtype=torch.long).flatten()[1 : self.seq_len + 1]
        targets = tokens[1:]
        return tokens[:-1], targets

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self._consumed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seq_len") != self.seq_len:
            raise ConfigError(
                f"data loader state has seq_len={state.get('seq_len')} but this run uses seq_len={self.seq_len}"
            )
        self._consumed, self._iter = int(state["samples_consumed"]), None

    def close(self) -> None:
        self._iter = None
