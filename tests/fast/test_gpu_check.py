"""scripts/gpu_check.sh --no-setup on a machine without CUDA (its plan, every step skipped, exit 0) and the Ray-free
core its steps call: the trainer and the engine import without Ray; a trainer step and the engine's micro-batched
generate run with Ray unimportable (the weight-sync step, a second process: tests/e2e/test_gpu_check_sync.py)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RAY_FREE = ["miles/backends/fsdp_utils/actor.py", "miles/rollout/engine.py", "miles/utils/offload.py"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_no_setup_without_cuda_prints_its_plan_skips_every_step_with_the_reason_and_exits_0(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--no-setup"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    plan = re.findall(r"\[gpu_check\]   (\w+) \(at most (\d+)s\)", run.stderr)
    names = [name for name, _ in plan]
    assert names[:2] == ["environment", "trainer_step"] and "fast_gpu" not in names
    assert {"engine_generate", "weight_sync", "bench_flux_dev", "plan_sd35_medium", "plan_flux_dev"} <= set(names)
    total = sum(int(limit) for _, limit in plan)
    assert total < 9 * 60 and f"limits add up to {total}s" in run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == names
    assert all(" | skipped | no CUDA device visible" in row for row in rows), rows
    assert (tmp_path / "summary.md").read_text() == run.stdout


def module_level_imports(path: Path) -> list[str]:
    """The modules `path` imports outside any function or class body (at import time)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def miles_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def test_nothing_the_trainer_or_engine_imports_at_module_level_imports_ray():
    seen: set[Path] = set()
    pending = [ROOT / f for f in RAY_FREE]
    importers = []
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in module_level_imports(path):
            if module == "ray" or module.startswith(("ray.", "miles.ray")):
                importers.append(f"{path.relative_to(ROOT)}: {module}")
            elif module.startswith("miles."):  # the module and the packages above it run on import
                parts = module.split(".")
                pending += [f for i in range(1, len(parts) + 1) if (f := miles_file(".".join(parts[:i])))]
    assert len(seen) > 30 and not importers, importers


@contextlib.contextmanager
def ray_unimportable():
    saved = sys.modules.get("ray")
    sys.modules["ray"] = None  # `import ray` raises ImportError from here on
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["ray"]
        else:
            sys.modules["ray"] = saved


def test_the_trainer_and_engine_steps_run_on_cpu_with_ray_unimportable(load_script, tiny_pipeline_dir, tmp_path):
    core = load_script("scripts/gpu_check_core.py")
    os.symlink(tiny_pipeline_dir, tmp_path / "tiny_sd3")
    opts = argparse.Namespace(device="cpu", workdir=str(tmp_path))
    with ray_unimportable():
        assert core.trainer_step(opts).startswith("2 optimizer windows")  # FSDP2 init, two windows, shutdown
        assert "micro-batches of 2" in core.engine_generate(opts)  # the step compares them with one batch
