"""What RL does on the shapes edit world (issue 30): DiffusionNFT fine-tunes the shipped editor
`builtin:tiny-shapes-edit` (a FLUX.1 Kontext-architecture model pretrained with `sft_loss` by
scripts/pretrain_tiny_shapes_edit.py) on `builtin:shapes-edit` triples, CFG-free, 40 rollouts of 8 x 8 samples,
scored on 500 held-out triples (20 ODE steps, fixed eval noise: the eval before training is the control, the model with
training off). `python tests/e2e/test_edit_learning.py SEED...` re-measures the recipe (`off`: seed 1 at lr 1e-12;
`--flag value` pairs apply to every run). The learning claim is BONUS_RECIPE's, 200 rollouts on a
1 000-prompt eval (the last table).

Measured 2026-12-04 (this 2-core machine, two runs at a time), from 0.422 all-correct, 0.836 reward, 0.889 kept:

| reward (`--rm-type`), lr | seed | all-correct accuracy | eval reward (instruction) | preservation |
|---|---|---|---|---|
| shapes, 1e-4 (RECIPE) | 1 / 2 / 3 | 0.436 / 0.458 / 0.414 (+1.4 / +3.6 / −0.8) | 0.857 / 0.868 / 0.854 (+0.021 / +0.032 / +0.018) | 0.858 / 0.846 / 0.777 (−3.0 / −4.3 / −11.2) |
| the same, training off (`off`: lr 1e-12), the control | 1 | 0.422 (±0) | 0.836 (±0) | 0.889 (±0) |
| shapes:1,shapes_strict:1 (a bonus of 1 for the all-correct event), 1e-4 | 1 / 2 / 3 | 0.426 / 0.480 / 0.462 (+0.4 / +5.8 / +4.0) | 0.857 / 0.870 / 0.864 (+0.021 / +0.034 / +0.028) | 0.866 / 0.875 / 0.785 (−2.3 / −1.4 / −10.4) |
| shapes:1,edit_preservation:0.2, 1e-4 | 1 | 0.412 (−1.0) | 0.855 (+0.019) | 0.913 (+2.4) |
| shapes:1,edit_preservation:0.5, 1e-4 | 1 | 0.378 (−4.4) | 0.848 (+0.012) | 0.946 (+5.7) |
| shapes, 3e-4 | 1 / 2 | 0.370 / 0.370 (−5.2) | 0.850 / 0.846 | 0.765 / 0.853 |

The bar is a gain beyond two stds of the difference of two 500-prompt evals (sqrt(2 p (1 − p) / 500) = 3.1 points at
p = 0.422, so 6.2 points) in every seed; no row meets it. The instruction reward rises in every run at lr 1e-4, but
the all-correct accuracy moves by at most 1.9 stds (the bonus's +5.8 on seed 2; +3.4 on average over its three seeds
against +1.4 for nft), and what the
instruction gains the preservation loses, and the other way round, as the weighted rewards show (seed 3's nft run also
tripped the `monitor/x0_norm_mean` drift warning at rollout 29, the bonus's seed 3 at rollouts 29, 31 and 36). The bonus rows were measured on 2026-12-04
afternoon, mostly under a load average of 12 to 24 from other jobs (19 to 165 s per rollout, 2 s when the machine
was quiet; seed 3 with the built-in `shapes_strict`, seeds 1 / 2 with a custom reward returning the same value; seed 1's
run had `--num-rollout 80` and was stopped after its rollout-40 eval, the lr is constant so its first 40 rollouts
are a 40-rollout run's). The text-to-image demo's own 40-rollout gains (+3.6 to +8.4 points, README) would not all
meet this bar either.

Where the accuracy is lost (`python tests/e2e/test_edit_learning.py breakdown`: the eval split by edit kind and by
the target's shape, the shipped editor): recolour 0.688 (189 eval edits), reshape 0.370 (154), move 0.153 (157).
A move drops a shape in 42% of its edits (count right in 45%); squares come out short of a square's fill, so the shape score reads
them as another shape: all-correct 0.000 for moves to squares (59 edits), 0.107 for reshapes into squares (56), and 0.545
even for recolouring squares the source already shows (66, against 0.883 for triangles). The shapes VAE is not the
limit (its reconstruction of the 500 eval targets scores 1.000, also printed by `breakdown`), the transformer is. Where an attribute is wrong in
nearly every sample of a prompt (moved or new squares), a group of 8 holds no all-correct sample to pull toward,
and paying the event more (the bonus) cannot help there: only group-relative partial credit moves them. What is
missing, in our reading: an editor that copies squares and keeps counts on moves (more
`sft_loss` steps in scripts/pretrain_tiny_shapes_edit.py; not tried here), or far more rollouts than 40 (below).

Longer, on a 1 000-prompt eval (2026-12-04 evening, two runs at a time; 4.3 s per rollout when alone):
`--rm-type shapes:1,shapes_strict:1`, lr 1e-4, **200 rollouts** (BONUS_RECIPE), from 0.403 all-correct, 0.834 reward,
0.881 kept on the 1 000 eval edits (`python tests/e2e/test_edit_learning.py --rm-type shapes:1,shapes_strict:1
--num-rollout 200 --eval-num-prompts 1000 1 2 3` re-measures the before and after values). The lr is constant, so a
200-rollout run's first 120 rollouts are a 120-rollout run's: the values at 40 / 80 / 120 come from 120-rollout runs
with evals every 40, those at 160 / 200 from 200-rollout runs (seed 1's also evaluated at 80: 0.448 again, exactly):

| seed | all-correct at rollout 40 / 80 / 120 / 160 / 200 | eval reward at 200 | preservation at 200 |
|---|---|---|---|
| 1 | 0.398 / 0.448 / 0.434 / 0.473 / 0.505 (+10.2 at 200) | 0.885 | 0.843 (−3.8) |
| 2 | 0.465 / 0.470 / 0.479 / 0.492 / 0.519 (+11.6) | 0.892 | 0.874 (−0.7) |
| 3 | 0.444 / 0.479 / 0.511 / 0.529 / 0.519 (+11.6) | 0.890 | 0.853 (−2.8) |

The bar at 1 000 prompts is 4.4 points (2 stds of the difference of two independent evals at p = 0.403): at 200
rollouts every seed is beyond it (at 120, seed 1 was not: +3.1). The bar is the conservative one; both evals here
share prompts and noise, and seed 3's saved 120-rollout model, re-evaluated edit by edit (0.512), has 166 edits right
only after training and 57 right only before: an exact McNemar p of 1.5e-13, a paired std of 1.5 points. The
standards below: the recipe's gain beyond the bar in each seed (37-54 minutes a seed here beside another run; its
200 rollouts take ~15 minutes alone), and what every lr-1e-4
nft run showed at 40 rollouts (the instruction reward up by 0.015 or more without the accuracy falling by more than
the eval's noise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: the driver module lives at the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_diffusion  # noqa: E402
from miles.arguments.parser import parse_args  # noqa: E402
from miles.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.e2e

ACC, REWARD, KEPT = "eval/shapes_accuracy", "eval/shapes_reward_mean", "eval/edit_preservation_mean"
EVAL_PROMPTS = 500  # an accuracy near 0.45 is known to ±2.2 points (one binomial std)
RECIPE = ("--loss-type", "nft", "--rm-type", "shapes", "--num-rollout", "40")
OFF = ("--lr", "1e-12")  # training switched off (--lr 0 is refused at parse time): the control
# the standard sits below every lr-1e-4 run of the table above
MIN_EDIT_REWARD_GAIN = 0.015
MAX_EDIT_ACCURACY_LOSS = 0.03  # about one std of a difference of two 500-prompt evals
# the eval size comes after edit_args' EVAL_PROMPTS, so it holds
BONUS_RECIPE = ("--loss-type", "nft", "--rm-type", "shapes:1,shapes_strict:1", "--num-rollout", "200")
BONUS_RECIPE += ("--eval-num-prompts", "1000")
MIN_ACCURACY_GAIN = 0.044  # two stds (2.2 points each) of the difference of two 1 000-prompt evals near 0.40


def edit_args(out: Path, seed: int, *extra: str):
    model = ("--hf-checkpoint", "builtin:tiny-shapes-edit", "--prompt-data", "builtin:shapes-edit", "--dp-size", "2")
    seeds = ("--seed", str(seed), "--rollout-seed", str(seed))
    quiet = ("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING")
    args = parse_args(
        [*model, *seeds, *quiet, "--eval-num-prompts", str(EVAL_PROMPTS), "--output-dir", str(out), *extra]
    )
    args.eval_interval = args.num_rollout  # before training and after the last rollout
    return args


def edit_run(seed: int, out: Path, *extra: str, recipe: tuple[str, ...] = RECIPE) -> dict[str, list[float]]:
    """Each eval metric's values over the run (before, after)."""
    train_diffusion.run(edit_args(out, seed, *recipe, *extra))
    metrics = read_metrics(out / "metrics.jsonl")
    return {key: [round(m[key], 4) for m in metrics if key in m] for key in (ACC, REWARD, KEPT)}


@pytest.mark.standard  # ~7 min: run with `./scripts/test.sh -m standard` (the suite's 20 minutes hold no more)
def test_nft_raises_the_edit_reward_of_the_shipped_editor(ray_cluster, tmp_path):
    result = edit_run(1, tmp_path)
    assert result[REWARD][-1] >= result[REWARD][0] + MIN_EDIT_REWARD_GAIN, result
    assert result[ACC][-1] >= result[ACC][0] - MAX_EDIT_ACCURACY_LOSS, result


@pytest.mark.standard  # 37-54 min a seed measured beside another run (~15 min of rollouts alone)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_bonus_recipe_raises_the_held_out_edit_accuracy_beyond_the_noise(ray_cluster, tmp_path, seed):
    result = edit_run(seed, tmp_path, recipe=BONUS_RECIPE)
    assert result[ACC][-1] >= result[ACC][0] + MIN_ACCURACY_GAIN, result


def edit_kind_breakdown(checkpoint: str = "builtin:tiny-shapes-edit") -> dict[str, dict[str, float]]:
    """The eval's accuracies split by edit kind (recolour / reshape / move) and by the target's shape, with the eval's
    own records, noise and 20 ODE steps: where the all-correct accuracy is lost."""
    from collections import defaultdict

    import numpy as np

    from miles.data.shapes_edit import shapes_edit_items
    from miles.models.builtin import resolve_checkpoint
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.evaluation import generate_eval_samples
    from miles.rollout.rm_hub.shapes import shapes_reward

    records = shapes_edit_items(EVAL_PROMPTS, seed=0, split="eval")  # the runs' default --eval-seed 0
    engine = DiffusionEngine(resolve_checkpoint(checkpoint))
    samples = generate_eval_samples(engine, records, num_steps=20, guidance_scale=1.0, seed=0, resolution=32)
    groups = defaultdict(list)
    for record, score in zip(records, shapes_reward(list(samples.images), [r["metadata"] for r in records])):
        meta = record["metadata"]
        for key in ("all", meta["edit"], f"{meta['edit']}/{meta['shape']}"):
            groups[key].append((score, score.num_objects - meta["count"]))
    return {
        key: {
            "n": len(group),
            "all_correct": round(float(np.mean([s.all_correct for s, _ in group])), 3),
            "shape_likeness": round(float(np.mean([s.shape for s, _ in group])), 3),
            "count_right": round(float(np.mean([d == 0 for _, d in group])), 3),
            "too_few_objects": round(float(np.mean([d < 0 for _, d in group])), 3),
            "position_right": round(float(np.mean([s.position >= 0.5 for s, _ in group])), 3),
        }
        for key, group in sorted(groups.items())
    }


def vae_ceiling(checkpoint: str = "builtin:tiny-shapes-edit") -> float:
    """The all-correct accuracy of the eval targets passed through the editor's VAE (encode, decode): what the
    transformer could reach at best."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKL

    from miles.data.shapes_edit import shapes_edit_items
    from miles.models.builtin import resolve_checkpoint
    from miles.rollout.rm_hub.shapes import shapes_reward

    vae = AutoencoderKL.from_pretrained(resolve_checkpoint(checkpoint), subfolder="vae").eval()
    items = shapes_edit_items(EVAL_PROMPTS, seed=0, split="eval", targets=True)
    targets = torch.tensor(np.stack([np.asarray(item["image"]) for item in items]), dtype=torch.float32)
    with torch.no_grad():
        decoded = vae.decode(vae.encode(targets.permute(0, 3, 1, 2) / 127.5 - 1).latent_dist.mode()).sample
    images = ((decoded.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    scores = shapes_reward(list(images), [item["metadata"] for item in items])
    return float(np.mean([score.all_correct for score in scores]))


def main(argv: list[str]) -> None:
    import json
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if argv == ["breakdown"]:
        for key, row in edit_kind_breakdown().items():
            print(json.dumps({"group": key, **row}), flush=True)
        print(json.dumps({"vae_reconstructed_targets_all_correct": vae_ceiling()}), flush=True)
        return
    from tests.e2e.script_args import split_flags

    flags, tokens = split_flags(argv)  # e.g. `--num-rollout 120 1 2 off`: the flags go to every run, off keeps 1e-12
    root = Path(tempfile.mkdtemp(prefix="miles-edit-learning-"))
    for token in tokens or ["1"]:
        seed, extra = (1, (*flags, *OFF)) if token == "off" else (int(token), tuple(flags))
        result = edit_run(seed, root / f"{token}", *extra)
        print(json.dumps({"seed": seed, "training": token != "off", "extra": extra, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
