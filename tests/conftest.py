"""Fixtures every test module shares."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The bundled corpus, tokenised once per session (4,096-token vocabulary). A module that needs another
    corpus defines its own `data_dir`."""
    from plait.data import ensure_prepared

    return ensure_prepared("shakespeare", tmp_path_factory.getbasetemp() / "shakespeare-cache", 4096)
