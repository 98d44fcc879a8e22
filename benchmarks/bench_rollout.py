"""Rollout throughput, side by side in one run: the engine recording SDE trajectories and log-probs, the same engine
with `ode` and no recording, and a plain `StableDiffusion3Pipeline.__call__` with identical settings.

    python benchmarks/bench_rollout.py                       # the tiny pipeline, built in a temp folder
    python benchmarks/bench_rollout.py --hf-checkpoint DIR --device cuda --batch-size 8 --num-steps 10
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.rollout.engine import DiffusionEngine  # noqa: E402
from miles.rollout.engine_api import GenerateRequest  # noqa: E402
from miles.rollout.step_strategy_hub import all_but_last  # noqa: E402

logger = logging.getLogger("bench_rollout")
PROMPTS = ["a red circle", "two blue squares on the left", "a green triangle at the top", "three yellow circles"]
MAX_RECORDING_OVERHEAD = 0.15


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", default=None, help="diffusers SD3 pipeline folder; default: tiny pipeline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    return parser.parse_args()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    path = args.hf_checkpoint
    if path is None:
        from miles.models.sd3.tiny import save_tiny_sd3_pipeline

        path = save_tiny_sd3_pipeline(str(Path(tempfile.mkdtemp(prefix="bench_rollout_")) / "tiny"))

    from diffusers import StableDiffusion3Pipeline

    engine = DiffusionEngine(path, device=args.device, forward_dtype=dtype)
    family = engine.family
    resolution = args.resolution or family.default_resolution
    pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True).to(args.device, dtype)
    pipe.set_progress_bar_config(disable=True)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch_size)]
    seeds = list(range(args.batch_size))
    common = dict(
        prompts=prompts,
        seeds=seeds,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        negative_prompt="",
        noise_level=args.noise_level,
        resolution=resolution,
        decode=True,
    )
    recording = GenerateRequest(**common, sde_type="sde", trained_steps=all_but_last(args.num_steps))
    plain = GenerateRequest(**common, sde_type="ode", trained_steps=[])

    def run_pipeline() -> object:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        return pipe(
            prompt=prompts,
            num_inference_steps=args.num_steps,
            guidance_scale=args.guidance_scale,
            height=resolution,
            width=resolution,
            generator=generators,
            max_sequence_length=family.max_sequence_length,
            output_type="np",
        )

    runners: dict[str, Callable[[], object]] = {
        "diffusers StableDiffusion3Pipeline": run_pipeline,
        "engine ode, no recording": lambda: engine.generate(plain),
        "engine sde + trajectory/log-probs": lambda: engine.generate(recording),
    }
    with torch.no_grad():
        for fn in runners.values():
            for _ in range(args.warmup):
                fn()
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits every runner alike
            for name, fn in runners.items():
                times[name].append(timed(fn, args.device))

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    logger.info(
        "checkpoint %s | device %s %s | batch %d, %d steps, CFG %.1f, %dpx, %d repeats (median), %d warm-up",
        path,
        args.device,
        args.dtype,
        args.batch_size,
        args.num_steps,
        args.guidance_scale,
        resolution,
        args.repeats,
        args.warmup,
    )
    logger.info("%-36s %12s %10s", "runner", "median s", "images/s")
    for name, median in medians.items():
        logger.info("%-36s %12.4f %10.1f", name, median, args.batch_size / median)
    reference = medians["diffusers StableDiffusion3Pipeline"]
    recorded = medians["engine sde + trajectory/log-probs"]
    ode = medians["engine ode, no recording"]
    logger.info("engine ode / diffusers time:            %.3f", ode / reference)
    logger.info("engine sde+recording / diffusers time:  %.3f", recorded / reference)
    logger.info("engine sde+recording / engine ode time: %.3f", recorded / ode)
    overhead = recorded / reference - 1
    verdict = "OK" if overhead < MAX_RECORDING_OVERHEAD else "OVER BUDGET"
    logger.info(
        "recording overhead vs diffusers: %+.1f%% (budget %.0f%%): %s",
        100 * overhead,
        100 * MAX_RECORDING_OVERHEAD,
        verdict,
    )


if __name__ == "__main__":
    main()
