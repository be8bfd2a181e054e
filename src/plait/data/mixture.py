"""A weighted mixture of prepared corpora (`data.sources`), served as resumable, DP-sharded batches.

Each global batch of G sequences takes c_s from source s, with c_s = floor(w_s G) or one more: the sources
that get the one more are those furthest behind their share of everything served so far (the deficit
w_s (N + G) - n_s, N the sequences served, n_s those of s; ties to the earlier source). So every batch holds
each source's share to within one sequence, and over many batches each source's count stays within one
sequence of w_s N. The state is the per-source count n alone: the next batch follows from it, whatever the
step, the global batch size or the weights of the saving run.

Within a source, sequences come in the order TokenLoader gives a single corpus (epoch-major permutations),
from a seed of its own drawn from (run.seed, source index). A batch's sequences are then put in an order
drawn from (run.seed, N), and DP rank r takes the contiguous slice [r G/dp, (r+1) G/dp) of it: the global
batch is the same at every data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from plait.core.errors import ConfigError
from plait.data.loader import TokenDataset, TokenLoader, _BatchPlan, batch_of


@dataclass
class Mixture:
    """One split of each source, by name, with the sources' relative weights."""

    names: list[str]
    datasets: list[TokenDataset]
    weights: list[float]

    @property
    def shares(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()


def open_mixture(
    sources: list[tuple[str, str, float]], split: str, vocab_size: int, remote_cache_mb: int = 256
) -> Mixture:
    """The split of every source of data.sources, checked to share one tokenizer and fit the vocabulary."""
    from plait.data.loader import read_manifest

    datasets, tokenizers = [], {}
    for name, path, _ in sources:
        manifest = read_manifest(path)
        tokenizers[name] = manifest.get("tokenizer_sha256")
        dataset = TokenDataset(path, split, remote_cache_mb)
        if dataset.vocab_size > vocab_size:
            raise ConfigError(
                f"data.sources {name!r} ({path}) has a vocabulary of {dataset.vocab_size}, more than "
                f"model.vocab_size={vocab_size}; set model.vocab_size={dataset.vocab_size}"
            )
        datasets.append(dataset)
    first = sources[0][0]
    other = [n for n, sha in tokenizers.items() if sha != tokenizers[first]]
    if other:
        raise ConfigError(
            f"data.sources {other[0]!r} was prepared with another tokenizer than {first!r} (tokenizer.json "
            "differs): the same token ids would mean different text; prepare every source with one tokenizer "
            "(plait data prepare --tokenizer DIR_OR_FILE)"
        )
    return Mixture([n for n, _, _ in sources], datasets, [w for _, _, w in sources])


def mixture_counts(consumed: np.ndarray, shares: np.ndarray, global_batch: int) -> np.ndarray:
    """Sequences each source gives to the next global batch, from the sequences each has given so far."""
    base = np.floor(shares * global_batch).astype(np.int64)
    extra = global_batch - int(base.sum())
    if extra:
        deficit = shares * (consumed.sum() + global_batch) - consumed - base
        ahead = np.argsort(-deficit, kind="stable")[:extra]  # the furthest behind first; ties: earlier source
        base[ahead] += 1
    return base


class _MixturePlan:
    """Maps the per-source cursor to this rank's batch; holds no reference to the loader."""

    def __init__(self, mixture: Mixture, seq_len: int, global_batch_size: int, dp_rank: int, dp_degree: int,
                 seed: int, shuffle: bool) -> None:  # fmt: skip
        self.mixture, self.seq_len, self.seed, self.shuffle = mixture, seq_len, seed, shuffle
        self.global_batch_size, self.dp_rank = global_batch_size, dp_rank
        self.local_batch_size = global_batch_size // dp_degree
        self.shares = mixture.shares
        self.plans = [
            _BatchPlan(d, seq_len, global_batch_size, dp_rank, dp_degree, _source_seed(seed, i), shuffle)
            for i, d in enumerate(mixture.datasets)
        ]
        self.num_windows = sum(p.num_windows for p in self.plans)

    def counts(self, cursor: tuple[int, ...]) -> np.ndarray:
        return mixture_counts(np.asarray(cursor, dtype=np.int64), self.shares, self.global_batch_size)

    def advance(self, cursor: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(n) for n in np.asarray(cursor) + self.counts(cursor))

    def members(self, cursor: tuple[int, ...]) -> list[tuple[int, int]]:
        """The global batch at `cursor` as (source, that source's sample number), in the batch's order."""
        pairs = [(s, cursor[s] + j) for s, c in enumerate(self.counts(cursor)) for j in range(int(c))]
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, sum(cursor)])))
            pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        return pairs

    def build(self, cursor: tuple[int, ...], pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.dp_rank * self.local_batch_size
        mine = self.members(cursor)[first : first + self.local_batch_size]
        windows = [(self.mixture.datasets[s], self.plans[s].window(g)) for s, g in mine]
        return batch_of(windows, self.seq_len, pin)


def _source_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class MixtureLoader(TokenLoader):
    """TokenLoader's interface over a Mixture: an infinite iterator of (inputs, targets) whose state is the
    sequences served per source (state_dict / load_state_dict), resumable at another DP degree, global batch
    size or set of weights. A source added since the saving run starts at its beginning."""

    def __init__(self, mixture: Mixture, **kw) -> None:
        for dataset in mixture.datasets:
            dataset.check_seq_len(kw["seq_len"])
        self.mixture = mixture
        super().__init__(mixture.datasets[0], **kw)
        self._samples_consumed = tuple(0 for _ in mixture.names)  # type: ignore[assignment]

    def _make_plan(self, seq_len: int, global_batch_size: int, seed: int):
        return _MixturePlan(self.mixture, seq_len, global_batch_size, self.dp_rank, self.dp_degree, seed,
                            self.shuffle)  # fmt: skip

    def _cursor(self) -> tuple[int, ...]:
        """The sequences served per source: a mixture's cursor (TokenLoader's is one int)."""
        return cast(tuple[int, ...], self._samples_consumed)

    @property
    def epoch(self) -> int:
        """Passes over the most-passed source."""
        plans = cast(_MixturePlan, self._plan).plans
        return max(n // p.num_windows for n, p in zip(self._cursor(), plans, strict=True))

    def source_tokens(self) -> dict[str, int]:
        """Tokens served per source so far (the sequences handed to the caller, seq_len each)."""
        cursor = self._cursor()
        return {n: int(c) * self.seq_len for n, c in zip(self.mixture.names, cursor, strict=True)}

    def state_dict(self) -> dict:
        cursor = self._cursor()
        return {
            "samples_consumed": int(sum(cursor)),
            "source_samples": dict(zip(self.mixture.names, map(int, cursor), strict=True)),
            "seed": self._plan.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if "source_samples" not in state:
            raise ConfigError(
                "the checkpoint's data position is of one corpus (data.source), this run reads a mixture "
                "(data.sources): the position cannot be carried over; resume with the run's own data settings"
            )
        super().load_state_dict(state)
        saved = state["source_samples"]
        self._samples_consumed = tuple(int(saved.get(n, 0)) for n in self.mixture.names)  # type: ignore


def source_tokens(loader) -> dict[str, int]:
    """Tokens served per source by a MixtureLoader; {} for any other loader."""
    return loader.source_tokens() if isinstance(loader, MixtureLoader) else {}
