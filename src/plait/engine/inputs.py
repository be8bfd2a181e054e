"""The run's data, wired to the trainer: the training and validation samples (a prepared corpus, a weighted
mixture of them, a retrieval corpus, or samples given to the Trainer), checked before the model is built, and
the loaders that cut this data-parallel rank's batches from them.

`RunData.prepare` does the checks a run needs before its first step (the tokenizer every checkpoint carries,
a vocabulary that fits the model, splits long enough for a window); `train_loader` and `val_loaders` make
the loaders once the meshes exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.config import Config
from plait.config.validate import data_sources
from plait.core.errors import ConfigError
from plait.data import TokenDataset, TokenLoader, ensure_prepared
from plait.data.mixture import Mixture, MixtureLoader, open_mixture
from plait.data.remote import is_remote_source, mirror
from plait.data.retrieval import RetrievalDataset, read_database
from plait.data.retrieval_live import LiveIndex, check_learned_database
from plait.data.samples import SampleLoader
from plait.parallel import DistEnv, Meshes


@dataclass
class RunData:
    """The training and validation samples of one run, and where they come from.

    train: a TokenDataset, Mixture or RetrievalDataset of a prepared corpus, or the samples given to the
    Trainer; val: its validation split (None: the Trainer was given data= without val_data=); data_dir: the
    prepared directory (a mixture's first source), None for samples given to the Trainer."""

    cfg: Config
    train: Any
    val: Any
    data_dir: Path | None = None
    live: LiveIndex | None = None  # model.retrieval_learned: the index both splits search (retrieval_refresh)

    @classmethod
    def prepare(cls, cfg: Config, env: DistEnv, data=None, val_data=None) -> RunData:
        """The run's samples: `data` and `val_data` when given, else cfg.data.sources (a mixture) or
        cfg.data.source (prepared by the main rank if it is a bundled corpus), checked now, not at the first
        batch."""
        if data is not None:
            return cls(cfg, data, val_data)
        if cfg.data.sources and cfg.model.retrieval_ids:
            raise ConfigError(
                "model.retrieval_layers reads one prepared directory and its retrieval database: set data.source, "
                "not data.sources"
            )
        if cfg.data.sources:
            return cls._mixture(cfg)
        return cls._corpus(cfg, _prepared_dir(cfg, env))

    @classmethod
    def _mixture(cls, cfg: Config) -> RunData:
        """A weighted mixture of prepared directories (data.sources)."""
        sources = [(n, str(local_dir(cfg, p)), w) for n, p, w in data_sources(cfg.data.sources)]
        mb = cfg.data.remote_cache_mb
        run = cls(
            cfg,
            open_mixture(sources, "train", cfg.model.vocab_size, mb),
            open_mixture(sources, "val", cfg.model.vocab_size, mb),
            Path(sources[0][1]),
        )
        check_tokenizer(Path(sources[0][1]))
        for split in (*run.train.datasets, *run.val.datasets):  # fail now if one cannot be cut
            split.check_seq_len(cfg.data.seq_len)
        return run

    @classmethod
    def _corpus(cls, cfg: Config, data_dir: Path) -> RunData:
        """One prepared directory (data.source): its token splits, or with model.retrieval_layers windows on
        chunk boundaries, each with its chunks' neighbours (RETRO)."""
        check_tokenizer(data_dir)
        mb, m = cfg.data.remote_cache_mb, cfg.model
        train: TokenDataset | RetrievalDataset
        val: TokenDataset | RetrievalDataset
        if m.retrieval_ids:
            train, val = (
                RetrievalDataset(data_dir, split, chunk=m.retrieval_chunk, k=m.retrieval_k, remote_cache_mb=mb)
                for split in ("train", "val")
            )
            if m.retrieval_learned:  # neighbours searched with the learned encoder's index, not the built ones
                db = read_database(data_dir)
                check_learned_database(data_dir, db, m.retrieval_dim)
                train.live = val.live = LiveIndex(data_dir, db, chunk=m.retrieval_chunk, k=m.retrieval_k)
        else:
            train, val = TokenDataset(data_dir, "train", mb), TokenDataset(data_dir, "val", mb)
        if train.vocab_size > m.vocab_size:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({train.vocab_size}); set model.vocab_size={train.vocab_size}"
            )
        for split in (train, val):  # fail now, not at the first batch, if they cannot be cut
            split.num_samples(cfg.data.seq_len)
            if m.retrieval_ids:
                split.check_seq_len(cfg.data.seq_len)
        return cls(cfg, train, val, data_dir, getattr(train, "live", None))

    def eos_id(self) -> int:
        """The corpus's document separator (data.document_mask)."""
        data = self.train.datasets[0] if isinstance(self.train, Mixture) else self.train
        if not isinstance(data, TokenDataset):
            raise ConfigError(
                "data.document_mask=true needs a prepared corpus (data.source or data.sources), whose EOS token "
                "separates its documents; your data has none: set data.document_mask=false"
            )
        return data.eos_id

    def document_lengths(self) -> str:
        """data.document_mask: what happens to documents longer than a window, with the corpus's mean length."""
        datasets = self.train.datasets if isinstance(self.train, Mixture) else [self.train]
        tokens = sum(d.num_tokens for d in datasets if isinstance(d, TokenDataset))
        docs = sum(d.num_documents for d in datasets if isinstance(d, TokenDataset))
        mean = f"{tokens / docs:,.0f} tokens on average" if docs else "of unrecorded length"
        seq_len = self.cfg.data.seq_len
        return (
            f"document masking: each document attended alone, positions from its first token (documents here: "
            f"{mean}); a document longer than data.seq_len={seq_len} is cut at each window's end, and each piece "
            "is attended alone from position 0"
        )

    def train_loader(self, meshes: Meshes, device: torch.device) -> TokenLoader | MixtureLoader | SampleLoader:
        """This data-parallel rank's share of each global training batch (shuffled as data.shuffle says)."""
        return _loader(self.cfg, meshes, device, self.train)

    def val_loaders(self, meshes: Meshes, device: torch.device) -> dict[str, tuple[Any, float]]:
        """Fresh loaders over each source's validation split (the same batches each time), by name, with its
        share of the mixture ({"": (loader, 1.0)} for one corpus); {} when there is no validation split."""
        if self.val is None:
            return {}
        if not isinstance(self.val, Mixture):
            return {"": (_loader(self.cfg, meshes, device, self.val, validation=True), 1.0)}
        m = self.val
        return {n: (_loader(self.cfg, meshes, device, d, validation=True), float(w))
                for n, d, w in zip(m.names, m.datasets, m.shares, strict=True)}  # fmt: skip


def _prepared_dir(cfg: Config, env: DistEnv) -> Path:
    """data.source as a prepared directory on every rank: a remote one described locally by each (two small
    reads); a bundled corpus tokenised once by the main rank, the others waiting for its path."""
    prepared = ""
    if is_remote_source(cfg.data.source):
        prepared = str(local_dir(cfg, cfg.data.source))
    elif env.is_main:
        cache = Path(cfg.data.cache_dir).expanduser()
        prepared = str(ensure_prepared(cfg.data.source, cache, cfg.model.vocab_size))
    if env.world_size > 1 and not is_remote_source(cfg.data.source):
        box = [prepared]
        dist.broadcast_object_list(box, src=0)
        prepared = box[0]
    return Path(prepared)


def local_dir(cfg: Config, source: str) -> Path:
    """A prepared directory here: the directory itself, or the local description of one on S3."""
    if not is_remote_source(source):
        return Path(source)
    return mirror(source, cfg.checkpoint.s3_endpoint, cfg.data.cache_dir)


def _loader(cfg: Config, meshes: Meshes, device: torch.device, split, *, validation: bool = False):
    kw: dict[str, Any] = dict(seq_len=cfg.data.seq_len, global_batch_size=cfg.train.global_batch_size)
    kw.update(dp_rank=meshes.dp_rank, dp_degree=meshes.dims.dp, device=device)
    if isinstance(split, Mixture):
        if validation:  # per source: RunData.val_loaders
            raise ValueError("a mixture's validation loaders are per source: val_loaders()")
        return MixtureLoader(split, seed=cfg.run.seed, shuffle=cfg.data.shuffle, prefetch=cfg.data.prefetch, **kw)
    if not isinstance(split, TokenDataset):
        return SampleLoader(split, **kw)
    if validation:
        return TokenLoader(split, shuffle=False, prefetch=0, **kw)
    # a learned retriever's index changes at fixed steps: each batch is read at its step (retrieval_refresh)
    prefetch = 0 if getattr(split, "live", None) is not None else cfg.data.prefetch
    return TokenLoader(split, seed=cfg.run.seed, shuffle=cfg.data.shuffle, prefetch=prefetch, **kw)


def check_tokenizer(data_dir: Path) -> None:
    """A prepared directory's tokenizer.json goes into every checkpoint (generation reads prompts with it): one
    without it is refused before training, not when the first checkpoint is written."""
    if not (data_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"the prepared directory {data_dir} has no tokenizer.json, which every checkpoint carries: copy the "
            "tokenizer.json it was prepared with there, or prepare the data again (plait data prepare)"
        )
