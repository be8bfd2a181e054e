"""Directories that appear whole or not at all: written under a temporary sibling name, published by rename.
The one place plait does this (prepared data, Hugging Face exports, imported checkpoints)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from plait.core.errors import PlaitError


def is_nonempty(out: Path) -> bool:
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


@contextlib.contextmanager
def staged_dir(out: Path, *, overwrite: bool, exists_error: PlaitError, stage: Path | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out` (0755); when the block ends without an error, its files are
    made readable by others (0644) and it becomes `out` by one rename. A non-empty `out` raises exists_error
    unless overwrite, in which case the old `out` is moved aside first and deleted only after the rename; on
    any failure the temporary directory is removed and `out` is as it was. With `stage`, that directory is
    used (created if missing, its contents kept) and kept on a failure: work that resumes from what it holds."""
    if is_nonempty(out) and not overwrite:
        raise exists_error
    out.parent.mkdir(parents=True, exist_ok=True)
    if stage is not None:
        stage.mkdir(exist_ok=True)
    tmp = stage or Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published directory is an ordinary one
    try:
        yield tmp
        for written in tmp.rglob("*"):  # e.g. safetensors writes its file 0600: the result is for others to read
            os.chmod(written, 0o755 if written.is_dir() else 0o644)
        old = None
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif out.exists():
            if not overwrite:  # appeared meanwhile
                raise exists_error
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError as e:
            if old is not None:
                os.rename(old, out)
            raise exists_error from e
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    except BaseException:
        if stage is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
