"""Publishing a written checkpoint, and retention: what makes a save visible whole or not at all, and what
keeps the checkpoint directory to checkpoint.keep_last (and keep_every, keep_best, the pinned ones).

A save is written under a staging name (``step_<N>.tmp`` on a local disk; on S3, which has no rename, under
``step_<N>`` itself), and published by the steps of PUBLISH_STEPS, in order, on the main rank: the tokenizer
is copied in, ``plait.json`` is written (the lock re-read just before: a run whose lock was taken publishes
nothing), an earlier checkpoint of the same step is retired (a complete one removed, a damaged one set aside),
and the directory renamed to ``step_<N>``. A checkpoint is a directory with ``plait.json`` named ``step_<N>``,
so a crash between any two steps leaves either no new checkpoint or the new one complete
(tests/unit/test_checkpoint_crash.py crashes a run between each pair). Damaged checkpoints are never deleted: they
are set aside under a name no listing counts."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

from plait.config import CheckpointConfig
from plait.core import storage
from plait.core.publish import check_fence, displaced_holder
from plait.core.storage import DCP_METADATA, Location
from plait.data.chat import chat_files
from plait.engine.checkpoint.find import ANY_STEP_DIR, META, checkpoint_problems, classify, read_meta, step_of
from plait.engine.checkpoint.pins import describe_pin, pinned
from plait.engine.checkpoint.wording import one_line, warn


class Publisher:
    """Publishes the saves of one checkpoint directory and applies retention to it (the main rank's; see the
    module docstring). It remembers what it has verified, so a published checkpoint is read once."""

    PUBLISH_STEPS = ("copy_tokenizer", "write_meta", "retire_same_step", "rename")
    """publish()'s steps, in order, each called with (step, meta, target)."""

    def __init__(self, ckpt_dir: Location, cfg: CheckpointConfig, *, is_writer: bool, tokenizer_path: Path | None):
        self.dir = ckpt_dir
        self.cfg = cfg
        self.is_writer = is_writer
        self.tokenizer_path = tokenizer_path
        self.verified: dict[str, str] = {}  # checkpoint name -> its problems ("" for none), for retention
        self._replaced: dict[str, Location] = {}  # on S3: a complete checkpoint moved aside until its step is saved
        self._said_pinned: set[str] = set()  # pinned checkpoints retention has said it keeps
        self._val_losses: dict[str, float | None] = {}  # checkpoint name -> its recorded validation loss
        self.displaced = displaced_holder(self.dir) if self.is_writer else ""
        if self.is_writer and isinstance(self.dir, Path):
            storage.makedirs(self.dir)
            self._clear_unfinished(self.dir)

    def _clear_unfinished(self, root: Path) -> None:
        """Saves an earlier process never finished: removed, unless the lock was taken from a holder that may
        still be running (run.break_lock, an expired lease): then they are its in-flight files, moved aside
        (never deleted, never mixed with a save of ours), and said."""
        unfinished = sorted(root.glob("step_*.tmp"))  # a local directory (on S3 a save writes in place)
        if not self.displaced:
            for stale in unfinished:
                storage.remove_tree(stale)
            return
        for stale in unfinished:
            aside = set_aside_name(stale, "displaced")
            storage.rename(stale, aside)
            warn(
                f"{stale} is an unfinished save of {self.displaced}, whose lock this run took over and which "
                f"may still be running: moved to {aside}, not deleted (that run publishes nothing more); delete it "
                f"once that run has ended"
            )

    def staging_path(self, step: int) -> Location:
        """Where the save of `step` is written before it is published."""
        name = f"step_{step:08d}"
        return self.dir / name if storage.is_remote(self.dir) else self.dir / f"{name}.tmp"

    def clear_remote_step(self, target: Location) -> None:
        """On S3 a save writes in place (no rename), so what an earlier run left under its step goes first
        (on DCP's coordinator, in the save, before any rank writes): an unfinished save's objects are removed
        (nothing was published), a damaged checkpoint is moved aside and kept, as on a local disk, and a
        complete one is moved aside until the new save is published (retire_same_step then removes it;
        discard puts it back), so a save that fails loses nothing."""
        try:
            files = set(storage.file_sizes(target))
        except FileNotFoundError:  # nothing there: the usual case
            return
        if META not in files:
            storage.remove_tree(target)
            return
        damage = self.verified.get(target.name) or checkpoint_problems(target)
        aside = set_aside_name(target, "damaged" if damage else "replaced")
        storage.rename(target, aside)
        self.verified.pop(target.name, None)
        if damage:
            warn(f"damaged checkpoint {target} ({damage}) moved to {aside} to make room for the new save of its step")
        else:
            self._replaced[target.name] = aside

    # ----------------------------------------------------------------------------------------- publishing

    def publish(self, step: int, meta: dict, target: Location) -> None:
        """Make the save written to `target` the checkpoint of `step` (every rank's shards and DCP's metadata
        are written): PUBLISH_STEPS, in order."""
        for name in self.PUBLISH_STEPS:
            getattr(self, name)(step, meta, target)

    def copy_tokenizer(self, step: int, meta: dict, target: Location) -> None:
        """The tokenizer, and the chat template where the data was rendered with one: `plait generate` needs
        nothing but the checkpoint."""
        if self.tokenizer_path is not None:
            storage.copy_in(self.tokenizer_path, target / "tokenizer.json")
            for path in chat_files(self.tokenizer_path):
                storage.copy_in(path, target / path.name)

    def write_meta(self, step: int, meta: dict, target: Location) -> None:
        """plait.json, with the hash of DCP's metadata, written whole; on S3 (written last) this is the publish.
        The lock is re-read just before: this run's own still."""
        meta = {**meta, "dcp_metadata_sha256": hashlib.sha256(storage.read_bytes(target / DCP_METADATA)).hexdigest()}
        text = json.dumps(meta, indent=1).encode()
        check_fence(self.dir, f"checkpoint {self._final(step)}")
        storage.write_bytes(target / META, text)

    def retire_same_step(self, step: int, meta: dict, target: Location) -> None:
        """An older save of the same step (a rerun): on a local disk a complete one is removed only now, a
        damaged one (also if only its tensors failed to load) set aside, the user's to inspect. On S3 the copy
        moved aside before the save (clear_remote_step) is removed: the new one is published already."""
        final = self._final(step)
        if not isinstance(final, Path) or not isinstance(target, Path):
            if (replaced := self._replaced.pop(final.name, None)) is not None:
                try:  # published already: a copy left behind is not worth failing the save for
                    storage.remove_tree(replaced)
                except Exception as e:
                    warn(f"the earlier checkpoint of step {step}, replaced, is left at {replaced} ({one_line(e)})")
            return
        if not final.exists():
            return
        damage = self.verified.get(final.name) or checkpoint_problems(final)
        if (final / DCP_METADATA).exists() and not damage:
            storage.remove_tree(final)
            return
        aside = set_aside_name(final, "damaged")
        storage.rename(final, aside)
        self.verified.pop(final.name, None)
        warn(
            f"damaged checkpoint {final} ({damage or 'its metadata is missing'}) moved to {aside} to make room for "
            f"the new save of its step"
        )

    def rename(self, step: int, meta: dict, target: Location) -> None:
        """On a local disk, `step_<N>.tmp` becomes `step_<N>` (one rename, made durable); nothing on S3."""
        final = self._final(step)
        if isinstance(final, Path) and isinstance(target, Path):
            storage.rename(target, final)

    def _final(self, step: int) -> Location:
        return self.dir / f"step_{step:08d}"

    def discard(self, target: Location) -> str:
        """After a failed save (every rank's writes have ended), remove what it left in `target` and put back
        the checkpoint it was to replace (on S3); "" or why that could not be done, to add to the reason."""
        replaced = self._replaced.pop(target.name, None)  # (on S3: clear_remote_step)
        try:
            check_fence(self.dir, f"the cleanup of {target}")  # no other run's files under this name
            storage.remove_tree(target)
            if replaced is not None:  # put back the checkpoint this save was to replace
                storage.rename(replaced, target)
        except Exception as e:
            why = f"; its partial files in {target} could not be cleared ({one_line(e)})"
            if replaced is not None:
                why += f"; the checkpoint it was to replace is kept as {replaced}"
            return why
        return ""

    # ------------------------------------------------------------------------------------------ retention

    def retain(self) -> None:
        """Keep the newest checkpoint.keep_last complete checkpoints and every checkpoint.keep_every-th
        step; remove the other complete ones and what failed or interrupted saves left behind (no save is in
        flight now). Damaged checkpoints are neither counted nor removed: they are the user's to inspect."""
        check_fence(self.dir, "retention's deletions")
        tree = storage.list_tree(self.dir)
        complete, damaged = classify(self.dir, tree)
        for c in complete:  # published checkpoints never change: each is verified once
            if c.name not in self.verified:
                self.verified[c.name] = checkpoint_problems(c)
                if self.verified[c.name]:
                    warn(f"checkpoint {c} is damaged ({self.verified[c.name]}): kept, but not counted or loaded")
        damaged += [(c, self.verified[c.name]) for c in complete if self.verified[c.name]]
        complete = [c for c in complete if not self.verified[c.name]]
        steps = [step_of(c) for c in complete]
        keep = set(steps[-max(1, self.cfg.keep_last) :]) | kept_forever(steps, self.cfg.keep_every)
        if self.cfg.keep_best:
            keep |= self._best(complete)
        pins = pinned(tree)
        for c in complete:
            if step_of(c) not in keep and not self._kept_for_pin(c, pins):
                storage.remove_tree(c)
        known = {c.name for c in complete} | {d.name for d, _ in damaged}
        for name in tree:
            if name in known or not ANY_STEP_DIR.match(name):
                continue
            # a partial save: step_<N>.tmp on a local disk, an unpublished step_<N> prefix on S3; not while the
            # run whose lock we took may still be writing one
            if self.displaced:
                continue
            if name.endswith(".tmp") or (steps and step_of(self.dir / name) < steps[-1]):
                storage.remove_tree(self.dir / name)

    def _kept_for_pin(self, c: Location, pins: dict) -> bool:
        """The base of a fine-tune, an export, an adapter: kept past keep_last, and said once."""
        if c.name not in pins:
            return False
        if c.name not in self._said_pinned:
            self._said_pinned.add(c.name)
            users = "; ".join(describe_pin(self.dir, n) for n in pins[c.name])
            warn(
                f"checkpoint {c} kept past checkpoint.keep_last: {users} depends on it (pinned in {self.dir / 'pins'})"
            )
        return True

    def _best(self, complete: list) -> set[int]:
        """checkpoint.keep_best: the step of the checkpoint with the lowest validation loss its meta records
        (each read once), or nothing when none records one."""
        for c in complete:
            if c.name not in self._val_losses:
                with contextlib.suppress(Exception):  # unreadable: not a candidate (it is reported elsewhere)
                    self._val_losses[c.name] = read_meta(c).get("val_loss")
        scored = [(v, step_of(c)) for c in complete if (v := self._val_losses.get(c.name)) is not None]
        return {min(scored)[1]} if scored else set()


def set_aside_name(path: Location, why: str) -> Location:
    """Where a checkpoint is moved to make room for a new save of its step: beside it, named with why and
    when (never a step_<N> name, so no listing counts it and retention never deletes it)."""
    return path.parent / f"{path.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"


def kept_forever(steps: list[int], every: int) -> set[int]:
    """checkpoint.keep_every: the first checkpoint at or after each multiple of `every` (the multiple itself
    unless its save was deferred), from the steps saved (ascending). Once saved, it stays the first."""
    if every <= 0:
        return set()
    first: dict[int, int] = {}
    for s in steps:
        if s >= every:
            first.setdefault(s // every, s)
    return set(first.values())
