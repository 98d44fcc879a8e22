"""Distillation standard from the shipped shapes model (§9; issue 5), measured over several seeds.

DMD2 distils `builtin:tiny-shapes` (the teacher: 20 ODE steps, CFG 4.5) into CFG-free 1- and 2-step generators on
2 CPU ranks, and the held-out `builtin:shapes` eval prompts (fixed noise) score them against the same teacher sampled with
plain Euler steps of its own scheduler. `python tests/e2e/test_learning.py dmd2 SEED...` re-measures every number
below (1- and 2-step generators); `nft` or `policy_loss` in place of `dmd2` measures those runs' before/after.

Measured on this machine (2 CPU cores), `eval/shapes_accuracy` on 500 eval prompts:

| | seed 1 | seed 2 |
|---|---|---|
| teacher, 20 steps, CFG 4.5 | 0.262 | 0.262 |
| teacher, 1 Euler step / 2 Euler steps, CFG 4.5 | 0.132 / 0.132 | 0.132 / 0.132 |
| dmd2 1-step generator, 30 rollouts | 0.182 | 0.150 |
| dmd2 2-step generator, 30 rollouts | 0.192 | 0.162 |

The generators beat as many Euler steps by 5.0 / 1.8 points (k = 1) and 6.0 / 3.0 (k = 2); the committed standards are
1 and 2 points. Neither came within a few points of the teacher in 30 rollouts (they close 15-45% of the gap), so
that is not asserted.
(The scheduler's 2-step grid ends at σ ≈ 0.003, so its second Euler step barely moves the sample.)
"""

from __future__ import annotations

import sys

import pytest

import train_diffusion
from miles.utils.arguments import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
ACC = "eval/shapes_accuracy"
SEED = 1
# 100 prompts leave a binomial std of ~4 points on a ~20% accuracy, as large as the effects measured here
EVAL_PROMPTS = 500
# k-step generator vs k Euler steps of the teacher; the two seeds gave +0.050 / +0.018 (k = 1), +0.060 / +0.030 (k = 2)
MIN_GAIN_OVER_EULER = {1: 0.01, 2: 0.02}

RL_RUNS = {  # what `measure` runs for nft / policy_loss (no committed standard: see the issue notes)
    "policy_loss": ("--loss-type", "policy_loss", "--lr", "3e-4", "--diffusion-guidance-scale", "1"),
    "nft": ("--loss-type", "nft", "--lr", "3e-4"),
}


def shapes_args(out, seed: int, *extra: str):
    model = ("--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes", "--dp-size", "2")
    seeds = ("--seed", str(seed), "--rollout-seed", str(seed))
    quiet = ("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING")
    evals = ("--eval-num-prompts", str(EVAL_PROMPTS))
    args = parse_args([*model, *seeds, *quiet, *evals, "--output-dir", str(out), *extra])
    args.eval_interval = args.num_rollout  # before training and after the last rollout only
    return args


def eval_accuracies(out) -> list[float]:
    return [m[ACC] for m in read_metrics(out / "metrics.jsonl") if ACC in m]


def teacher_accuracies(steps: tuple[int, ...] = (20, 1, 2)) -> dict[int, float]:
    """The shipped model sampled with its own scheduler at CFG 4.5: its usual 20 steps, or 1-2 plain Euler steps."""
    from miles.data.shapes import shapes_prompts
    from miles.models.builtin import SHIPPED_SHAPES_DIR
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.evaluation import evaluate_shapes

    engine = DiffusionEngine(SHIPPED_SHAPES_DIR)
    records = shapes_prompts(EVAL_PROMPTS, seed=0, split="eval")  # the eval split an --eval-seed 0 run scores
    return {n: evaluate_shapes(engine, records, num_steps=n, guidance_scale=4.5, seed=0)[0][ACC] for n in steps}


def dmd2_run(k: int, seed: int, out) -> float:
    """Accuracy of the k-step generator distilled from the shipped model (evaluated with its own k steps)."""
    distil = ("--loss-type", "dmd2", "--teacher-load", "builtin:tiny-shapes", "--dmd2-generator-steps", str(k))
    train_diffusion.run(shapes_args(out, seed, *distil, "--lr", "1e-3", "--num-rollout", "30"))
    return eval_accuracies(out)[-1]


def rl_run(loss: str, seed: int, out) -> tuple[float, float]:
    """Accuracy before the first update and after 20 rollouts."""
    train_diffusion.run(shapes_args(out, seed, *RL_RUNS[loss], "--num-rollout", "20"))
    accuracies = eval_accuracies(out)
    return accuracies[0], accuracies[-1]


@pytest.mark.parametrize("k", [1, 2])
def test_dmd2_generator_beats_as_many_euler_steps_of_its_teacher(ray_cluster, tmp_path, k):
    euler = teacher_accuracies((k,))[k]
    generator = dmd2_run(k, SEED, tmp_path)
    assert generator >= euler + MIN_GAIN_OVER_EULER[k], (k, generator, euler)


def measure(which: list[str], seeds: list[int]) -> None:
    """Re-measure: prints one line per run and seed."""
    import os
    import tempfile
    from pathlib import Path

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="miles-standards-"))
    if "dmd2" in which:
        print("teacher (steps: accuracy)", teacher_accuracies(), flush=True)
    for seed in seeds:
        for name in which:
            if name == "dmd2":
                for k in (1, 2):
                    print(f"dmd2 k={k} seed {seed}: {dmd2_run(k, seed, root / f'dmd2_{k}_{seed}'):.3f}", flush=True)
            else:
                before, after = rl_run(name, seed, root / f"{name}_{seed}")
                print(f"{name} seed {seed}: {before:.3f} -> {after:.3f}", flush=True)


if __name__ == "__main__":
    measure(sys.argv[1].split(","), [int(s) for s in sys.argv[2:]])
