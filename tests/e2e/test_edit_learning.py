"""The shapes edit world learns (issue 30): DiffusionNFT fine-tunes the shipped editor `builtin:tiny-shapes-edit` (a
FLUX.1 Kontext-architecture model pretrained with `sft_loss` by scripts/pretrain_tiny_shapes_edit.py) on
`builtin:shapes-edit` triples, rewarded for the instruction (`shapes` against the target scene) and for keeping the
rest of the picture (`edit_preservation`), and raises the held-out all-correct edit accuracy.

`python tests/e2e/test_edit_learning.py SEED...` re-measures (one line per seed; `off` in place of a seed runs seed 1
with training switched off, the control). Numbers: EDIT_RESULTS below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import train_diffusion
from miles.utils.arguments import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e

ACC, REWARD, KEPT = "eval/shapes_accuracy", "eval/shapes_reward_mean", "eval/edit_preservation_mean"
EVAL_PROMPTS = 500  # an accuracy near 0.45 is known to ±2.2 points (one binomial std)
RECIPE = ("--loss-type", "nft", "--rm-type", "shapes", "--num-rollout", "40")
OFF = ("--lr", "1e-12")  # training switched off (--lr 0 is refused at parse time): the control
# measured by `main` below (EDIT_RESULTS); the standard sits below every seed
MIN_EDIT_ACCURACY_GAIN = 0.04
MAX_PRESERVATION_LOSS = 0.01  # the edits must not be bought by repainting the rest of the picture


def edit_args(out: Path, seed: int, *extra: str):
    model = ("--hf-checkpoint", "builtin:tiny-shapes-edit", "--prompt-data", "builtin:shapes-edit", "--dp-size", "2")
    seeds = ("--seed", str(seed), "--rollout-seed", str(seed))
    quiet = ("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING")
    args = parse_args(
        [*model, *seeds, *quiet, "--eval-num-prompts", str(EVAL_PROMPTS), "--output-dir", str(out), *extra]
    )
    args.eval_interval = args.num_rollout  # before training and after the last rollout
    return args


def edit_run(seed: int, out: Path, *extra: str) -> dict[str, list[float]]:
    """Each eval metric's values over the run (before, after)."""
    train_diffusion.run(edit_args(out, seed, *RECIPE, *extra))
    metrics = read_metrics(out / "metrics.jsonl")
    return {key: [round(m[key], 4) for m in metrics if key in m] for key in (ACC, REWARD, KEPT)}


@pytest.mark.standard  # ~5 min: run with `./scripts/test.sh -m standard` (the suite's 20 minutes hold no more)
def test_nft_raises_the_edit_accuracy_of_the_shipped_editor(ray_cluster, tmp_path):
    result = edit_run(1, tmp_path)
    assert result[ACC][-1] >= result[ACC][0] + MIN_EDIT_ACCURACY_GAIN, result
    assert result[KEPT][-1] >= result[KEPT][0] - MAX_PRESERVATION_LOSS, result


def main(argv: list[str]) -> None:
    import json
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="miles-edit-learning-"))
    for token in argv or ["1"]:
        seed, extra = (1, OFF) if token == "off" else (int(token), ())
        result = edit_run(seed, root / f"{token}", *extra)
        print(json.dumps({"seed": seed, "training": token != "off", **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
