"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, layout-independent, asynchronous, atomic.

A checkpoint is a directory ``<checkpoints>/step_<N>/`` (local, or ``s3://bucket/prefix/step_<N>/``) holding
- DCP files with every tensor: the model (fully qualified names) and the optimizer state per parameter
  name, so it loads under another layout or world size, and each rank's CPU/CUDA RNG state;
- ``plait.json`` with everything that is not a tensor (step, token count, data-loader position, LR schedule,
  optimizer hyper-parameters, the resolved config, a hash of DCP's metadata file) — plain JSON;
- ``tokenizer.json``, so ``plait generate`` needs nothing but the checkpoint.

Life of a save (``CheckpointManager.maybe_save``): the loop is blocked while the state is copied to CPU
memory ("staged", ``dcp.async_save``); every rank then writes its shards from a background thread, and
DCP's coordinator writes ``.metadata`` once all ranks' writes have succeeded. Only then does the main rank
publish: it writes ``plait.json`` last and, on a local disk, renames ``step_<N>.tmp`` to ``step_<N>``.
``list_checkpoints`` accepts only directories with ``plait.json``, so a crash at any moment leaves nothing it
would load. A save that fails (an unreachable bucket, a full disk) is retried, then reported, and training
goes on; the next save tries again. A finished save is published at the next ``maybe_save``, and
``close()`` waits for the last one.

Loading never unpickles (see ``plait.core.storage``). A checkpoint whose files are missing or truncated, whose
metadata is damaged, or whose tensors do not fit the model (missing, unexpected, other shapes, not tensors)
raises PlaitError listing what does not match, on every rank, before any tensor is changed. Corrupt bytes
inside a record are caught by its CRC32 while it is read: PlaitError again, but tensors read before it may
already hold checkpoint values, so a failed load must end the run (as it does: nothing catches it).
"""

from plait.engine.checkpoint.find import (
    FORMAT,
    META,
    checkpoint_dir,
    checkpoint_problems,
    list_checkpoints,
    local_file,
    newest_first,
    read_config,
    read_meta,
    resolve_checkpoint,
    scan_checkpoints,
    step_of,
)
from plait.engine.checkpoint.load import checkpoint_model, load_model_weights
from plait.engine.checkpoint.manager import (
    ABANDON_AFTER_S,
    FINAL_WAIT_S,
    ON_TIME_MIN_S,
    CheckpointManager,
    TrainState,
    kept_forever,
)

__all__ = [
    "ABANDON_AFTER_S", "FINAL_WAIT_S", "FORMAT", "META", "ON_TIME_MIN_S", "CheckpointManager",
    "TrainState", "checkpoint_dir", "checkpoint_model", "checkpoint_problems", "kept_forever", "list_checkpoints",
    "load_model_weights", "local_file", "newest_first", "read_config", "read_meta", "resolve_checkpoint",
    "scan_checkpoints", "step_of",
]  # fmt: skip
