"""What RL does on the moving-shapes video world (issue 31): DiffusionNFT fine-tunes the shipped video model
`builtin:tiny-moving-shapes` (a Wan 2.1-architecture model pretrained with `sft_loss` by
scripts/pretrain_tiny_moving_shapes.py) on `builtin:moving-shapes` captions with the world's own `moving_shapes`
reward (colour, shape, direction of motion), CFG-free, and the held-out all-correct accuracy is measured on
EVAL_PROMPTS eval-split clips (20 ODE steps, fixed eval noise) before training and after the last rollout.
`python tests/e2e/test_moving_shapes_learning.py SEED... [off]` re-measures the recipe and prints a JSON line per run
(`off`: seed 1 with training switched off, `--lr 1e-12`: the control; `--flag value` pairs such as `--lr X` or
`--dp-size 1` apply to every run).

Measured 2026-12-04 (this 2-core machine, two runs at a time, load 4 to 6), 30 rollouts of 8 captions x 8 clips
(1 920 clips), dp 2, from the shipped model's 0.073 all-correct (colour 0.983, shape 0.507, direction 0.157, reward
0.5245):

| `--lr` (recipe: nft, 30 rollouts) | seed | all-correct | reward | colour / shape / direction accuracy |
|---|---|---|---|---|
| (before training: the shipped model) | | 0.073 | 0.5245 | 0.983 / 0.507 / 0.157 |
| 1e-12 (`off`: training switched off), the control | 1 | 0.073 (±0) | 0.5245 (±0) | 0.983 / 0.507 / 0.157 |
| 1e-4 (the default) | 1 / 2 | 0.063 / 0.060 (−1.0 / −1.3) | 0.5296 / 0.5308 (+0.005 / +0.006) | 0.997 / 0.423 / 0.160; 1.000 / 0.430 / 0.163 |
| 3e-4 | 1 / 2 | 0.100 / 0.050 (+2.7 / −2.3) | 0.5045 / 0.4898 (−0.020 / −0.035) | 0.903 / 0.533 / 0.197; 0.980 / 0.367 / 0.153 |
| 1e-3 | 1 | stopped after 9 rollouts: the rollout reward fell from 0.551 to 0.349 | | |

The std of a difference of two 300-clip evals near p = 0.07 is sqrt(2 p (1 - p) / 300) = 2.1 points. No run raised
the all-correct accuracy beyond that noise (the best, lr 3e-4 seed 1, +2.7 points with direction +4, is 1.3 stds and
seed 2 at the same rate lost 2.3): the shipped model moves its shapes (its ink centroid travels 0.29 of the canvas per
clip) but in a direction that does not depend on the caption (its mean travel along the asked direction is within
0.022 of zero for each of the four; direction 0.157, below the 0.25 of a random direction), and 1 920 clips of nft do
not teach it to; at lr 1e-4 the reward rises a little (the colour) while the shape accuracy falls, larger rates walk
the reward down. Three other pretraining recipes (2 heads x 32, 1 head x 64, `--sft-logit-mean 1.1`; the numbers in
scripts/pretrain_tiny_moving_shapes.py) ended at 0.060-0.070 all-correct, direction 0.150-0.183, so the shipped model
is unchanged and there is still no model of this world with a direction to reinforce. policy_loss (`--loss-type
policy_loss`, its CFG 4.5: 0.060 all-correct before training, colour 0.757, direction 0.167) was stopped after 6 of
30 rollouts, seeds 1 / 2 (13 minutes at load 14 to 17, too slow for the day): rollout rewards 0.514 0.538 0.536
0.483 0.523 0.496 / 0.426 0.512 0.542 0.454 0.566 0.489, no trend yet. So the
standard below is the issue's goal, kept as a strict expected failure: it records that the goal is not met here, and
turns into a failure (to be promoted to a plain standard) the day a model or recipe meets it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: the driver module lives at the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_diffusion  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.e2e

ACC, REWARD = "eval/moving_shapes_accuracy", "eval/moving_shapes_reward_mean"
ATTRIBUTES = tuple(f"eval/moving_shapes_{a}_accuracy" for a in ("color", "shape", "direction"))
EVAL_PROMPTS = 300  # an accuracy p is known to sqrt(p (1 - p) / 300): 1.5 points at 0.07, 2.8 at 0.4
RECIPE = ("--loss-type", "nft", "--num-rollout", "30")
OFF = ("--lr", "1e-12")  # training switched off (--lr 0 is refused at parse time): the control
MIN_ACCURACY_GAIN = 0.05  # over two stds (2.1 points each) of the difference of two 300-clip evals near 0.07


def moving_args(out: Path, seed: int, *extra: str):
    model = ("--hf-checkpoint", "builtin:tiny-moving-shapes", "--prompt-data", "builtin:moving-shapes")
    seeds = ("--seed", str(seed), "--rollout-seed", str(seed), "--dp-size", "2")
    quiet = ("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING")
    args = parse_args(
        [*model, *seeds, *quiet, "--eval-num-prompts", str(EVAL_PROMPTS), "--output-dir", str(out), *extra]
    )
    args.eval_interval = args.num_rollout  # before training and after the last rollout
    return args


def moving_run(seed: int, out: Path, *extra: str) -> dict[str, list[float]]:
    """Each eval metric's values over the run (before, after)."""
    train_diffusion.run(moving_args(out, seed, *RECIPE, *extra))
    metrics = read_metrics(out / "metrics.jsonl")
    return {key: [round(m[key], 4) for m in metrics if key in m] for key in (ACC, REWARD, *ATTRIBUTES)}


@pytest.mark.standard  # minutes: run with `./scripts/test.sh -m standard` (the suite's 20 minutes hold no more)
@pytest.mark.xfail(
    strict=True, reason="not met on 2026-12-04: all-correct moved -1.0 / -1.3 points (seeds 1 / 2), see above"
)
def test_nft_raises_the_held_out_accuracy_of_the_shipped_video_model(ray_cluster, tmp_path):
    result = moving_run(1, tmp_path)
    assert result[ACC][-1] >= result[ACC][0] + MIN_ACCURACY_GAIN, result


def main(argv: list[str]) -> None:
    import json
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    flags: list[str] = []  # `--flag value` pairs for every run (`--dp-size 1 --lr 3e-4 1 2 off`: off keeps 1e-12)
    tokens = []
    while argv:
        if argv[0].startswith("--"):
            flags, argv = [*flags, *argv[:2]], argv[2:]
        else:
            tokens, argv = [*tokens, argv[0]], argv[1:]
    root = Path(tempfile.mkdtemp(prefix="miles-moving-shapes-learning-"))
    for token in tokens or ["1"]:
        seed, extra = (1, (*flags, *OFF)) if token == "off" else (int(token), tuple(flags))
        result = moving_run(seed, root / f"{token}", *extra)
        print(json.dumps({"seed": seed, "training": token != "off", "extra": extra, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
