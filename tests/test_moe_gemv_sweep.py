"""dev/bench/moe_gemv_sweep.py runs under the Triton interpreter on tiny shapes: a split-K variant of the INT8, INT4 and
NVFP4 GEMVs checked against fused_moe_ref, exit 0."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "dev" / "bench" / "moe_gemv_sweep.py"


def test_sweep_checks_variants_on_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--formats", "int8", "int4", "nvfp4", "--tokens",
                          "1", "--variants", "16,64,4,2"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if not line.startswith("#")]
    assert [(r[0], r[3]) for r in rows] == [("int8", "(16,"), ("int4", "(16,"), ("nvfp4", "(16,")], run.stdout
    assert all(float(r[-1]) <= 2e-2 for r in rows), run.stdout  # the max error each row printed
