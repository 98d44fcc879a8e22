"""The `plan_*` steps of `scripts/gpu_check.sh --no-setup`: the planner's memory per phase against the same library
steps run for real, one model per call, ending with a `RESULT:` line:

    python scripts/gpu_check_plan.py --model sd3.5-medium --workdir DIR   # full fine-tuning, bf16 master weights
    python scripts/gpu_check_plan.py --model flux-dev --workdir DIR       # LoRA rank 16, bf16 base (bench_flux_dev)
    python scripts/gpu_check_plan.py --model tiny --device cpu --workdir DIR   # the same comparison on a CPU
    python scripts/gpu_check_plan.py --model builtin:tiny-wan --device cpu     # any built-in tiny folder, on a CPU

At world size 1, 1024 px, activation checkpointing, micro-batch 1, one engine generate of 2 samples (4 steps):
1. the plan: `simulate_engine` and `simulate_trainer_rank` (`miles/plan/engine_sim.py`, `miles/plan/simulate.py`) on fake tensors for the planned
   device, each phase's peak as `--plan` counts it (engine start-up and generate, trainer start-up and its first
   micro-batch's window);
2. the same calls on real tensors on `--device` (`fake=False`), with random weights: the loaders run as under the
   plan (networks built from the folder's configs, transformers materialised without a file read, tokenizers that
   give every prompt its longest length), their tensors filled with seeded random values instead of read, so the
   configs alone are needed (FLUX.1-dev's are shipped in miles/plan/configs; SD3.5-Medium's folder is built in
   `--workdir` from SD3.5-Large's shipped components and bench_gpu's SD3.5-Medium transformer config). On cuda each
   phase's peak is `torch.cuda.max_memory_allocated`, reset as the phase starts, less what was allocated before the
   process's simulation began; on a CPU (no allocator statistics) the planner's own tracker on the real tensors;
3. planned vs measured per phase, with their ratio: PASS within 10% (`TOLERANCE`); exit 1 when a phase is not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.algorithms.roles import training_order  # noqa: E402
from miles.arguments.parser import parse_args  # noqa: E402
from miles.backends.fsdp_utils import sharded_load  # noqa: E402
from miles.models import base  # noqa: E402
from miles.models.loading import checkpoint_files, configs_only, pretrained  # noqa: E402
from miles.plan.command import CONFIGS, resolve_plan_checkpoint  # noqa: E402
from miles.plan.engine_sim import simulate_engine  # noqa: E402
from miles.plan.process import simulation_args  # noqa: E402
from miles.plan.run import metadata_stand_in  # noqa: E402
from miles.plan.simulate import simulate_trainer_rank, train_pairs_for_rank  # noqa: E402
from miles.plan.tracker import PlanTracker  # noqa: E402
from miles.utils.json_column import fake_rows_decode_as  # noqa: E402

MIB = 2**20
TOLERANCE = 0.10
ROWS = 2  # the engine's samples (one prompt, two samples)
PHASES = (("engine", "start-up"), ("engine", "generate"), ("trainer", "start-up"), ("trainer", "train"))
TRAIN = ("start-up", "train")  # a trainer's phases compared (the actor's as "trainer", another role's by its name)
COMMON = ["--rollout-batch-size", "1", "--n-samples-per-prompt", str(ROWS), "--diffusion-num-steps", "4"]
COMMON += [
    "--gradient-checkpointing",
    "on",
    "--micro-batch-size",
    "1",
    "--eval-interval",
    "0",
    "--log-level",
    "WARNING",
]
MODELS = {  # --model: (checkpoint, its flags)
    "sd3.5-medium": ("sd3.5-medium", ["--resolution", "1024", "--fsdp-master-dtype", "bf16"]),
    "flux-dev": (
        "black-forest-labs/FLUX.1-dev",
        ["--resolution", "1024", "--use-lora", "--lora-rank", "16", "--fsdp-master-dtype", "bf16"],
    ),
    "tiny": ("tiny", []),
}
SD35_LARGE = CONFIGS / "stabilityai--stable-diffusion-3.5-large"


def sd35_medium_folder(workdir: str) -> str:
    """An SD3.5-Medium pipeline folder of configs (no weights) under `workdir`: SD3.5-Large's shipped components
    (scheduler, CLIP-L, CLIP-G, T5-XXL, VAE, tokenizers' lengths: the SD3.5 pipelines share them) with the
    SD3.5-Medium transformer config bench_gpu runs (`SD35_MEDIUM`, its dual-attention layers 0-12)."""
    from benchmarks.bench_gpu import SD35_MEDIUM

    path = Path(workdir) / "sd35_medium_configs"
    if not (path / "model_index.json").exists():
        shutil.copytree(SD35_LARGE, path, dirs_exist_ok=True)
        config = {"_class_name": "SD3Transformer2DModel", **SD35_MEDIUM}
        config["dual_attention_layers"] = list(config["dual_attention_layers"])
        (path / "transformer" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(path)


def checkpoint(model: str, workdir: str) -> str:
    if model.startswith("builtin:"):
        from miles.models.builtin import resolve_checkpoint

        return str(resolve_checkpoint(model))
    name = MODELS[model][0]
    if name == "sd3.5-medium":
        return sd35_medium_folder(workdir)
    if name == "tiny":
        from scripts.gpu_check_core import tiny_pipeline

        return tiny_pipeline(workdir)
    return resolve_plan_checkpoint(name)


# ---- random weights ------------------------------------------------------------------------------------------
def _fill(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in tensors:
            local = checkpoint_files.local_part(tensor)
            if local.is_floating_point() and not local.is_meta:
                local.uniform_(-0.02, 0.02)


def _filled_modules(build: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    def built(*args: Any, **kwargs: Any) -> torch.nn.Module:
        module = build(*args, **kwargs)
        _fill(list(module.parameters()))
        return module

    return built


_MATERIALIZE = checkpoint_files.materialize


def _filled_materialize(model: torch.nn.Module, device: torch.device) -> None:
    """`materialize`, then random values in the tensors it gave storage (those on the meta device), where the run
    reads them from the checkpoint (`fill_from_checkpoint`)."""
    empty = [name for name, value in model.state_dict().items() if checkpoint_files.local_part(value).is_meta]
    _MATERIALIZE(model, device)
    state = model.state_dict()
    _fill([state[name] for name in empty])


@contextlib.contextmanager
def random_weights(seed: int = 0) -> Iterator[None]:
    """The loaders as the plan runs them, on real tensors with seeded random values (module docstring, step 2)."""
    torch.manual_seed(seed)
    patches = [(module, "simulating", lambda: True) for module in (base, pretrained, checkpoint_files, sharded_load)]
    built = _filled_modules(configs_only.module_from_config)
    patches += [(configs_only, "module_from_config", built), (pretrained, "module_from_config", built)]
    patches += [
        (checkpoint_files, "materialize", _filled_materialize),
        (sharded_load, "materialize", _filled_materialize),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


# ---- the comparison ------------------------------------------------------------------------------------------
class CudaPeaks(PlanTracker):
    """The planner's tracker that also reads `torch.cuda.max_memory_allocated` per phase: reset as a phase starts,
    read as it ends, less what was allocated when the tracker was made (before the simulated process began)."""

    def __init__(self) -> None:
        super().__init__()
        torch.cuda.synchronize()
        self.baseline = torch.cuda.memory_allocated()
        self.measured: dict[str, int] = {}

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            with super().in_phase(name):
                yield
        finally:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - self.baseline
            self.measured[name] = max(self.measured.get(name, 0), peak)


def run_steps(args: argparse.Namespace, fake: bool) -> dict[tuple[str, str], int]:
    """An engine's start-up and one generate call, then a trainer rank's start-up and window on the first
    micro-batch of the pairs converted from it (as `miles.plan.run` simulates them); each phase's peak bytes: the
    plan's (fake), `max_memory_allocated`'s (real, cuda) or the tracker's on real tensors (real, cpu)."""
    cuda = not fake and args.device == "cuda"
    tracker = CudaPeaks() if cuda else PlanTracker()
    engine, result, samples, _ = simulate_engine(args, ROWS, fake=fake, micro_batch_size=ROWS, tracker=tracker)
    peaks = {("engine", phase): bytes_ for phase, bytes_ in (tracker.measured if cuda else engine.peaks).items()}
    pairs = train_pairs_for_rank(args, samples, result)
    pairs = {key: value[: args.micro_batch_size] for key, value in pairs.items()}
    del result, tracker
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    peer = None
    # a reward scored in the trainer reads each row's prompt metadata, which a fake column does not hold (as --plan)
    with fake_rows_decode_as(metadata_stand_in(args)) if fake else contextlib.nullcontext():
        for role in training_order(args):  # a critic first, whose output its actor trains on (dmd2)
            tracker = CudaPeaks() if cuda else PlanTracker()
            trainer, peer = simulate_trainer_rank(
                args, role, 0, 1, pairs, peer, export=False, fake=fake, tracker=tracker
            )  # fmt: skip
            name = "trainer" if role == "actor" else role
            peaks.update({(name, phase): b for phase, b in (tracker.measured if cuda else trainer.peaks).items()})
    return peaks


def phases(*peaks: dict) -> list[tuple[str, str]]:
    """`PHASES`, then another role's (a critic's) start-up and train where a run has one."""
    others = sorted({key for p in peaks for key in p if key[0] not in ("engine", "trainer") and key[1] in TRAIN})
    return [*PHASES, *others]


def compare(planned: dict, measured: dict) -> tuple[list[str], bool]:
    """One line per phase (planned MiB, measured MiB, planned / measured, PASS within `TOLERANCE`); all passed."""
    lines, passed = [f"{'process':<9}{'phase':<10}{'planned MiB':>12}{'measured MiB':>14}{'ratio':>8}"], True
    for key in phases(planned, measured):
        plan, real = planned.get(key, 0), measured.get(key, 0)
        ratio = plan / real if real else float("inf")
        ok = abs(ratio - 1) <= TOLERANCE
        passed &= ok
        lines.append(
            f"{key[0]:<9}{key[1]:<10}{plan / MIB:>12.1f}{real / MIB:>14.1f}{ratio:>8.3f}  {'PASS' if ok else 'FAIL'}"
        )
    return lines, passed


def plan_vs_measured(opts: argparse.Namespace) -> tuple[str, bool]:
    path = checkpoint(opts.model, opts.workdir)
    flags = (MODELS[opts.model][1] if opts.model in MODELS else []) + shlex.split(getattr(opts, "flags", "") or "")
    args = parse_args(["--plan", "--hf-checkpoint", path, "--device", opts.device, *COMMON, *flags])
    sim = simulation_args(args)  # the fake device (cpu), the planned device's dtypes
    started = time.perf_counter()
    planned = run_steps(sim, fake=True)
    plan_s, started = time.perf_counter() - started, time.perf_counter()
    real = copy.copy(sim)
    real.device = opts.device
    with random_weights():
        measured = run_steps(real, fake=False)
    real_s = time.perf_counter() - started
    lines, passed = compare(planned, measured)
    print("\n".join(lines), flush=True)
    source = "max_memory_allocated" if opts.device == "cuda" else "tracked real tensors"
    ratios = ", ".join(
        f"{k[0]} {k[1]} {planned.get(k, 0) / max(1, measured.get(k, 0)):.3f}" for k in phases(planned, measured)
    )
    verdict = "all within 10%" if passed else "NOT all within 10%"
    return f"{opts.model} plan / {source}: {ratios}; {verdict} (plan {plan_s:.0f}s, real {real_s:.0f}s)", passed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        required=True,
        help=f"{', '.join(sorted(MODELS))}, or a built-in tiny folder (builtin:tiny-flux, ...; with --device cpu)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--flags", default="", help="More train_diffusion.py flags, one string (e.g. '--loss-type awm')."
    )
    parser.add_argument("--workdir", default="outputs/gpu_check", help="Where configs-only folders are built.")
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device visible (torch {torch.__version__}): use --device cpu with --model tiny")
    os.makedirs(opts.workdir, exist_ok=True)
    result, passed = plan_vs_measured(opts)
    print(f"RESULT: {result}", flush=True)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
