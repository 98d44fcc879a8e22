"""`scripts/gpu_check_core.py weight_sync` on the CPU, as `gpu_check.sh --no-setup` runs it on a GPU: trainer rank 0
and an engine in a second process, Ray unimportable, two syncs over `shm` (the transport a CPU host picks, where a GPU
takes `cuda_ipc`) into the engine's parameters, equal to the trainer's export. A subprocess, which spawns the engine's
(~8 s): here, not in the fast tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_the_weight_sync_step_runs_on_cpu_with_ray_unimportable(tiny_pipeline_dir, tmp_path):
    os.symlink(tiny_pipeline_dir, tmp_path / "tiny_sd3")
    block = (
        "import runpy, sys; sys.modules['ray'] = None; sys.argv[:] = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    argv = ["scripts/gpu_check_core.py", "weight_sync", "--device", "cpu", "--workdir", str(tmp_path)]
    run = subprocess.run([sys.executable, "-c", block, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"RESULT: shm: 2 syncs of [\d.]+ MB in [2-9]\d* buckets .*equal to the export", run.stdout)
