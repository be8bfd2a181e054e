"""Read prepared token shards as fixed windows and serve resumable, DP-sharded batches.

A prepared directory holds one flat token stream per split (documents separated by EOS, so packed),
cut into shards. The stream is split into consecutive, non-overlapping windows of `seq_len + 1`
tokens; inputs are a window's first `seq_len` tokens and targets its last `seq_len`.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.core.errors import ConfigError
from plait.data.format import FORMAT, MANIFEST


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load and check a prepared directory's manifest (not the shards)."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not data_dir.is_dir():
        raise ConfigError(f"data directory {data_dir} does not exist: run `plait data prepare` to create it")
    if not path.is_file():
        raise ConfigError(f"{data_dir} has no {MANIFEST}: run `plait data prepare --out {data_dir}` first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}): prepare the data again") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} manifest: prepare the data again with this version")
    return manifest


def shard_paths(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[tuple[Path, int]]:
    """(path, num_tokens) for each shard of a split, checking each file exists with the right size."""
    data_dir = Path(data_dir)
    splits = manifest.get("splits", {})
    if split not in splits:
        raise ConfigError(f"{data_dir} has no split {split!r}; it has {sorted(splits)}")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    out = []
    for shard in splits[split]["shards"]:
        path = data_dir / shard["file"]
        if not path.is_file():
            raise ConfigError(f"shard {path} is missing: prepare the data again")
        expected = shard["num_tokens"] * itemsize
        if path.stat().st_size != expected:
            size = path.stat().st_size
            raise ConfigError(f"shard {path} has {size} bytes, manifest says {expected}: prepare the data again")
        out.append((path, shard["num_tokens"]))
    return out


class TokenDataset:
    """One split of a prepared directory, memory-mapped read-only and viewed as one token stream."""

    def __init__(self, data_dir: str | Path, split: str = "train", remote_cache_mb: int = 256) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        manifest = read_manifest(self.data_dir)
        self.vocab_size: int = manifest["vocab_size"]
        self.eos_id: int = manifest["eos_id"]
        self.num_documents: int = int(manifest["splits"].get(split, {}).get("num_documents", 0))
        # Little-endian is part of the on-disk format, whatever this machine's byte order.
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        # A corpus on S3 (plait.data.remote): its manifest, mirrored here, names where the shards are.
        self.remote: str = manifest.get("remote", {}).get("url", "")
        if self.remote and split not in manifest.get("splits", {}):
            raise ConfigError(f"{self.remote} has no split {split!r}; it has {sorted(manifest.get('splits', {}))}")
        listed = [s for s in manifest["splits"][split]["shards"] if s["num_tokens"]] if self.remote else []
        if self.remote:
            from plait.data.remote import remote_shards

            files = [(s["file"], s["num_tokens"]) for s in listed]
            self._shards: list[Any] = remote_shards(manifest, files, dtype, remote_cache_mb)
        else:
            paths = shard_paths(self.data_dir, manifest, split)
            self._shards = [np.memmap(path, dtype=dtype, mode="r") for path, n in paths if n]
        sizes = np.array([len(s) for s in self._shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # stream offset of each shard, plus the end
        self.num_tokens: int = int(self._starts[-1])
        # Instruction data (`plait finetune prepare`) has a uint8 loss mask beside each shard: 0 marks a token
        # that is not a target (a prompt's); the batches give such targets -100, which cross-entropy ignores.
        self.has_loss_mask = bool(manifest.get("loss_mask"))
        shards = [s for s in manifest["splits"][split]["shards"] if s["num_tokens"]] if self.has_loss_mask else []
        if self.remote and shards:
            from plait.data.remote import remote_shards

            masks = [(s["mask_file"], s["num_tokens"]) for s in shards]
            self._masks: list[Any] = remote_shards(manifest, masks, np.dtype(np.uint8), remote_cache_mb)
        else:
            self._masks = [np.memmap(self.data_dir / s["mask_file"], dtype=np.uint8, mode="r") for s in shards]

    def stride(self, seq_len: int) -> int:
        """Tokens from one window's start to the next's: seq_len + 1 (windows do not overlap)."""
        return seq_len + 1

    def num_samples(self, seq_len: int) -> int:
        """Number of whole windows of `seq_len + 1` tokens; the remainder of the stream is dropped."""
        if self.num_tokens < seq_len + 1:
            return 0
        return (self.num_tokens - seq_len - 1) // self.stride(seq_len) + 1

    def check_seq_len(self, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be at least 1")
        if self.num_tokens < seq_len + 1:
            raise ConfigError(
                f"split {self.split!r} of {self.data_dir} has {self.num_tokens} tokens but seq_len={seq_len} "
                f"needs at least {seq_len + 1}: lower seq_len or prepare more data"
            )

    def sample(self, i: int, seq_len: int, *, loss_mask: bool = False) -> np.ndarray:
        """Window `i`: tokens [i*stride, i*stride + seq_len + 1) of the stream as int64, across shards (with
        loss_mask=True the window of the loss mask instead)."""
        if not 0 <= i < self.num_samples(seq_len):
            raise IndexError(f"window {i} out of range for {self.num_samples(seq_len)} windows")
        start = i * self.stride(seq_len)
        return self.tokens(start, start + seq_len + 1, loss_mask=loss_mask)

    def tokens(self, start: int, end: int, *, loss_mask: bool = False) -> np.ndarray:
        """Tokens [start, end) of the stream as int64, across shards (or of the loss mask)."""
        source = self._masks if loss_mask else self._shards
        out = np.empty(end - start, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:  # usually one iteration; more only when the window crosses shard boundaries
            lo = pos - self._starts[k]
            hi = min(end, self._starts[k + 1]) - self._starts[k]
            out[pos - start : pos - start + hi - lo] = source[k][lo:hi]
            pos += hi - lo
            k += 1
        return out


class _BatchPlan:
    """Maps a global sample cursor to this rank's batch; holds no reference to the loader."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_degree
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.num_windows = dataset.num_samples(seq_len)
        self._perms: dict[int, np.ndarray] = {}

    def window(self, g: int) -> int:
        """Window index of global sample `g` (epoch-major: epoch g // N, position g % N)."""
        epoch, pos = divmod(g, self.num_windows)
        if not self.shuffle:
            return pos
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch touches at most a few epochs; keep memory bounded
                self._perms.pop(min(self._perms))
            rng = np.random.Generator(np.random.PCG64(self.seed + epoch))
            self._perms[epoch] = rng.permutation(self.num_windows)
        return int(self._perms[epoch][pos])

    def build(self, cursor: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the global batch of samples [cursor, cursor + G)."""
        first = cursor + self.dp_rank * self.local_batch_size
        windows = [(self.dataset, self.window(first + j)) for j in range(self.local_batch_size)]
        return batch_of(windows, self.seq_len, pin)

    def advance(self, cursor: int) -> int:
        """The cursor after the global batch at `cursor`."""
        return cursor + self.global_batch_size


def batch_of(windows: list[tuple[TokenDataset, int]], seq_len: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of these windows (dataset, window index), one row each; targets of tokens a loss mask
    excludes are -100."""
    rows = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    for j, (dataset, w) in enumerate(windows):
        rows[j] = dataset.sample(w, seq_len)
    inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))  # (B, T)
    if any(hasattr(dataset, "neighbour_tokens") for dataset, _ in windows):  # RETRO: the neighbours follow
        extra = np.stack([dataset.neighbour_tokens(w, seq_len) for dataset, w in windows])  # type: ignore[attr-defined]
        inputs = torch.from_numpy(np.concatenate([rows[:, :-1], extra], axis=1))
    targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))  # (B, T)
    if any(dataset.has_loss_mask for dataset, _ in windows):  # a new array: targets may share the inputs' memory
        masks = np.stack(
            [d.sample(w, seq_len, loss_mask=True) if d.has_loss_mask else np.ones(seq_len + 1, np.uint8)
             for d, w in windows]
        )  # fmt: skip
        targets = torch.from_numpy(np.where(masks[:, 1:] == 1, rows[:, 1:], -100))
    if pin:
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    return inputs, targets


def _produce(plan: Any, cursor: Any, pin: bool, out: queue.Queue, stop: threading.Event) -> None:
    """Background producer: put (cursor, batch) items, or the exception that stopped it."""
    try:
        while not stop.is_set():
            item: Any = (cursor, plan.build(cursor, pin))
            cursor = plan.advance(cursor)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
    except Exception as e:  # handed to the consumer, which re-raises it in the caller's thread
        out.put(e)


class TokenLoader:
    """Infinite iterator of `(inputs, targets)`: int64, shape (global_batch_size // dp_degree, seq_len).

    Ordering: epoch e visits windows in the order of a permutation drawn from PCG64(seed + e) (identity if
    not shuffling). These form one global, epoch-major sample stream; step batches are consecutive runs of
    G = global_batch_size samples from the current cursor, and DP rank r takes the contiguous slice
    [r*G/dp, (r+1)*G/dp) of each. A batch that reaches the end of an epoch simply continues with the next
    epoch's permutation, so no sample is dropped and the state is a single number: the global count of
    samples handed out. Resuming from it is exact even with a different dp_degree or global_batch_size.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | str = "cpu",
        prefetch: int = 2,
    ) -> None:
        if dp_degree < 1 or global_batch_size < 1 or global_batch_size % dp_degree != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a positive multiple of dp_degree={dp_degree}"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_degree})")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0 (0 means synchronous)")
        dataset.check_seq_len(seq_len)
        self.dataset = dataset
        self.dp_rank, self.dp_degree, self.shuffle, self.prefetch = dp_rank, dp_degree, shuffle, prefetch
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Fix the index now: the prefetch thread would otherwise default to cuda:0.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._plan = self._make_plan(seq_len, global_batch_size, seed)
        self._samples_consumed = 0
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _make_plan(self, seq_len: int, global_batch_size: int, seed: int) -> _BatchPlan:
        return _BatchPlan(self.dataset, seq_len, global_batch_size, self.dp_rank, self.dp_degree, seed, self.shuffle)

    @property
    def seq_len(self) -> int:
        return self._plan.seq_len

    @property
    def global_batch_size(self) -> int:
        return self._plan.global_batch_size

    @property
    def num_windows(self) -> int:
        return self._plan.num_windows

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches per epoch (batches may straddle epochs, so this is a floor; 0 if G > N)."""
        return self.num_windows // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be handed out."""
        return self._samples_consumed // self.num_windows

    def __iter__(self) -> TokenLoader:
        return self

    def place(self, cursor: int, *, dp_rank: int, dp_degree: int, global_batch_size: int) -> None:
        """Go on from global sample `cursor` as data-parallel rank dp_rank of dp_degree, in global batches of
        global_batch_size: a fault-tolerant run's step, whose batch follows from the groups taking part and the
        batches they committed (plait.engine.replicas). Where nothing changed, the prefetched batches stay."""
        if (cursor, dp_rank, dp_degree, global_batch_size) == (
            self._samples_consumed, self.dp_rank, self.dp_degree, self.global_batch_size,
        ):  # fmt: skip
            return
        if global_batch_size % dp_degree or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"rank {dp_rank} of {dp_degree} cannot take a share of {global_batch_size} samples")
        self.close()
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self._plan = self._make_plan(self.seq_len, global_batch_size, self._plan.seed)
        self._samples_consumed = cursor

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        pin = self.device.type == "cuda"
        if self.prefetch == 0:
            cursor, (inputs, targets) = self._samples_consumed, self._plan.build(self._samples_consumed, pin)
        else:
            cursor, (inputs, targets) = self._next_prefetched(pin)
        assert cursor == self._samples_consumed, "prefetch pipeline out of step with the cursor"
        self._samples_consumed = self._plan.advance(self._samples_consumed)
        # The copy to the device runs here, on the caller's current stream, so it is ordered with the
        # caller's compute; the pinned host buffers are fresh per batch, so non_blocking is safe.
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _next_prefetched(self, pin: bool) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        if self._thread is None:
            self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
            self._thread = threading.Thread(
                target=_produce,
                args=(self._plan, self._samples_consumed, pin, self._queue, self._stop),
                name="plait-prefetch",
                daemon=True,
            )
            self._thread.start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, Exception):
            self.close()  # the producer has exited; a later call starts a fresh one at the same cursor
            raise item
        return item

    def close(self) -> None:
        """Stop the prefetch thread and drop prefetched batches."""
        if self._thread is not None:
            assert self._stop is not None and self._queue is not None
            self._stop.set()
            while self._thread.is_alive():
                with contextlib.suppress(queue.Empty):  # unblock a producer waiting on a full queue
                    self._queue.get(timeout=0.05)
            self._thread.join()
        self._thread = self._queue = self._stop = None

    def __del__(self) -> None:
        if hasattr(self, "_thread"):  # __init__ may have failed before the pipeline fields existed
            self.close()

    def state_dict(self) -> dict[str, int]:
        """Position after the batches handed to the caller (prefetched, unreturned ones don't count)."""
        return {
            "samples_consumed": self._samples_consumed,
            "seed": self._plan.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the saved seed is adopted so the sample order is unchanged.

        dp_degree, dp_rank and global_batch_size may differ from the saving run: the cursor counts samples.
        """
        if "source_samples" in state and type(self) is TokenLoader:
            raise ConfigError(
                "the checkpoint's data position is of a mixture (data.sources), this run reads one corpus "
                "(data.source): the position cannot be carried over; resume with the run's own data settings"
            )
        if state["seq_len"] != self.seq_len:
            raise ConfigError(
                f"data loader state has seq_len={state['seq_len']} but this run uses seq_len={self.seq_len}: "
                "windows would not line up; resume with the same seq_len"
            )
        self.close()
        self._plan = self._make_plan(self.seq_len, self.global_batch_size, int(state["seed"]))
        self._samples_consumed = int(state["samples_consumed"])
