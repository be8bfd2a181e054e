"""Megatron-lean activations: bench/memory.py measures what plait's block keeps for backward (saved-tensor
hooks and selective recompute's cache, on a fake process group of the TP degree) next to Korthikanti et al.'s
formula; here at a small shape with a 64-wide head and an MLP 2.625x as wide (Llama's: 8/3x). With sequence
parallelism and selective recompute plait keeps at most 1.15x Megatron's term (adjusted for SwiGLU: see the
bench's docstring), and the recompute units keep less than one region per block from tp = 2 on."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_RATIO = 1.15  # the bar for SP + selective recompute


def test_selective_recompute_with_sp_keeps_no_more_than_megatron(tmp_path):
    out = tmp_path / "memory.json"
    shape = ["--dim", "512", "--heads", "8", "--kv-heads", "8", "--ffn", "1344", "--seq", "256", "--tp", "1,2,8"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory.py"), *shape, "--layers", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["tp"], r["ac"]): r for r in json.loads(out.read_text())["rows"]}
    for tp in (1, 2, 8):
        selective, one_region = rows[tp, "selective"], rows[tp, "selective, one region"]
        assert selective["ratio"] <= MEGATRON_RATIO, selective
        assert rows[tp, "full"]["bytes_per_token_layer"] < selective["bytes_per_token_layer"]
        assert selective["bytes_per_token_layer"] < rows[tp, "none"]["bytes_per_token_layer"]
        if tp > 1:  # units: the row-parallel projections' full-size partial sums are not kept
            assert selective["bytes_per_token_layer"] < one_region["bytes_per_token_layer"], (selective, one_region)
    assert rows[8, "selective, one region"]["ratio"] > 1.5  # what the units remove (plait before them: 1.7x)
