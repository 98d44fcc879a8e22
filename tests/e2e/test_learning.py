"""Learning standards from the shipped shapes model (§9; issues 4 and 5), measured over several seeds.

DMD2 distils `builtin:tiny-shapes` (the teacher: 20 ODE steps, CFG 4.5) into CFG-free 1- and 2-step generators on
2 CPU ranks, and the held-out `builtin:shapes` eval prompts (fixed noise) score them against the same teacher sampled with
plain Euler steps of its own scheduler. DiffusionNFT fine-tunes the shipped model itself (CFG-free, as it samples):
it is the no-flag run (`./scripts/demo.sh`), and its standard is the default run's.
`python tests/e2e/test_learning.py dmd2 SEED...` re-measures every dmd2 number below (1- and 2-step generators);
`default` (the no-flag run: nft, lr 1e-4, 40 rollouts; seed `none` keeps its own seeds), `dmd2_reward` (plain and
reward-guided dmd2 from a CFG 1.5 teacher), `policy_loss` or
`policy_loss_long` in place of `dmd2` measures those runs' before/after. `python tests/e2e/test_learning.py race
grpo_guard,dance 1 2 3` runs loss types' recipes (`RACE_RECIPES`, `all` for every one) at the demo's budget, one run at a
time, and prints a JSON line per run: accuracy and eval reward at rollouts 0 / 20 / 40, samples, wall and CPU seconds
(the README's "Which learns fastest here").

Measured on this machine (2 CPU cores), `eval/shapes_accuracy` on 500 eval prompts (the teacher rows are the same
for every seed: fixed eval noise):

| | seed 1 | seed 2 |
|---|---|---|
| teacher, 20 steps, CFG 4.5 | 0.566 | 0.566 |
| teacher, 1 Euler step / 2 Euler steps, CFG 4.5 | 0.192 / 0.194 | 0.192 / 0.194 |
| dmd2 1-step generator, 30 rollouts | 0.400 | 0.442 |
| dmd2 2-step generator, 30 rollouts | 0.540 | 0.502 |
| dmd2 2-step generator, 30 rollouts, re-measured 2026-11-30 (`SUITE_RECIPE`) | 0.548 | 0.528 |
| dmd2 1-step / 2-step generator before training | 0.186 / 0.338 | 0.186 / 0.338 |
| dmd2 1-step / 2-step generator, 60 rollouts (`--num-rollout 60`) | 0.526 / 0.564 | 0.438 / 0.524 |
| dmd2 1-step generator, its recipe (below) | 0.538 | 0.536 (seed 3: 0.536) |
| dmd2 2-step generator, its recipe (60 rollouts, cosine lr decay) | 0.586 | 0.548 |

At a constant lr, 30 rollouts bring the 2-step generator within 2.6 / 6.4 points of the teacher (+34.6 / +30.8 over
2 Euler steps) and leave the 1-step one 16.6 / 12.4 short; 60 rollouts: 0.2 / 4.2 and 4.0 / 12.8. Each generator's
recipe (`DMD2_RECIPES`) ends in a cosine learning-rate decay: the 2-step generator then scores 0.586 / 0.548 after 60
rollouts (2.0 above / 1.8 below the teacher, +39.2 / +35.4 over 2 Euler steps; 30 rollouts with the decay gave
0.548 / 0.490). The committed standards (`MIN_GAIN_OVER_EULER`, `MAX_GAP_TO_TEACHER`) sit below what every seed
showed with each recipe. The standard tier also distils k = 2 for 30 rollouts at a constant lr (`SUITE_RECIPE`,
1.6 min; the default suite ran it until 2026-12-07, when its 20 minutes no longer held it) and takes the teacher's 20-step accuracy as recorded
(`TEACHER_ACCURACY`; it samples the 2-step one); re-measured on 2026-11-30 it meets both standards on seeds 1 and 2
(0.548 / 0.528: 1.8 / 3.8 points below the teacher, +35.4 / +33.4 over 2 Euler steps). Each recipe's numbers, k = 1
(5 min) included, are re-measured by the command above.
(The scheduler's 2-step grid ends at σ ≈ 0.003, so its second Euler step barely moves the sample.)

The 1-step recipe also draws the DMD timesteps unshifted (`--dmd2-timestep-shift 1`; the scheduler's shift 3 favours
high noise, where layout is learnt, and left its shapes behind: shape accuracy 0.59 vs 0.66 at 60 rollouts, seed 2)
and runs 90 rollouts. At a constant lr its accuracy swings by ±4 points from one 30-rollout eval to the next (seed 1:
0.432 / 0.534 / 0.492 / 0.456 at 30 / 60 / 90 / 120 rollouts), and the decay lets it settle. Seeds 1 / 2 / 3 give
0.538 / 0.536 / 0.536: 2.8 / 3.0 / 3.0 points below the teacher and 34.6 / 34.4 / 34.4 above one Euler step. Shift 1
or 2 at a constant lr for 60 rollouts gave 0.534 / 0.480 and 0.518 / 0.488 (seeds 1 / 2).

nft, lr 1e-4 (the defaults), CFG-free eval (20 ODE steps), from 0.420 accuracy and 0.861 reward (the same model at
CFG 4.5: 0.566):

| | seed 1 | seed 2 | seed 3 | seed 4 |
|---|---|---|---|---|
| `eval/shapes_accuracy` after 20 rollouts | 0.444 (+2.4 pts) | 0.426 (+0.6) | 0.418 (-0.2) | 0.456 (+3.6) |
| `eval/shapes_reward_mean` after 20 rollouts | 0.874 (+0.013) | 0.875 (+0.014) | 0.874 (+0.013) | 0.879 (+0.018) |
| `eval/shapes_accuracy` after 40 rollouts | 0.540 (+12.0 pts) | 0.508 (+8.8) | 0.496 (+7.6) | |
| `eval/shapes_reward_mean` after 40 rollouts | 0.893 (+0.032) | 0.893 (+0.032) | 0.885 (+0.024) | |

After 40 rollouts (4.5 min) the CFG-free model nears what CFG gives the shipped one (count accuracy 0.91 → 0.99 in
seed 2, shape 0.58 → 0.63); the committed standards are +4 points of accuracy and +0.015 reward after 40 rollouts.
lr 3e-4 (seed 3, 20 rollouts) lowered accuracy to 0.396.
Regenerated 2026-12-07 at 9980a28 (`python scripts/regen_results.py`, docs/results.md): after 40 rollouts seeds 1 / 2 / 3
reach 0.448 / 0.478 / 0.496 (+2.8 / +5.8 / +7.6 pts; seed 3 as above, seeds 1 and 2 lower than recorded above, on older
code) and the no-flag run 0.504 (+8.4), the run the standard holds.

policy_loss (Flow-GRPO) with the default flags (lr 1e-4, CFG 4.5, per-group std), 20 rollouts, from 0.566 accuracy:

| | seed 1 | seed 2 | seed 3 | seed 4 |
|---|---|---|---|---|
| `eval/shapes_accuracy` after 20 rollouts | 0.584 (+1.8 pts) | 0.582 (+1.6) | 0.572 (+0.6) | 0.558 (-0.8) |
| the same with `--globalize-reward-std` | 0.578 (+1.2) | 0.574 (+0.8) | 0.594 (+2.8) | |

The eval reward stayed within ±0.004 of 0.908 in all of them; 40 rollouts gave 0.588 / 0.560 (seeds 1 / 2); lr 3e-4
and 1e-3 (seed 3) lowered accuracy to 0.34 and 0.04. Variants, same 500 prompts (before: 0.566 with CFG, 0.420
CFG-free):

| policy_loss variant | after | seeds |
|---|---|---|
| every step trained (`--diffusion-num-sde-steps 0`), 20 rollouts | 0.556 / 0.486 | 1 / 2 |
| `--diffusion-shared-initial-noise`, 20 rollouts | 0.556 / 0.552 / 0.550 | 1 / 2 / 3 |
| 256 samples per update (`--rollout-batch-size 32`), 10 rollouts, lr 1e-4 / 2e-4 | 0.578 / 0.560 | 1 |
| LoRA rank 8, lr 1e-3, 20 rollouts | 0.580 | 1 |
| CFG-free rollouts and eval (`--diffusion-guidance-scale 1`), 20 rollouts, from 0.420 | 0.380 / 0.402 | 1 / 2 |
| the same, 150 rollouts (9 min), lr 1e-4 / 5e-5 | 0.404 / 0.410 | 1 |
| the same, 400 rollouts (21 min), lr 5e-5: after 100 / 200 / 300 / 400 rollouts | 0.412 / 0.402 / 0.482 / 0.448 | 1 |
| | 0.420 / 0.452 / 0.478 / 0.470 | 2 |
| | 0.444 / 0.474 / 0.502 / 0.522 | 3 |

The CFG-free rows are where nft gains 12 points in 40 rollouts from the same model and prompts. policy_loss gets
there only with about ten times the samples: after 300 CFG-free rollouts at lr 5e-5 (19 200 samples, 16 min) it
scored 0.482 / 0.478 / 0.502 (+6.2 / +5.8 / +8.2 points, seeds 1 / 2 / 3), after 400 0.448 / 0.470 / 0.522 with the
eval reward up 0.021 / 0.024 / 0.015 and the rollout reward up 0.018 / 0.012 / 0.012 (second half of the run
against the first); `policy_loss_long` above re-measures it.
`benchmarks/bench_gradient_signal.py` measures why: the gradients of independent 64-sample rollouts agree at
0.0025 ± 0.0032 for policy_loss and 0.032 ± 0.008 for nft (CFG-free; with CFG 4.5 neither agrees at all), so a
policy_loss update is noise, and its noise walks the weights off (larger learning rates only lower accuracy). No
margin within the suite's minutes, so policy_loss has no learning standard in the suite (issue 4 is blocked on it);
tests/e2e/test_policy_loss.py checks that its reward rises on a simpler objective.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script (`measure`): the driver module lives at the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_diffusion  # noqa: E402
from miles.arguments.parser import parse_args  # noqa: E402
from miles.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.e2e
ACC = "eval/shapes_accuracy"
SEED = 1
# 100 prompts leave a binomial std of ~5 points on a ~55% accuracy, as large as the effects measured here
EVAL_PROMPTS = 500
# How each generator is distilled (besides `--lr 1e-3`); the suite runs k = 2.
DMD2_RECIPES = {
    1: ("--num-rollout", "90", "--dmd2-timestep-shift", "1", "--lr-decay-style", "cosine"),
    2: ("--num-rollout", "60", "--lr-decay-style", "cosine"),
}
# k-step generator vs k Euler steps of the teacher; seeds gave +0.346 / +0.344 / +0.344 (k = 1), +0.392 / +0.354 (k = 2)
MIN_GAIN_OVER_EULER = {1: 0.30, 2: 0.30}
# teacher (20 steps, CFG 4.5) minus the k-step generator; seeds gave 0.028 / 0.030 / 0.030 (k = 1), -0.020 / 0.018 (k = 2)
MAX_GAP_TO_TEACHER = {1: 0.05, 2: 0.05}
SUITE_K = 2  # the generator the suite distils; `measure` runs both
# the shipped model at its 20 steps, CFG 4.5 (`teacher_accuracies`, the table above): 0.566 on the machines of
# 2026-11-30 and 2026-12-01 alike (fixed eval noise); `measure` re-samples it
TEACHER_ACCURACY = 0.566
TEACHER_EULER_ACCURACY = {1: 0.192, 2: 0.194}  # the same teacher at 1 / 2 plain Euler steps, as recorded
SUITE_RECIPE = ("--num-rollout", "30")  # the short k = 2 run (standard tier): half the recipe's rollouts, constant lr
# the default run (nft, 40 rollouts) after minus before, measured for issue 14 after the seeded-stream change (the
# nft table above is from an earlier revision): no flags / seeds 1 / 2 / 3: accuracy +0.080 / +0.036 / +0.084 / +0.038,
# reward +0.029 / +0.025 / +0.027 / +0.022. The suite runs the no-flag seeds; the standards sit below every seed.
# Training switched off (--lr 1e-12; --lr 0 is refused at parse time) ends at the baseline exactly: both gains 0.
# With --async-rollout (`default_async`: each batch generated with the weights one update behind), measured for
# issue 19: no flags / seeds 1 / 2: accuracy +0.100 / +0.038 / +0.072, reward +0.032 / +0.023 / +0.025; the same
# standards hold (`test_the_default_run_still_learns_with_async_rollout`, marked `standard`: outside the suite).
MIN_NFT_ACCURACY_GAIN = 0.03
MIN_NFT_REWARD_GAIN = 0.015
REWARD = "eval/shapes_reward_mean"
# the shipped model as the default run samples it before any update (CFG-free, 20 ODE steps, fixed eval noise),
# measured on 2026-12-02 (`--eval-only`, dp 2: 0.420 / 0.86057); the suite's default run skips that eval
BASELINE = {ACC: 0.420, REWARD: 0.8606}

RL_RUNS = {  # what `measure` runs: the default (nft) as its standard; policy_loss short and long (no standard, see above)
    "policy_loss": ("--loss-type", "policy_loss", "--num-rollout", "20"),
    "policy_loss_long": (
        "--loss-type",
        "policy_loss",
        "--diffusion-guidance-scale",
        "1",
        "--lr",
        "5e-5",
        "--num-rollout",
        "400",
    ),
    "default": (),
    "default_async": ("--async-rollout",),  # the default run with rollout k+1 generated while k trains
}
# `race`: each loss type's recipe as the README's "The other loss types" gives it, on top of the demo's defaults (40
# rollouts of 8 prompts x 8 samples, 500 eval prompts), evaluated every RACE_EVAL_INTERVAL rollouts (0 / 20 / 40)
RACE_RECIPES = {
    "nft": (),
    "policy_loss": ("--loss-type", "policy_loss"),
    "grpo_guard": ("--loss-type", "grpo_guard", "--diffusion-noise-level", "1.2", "--diffusion-num-sde-steps", "2"),
    "flow_dppo": ("--loss-type", "flow_dppo"),
    "awm": ("--loss-type", "awm", "--awm-kl-beta", "0", "--lr", "3e-4"),  # batch reward std: awm's default
    "dpo": ("--loss-type", "dpo"),
    "dance": (
        "--loss-type",
        "policy_loss",
        "--diffusion-sde-type",
        "dance",
        "--diffusion-noise-level",
        "0.3",
        "--diffusion-num-steps",
        "16",
        "--diffusion-shared-initial-noise",
        "--diffusion-step-strategy-path",
        "examples/dance_grpo_steps.py:random_steps",
    ),
    "mixgrpo": ("--loss-type", "policy_loss", "--diffusion-num-steps", "25", "--mixgrpo-window-size", "4"),
    # DRaFT-K, CFG-free, ascending the shipped fitted latent proxy; the gold `shapes` is only logged (weight 0)
    "draft": (
        "--loss-type",
        "draft",
        "--draft-k",
        "5",
        "--diffusion-guidance-scale",
        "1.0",
        "--rm-type",
        "shapes_learned_latent,shapes:0",
        "--shapes-learned-dir",
        "builtin:fitted",
    ),
}
RACE_EVAL_INTERVAL = 20


def shapes_args(out, seed: int | None, *extra: str):
    """The flags of a learning run; seed None keeps the parser's seeds (the no-flag run's)."""
    model = ("--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes", "--dp-size", "2")
    seeds = () if seed is None else ("--seed", str(seed), "--rollout-seed", str(seed))
    quiet = ("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING")
    evals = ("--eval-num-prompts", str(EVAL_PROMPTS))
    args = parse_args([*model, *seeds, *quiet, *evals, "--output-dir", str(out), *extra])
    args.eval_interval = args.num_rollout  # before training and after the last rollout only
    return args


def eval_series(out, keys: tuple[str, ...] = (ACC,)) -> dict[str, list[float]]:
    """Each key's values over the run's evals, in order (one read of metrics.jsonl)."""
    metrics = read_metrics(out / "metrics.jsonl")
    return {key: [m[key] for m in metrics if key in m] for key in keys}


def teacher_accuracies(steps: tuple[int, ...] = (20, 1, 2)) -> dict[int, float]:
    """The shipped model sampled with its own scheduler at CFG 4.5: its usual 20 steps, or 1-2 plain Euler steps."""
    from miles.data.shapes import shapes_prompts
    from miles.models.builtin import SHIPPED_SHAPES_DIR
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.evaluation import evaluate_shapes

    engine = DiffusionEngine(SHIPPED_SHAPES_DIR)
    records = shapes_prompts(EVAL_PROMPTS, seed=0, split="eval")  # the eval split an --eval-seed 0 run scores
    return {n: evaluate_shapes(engine, records, num_steps=n, guidance_scale=4.5, seed=0)[0][ACC] for n in steps}


def dmd2_run(k: int, seed: int, out, recipe: tuple[str, ...] | None = None) -> float:
    """Accuracy of the k-step generator distilled from the shipped model (evaluated with its own k steps), with the
    flags of `recipe` (default: the generator's `DMD2_RECIPES` entry)."""
    distil = ("--loss-type", "dmd2", "--teacher-load", "builtin:tiny-shapes", "--dmd2-generator-steps", str(k))
    recipe = DMD2_RECIPES[k] if recipe is None else recipe
    # the generator before training is not scored (nothing reads it): --no-eval-before-train saves that eval
    train_diffusion.run(shapes_args(out, seed, *distil, "--lr", "1e-3", *recipe, "--no-eval-before-train"))
    return eval_series(out)[ACC][-1]


def rl_run(loss: str, seed: int | None, out, *, recorded_baseline: bool = False) -> dict[str, tuple[float, float]]:
    """Eval accuracy and eval reward, each before the first update and after the run's rollouts; with
    `recorded_baseline` the eval before training is skipped and `BASELINE` stands for it."""
    extra = ("--no-eval-before-train",) if recorded_baseline else ()
    train_diffusion.run(shapes_args(out, seed, *RL_RUNS[loss], *extra))
    series = eval_series(out, (ACC, REWARD))
    assert all(len(values) == (1 if recorded_baseline else 2) for values in series.values()), series
    return {key: (BASELINE[key] if recorded_baseline else values[0], values[-1]) for key, values in series.items()}


def dmd2_shortfalls(k: int, generator: float, teacher: dict[int, float]) -> list[str]:
    """The committed k-step standards the generator misses (teacher: accuracy by step count, 20 and k at least)."""
    shortfalls = []
    if generator < teacher[k] + MIN_GAIN_OVER_EULER[k]:
        shortfalls.append(f"less than {MIN_GAIN_OVER_EULER[k]} above {k} Euler steps ({teacher[k]:.3f})")
    if generator < teacher[20] - MAX_GAP_TO_TEACHER[k]:
        shortfalls.append(f"more than {MAX_GAP_TO_TEACHER[k]} below the teacher ({teacher[20]:.3f})")
    return shortfalls


def suite_measurements(out: Path) -> dict:
    """What the suite's two checks below read, measured in this process: the background job `suite`
    (`python tests/e2e/test_learning.py suite OUT_DIR`, started with the session: tests/background.py) runs it and
    writes OUT_DIR/results.json. The teacher's k Euler steps are sampled (4 s): the check that the eval still scores
    the shipped model as recorded. The dmd2 learning standard runs in the `standard` tier (the suite's 20 minutes
    no longer hold its 30-rollout run: the background job was the suite's critical path)."""
    return {
        "default": rl_run("default", None, out / "default", recorded_baseline=True),
        "teacher": {20: TEACHER_ACCURACY, **teacher_accuracies((SUITE_K,))},
    }


def suite_results(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text())
    results["teacher"] = {int(k): v for k, v in results["teacher"].items()}
    return results


# Reward-guided dmd2 (issue 51): the 2-step recipe with the teacher's real score at CFG 1.5 (20 steps: 0.480, 8.6
# points below CFG 4.5), plain against + 1.0 x the fitted latent proxy on the generator's output, gold all-correct
# accuracy on the 500 eval prompts after 60 rollouts, measured 2026-12-07: seeds 1 / 2 / 3 plain 0.508 / 0.482 /
# 0.512, guided 0.550 / 0.530 / 0.534 (+4.2 / +4.8 / +2.2). With the recipe's CFG 4.5 teacher the term gained nothing
# beyond the noise (docs/user-guide/reward-gradients.md). `python tests/e2e/test_learning.py dmd2_reward 1 2 3`
# re-measures both arms.
WEAKER_TEACHER = ("--dmd2-real-guidance-scale", "1.5")
REWARD_TERM = ("--dmd2-reward-weight", "1", "--rm-type", "shapes_learned_latent,shapes:0")
REWARD_TERM += ("--shapes-learned-dir", "builtin:fitted")
MIN_REWARD_GUIDED_GAIN = 0.02


def reward_guided_dmd2_runs(seed: int, out: Path) -> tuple[float, float]:
    """The 2-step generator's gold accuracy after its recipe from the CFG 1.5 teacher: plain, then reward-guided."""
    recipe = (*DMD2_RECIPES[SUITE_K], *WEAKER_TEACHER)
    plain = dmd2_run(SUITE_K, seed, out / "plain", recipe)
    return plain, dmd2_run(SUITE_K, seed, out / "guided", (*recipe, *REWARD_TERM))


@pytest.mark.timeout(1800)
@pytest.mark.standard  # two 60-rollout runs: about 5 min; run with `./scripts/test.sh -m standard`
def test_reward_guided_dmd2_beats_plain_dmd2_from_a_weaker_teacher(ray_cluster, tmp_path):
    """The reward term lifts the student above what distillation alone gives, on the gold it never sees."""
    plain, guided = reward_guided_dmd2_runs(SEED, tmp_path)
    assert guided >= plain + MIN_REWARD_GUIDED_GAIN, (plain, guided)


@pytest.mark.timeout(1800)
@pytest.mark.background("tests/e2e/test_learning.py", "suite")
def test_the_eval_still_scores_the_shipped_model_as_recorded(background_job):
    teacher, recorded = suite_results(background_job)["teacher"], TEACHER_EULER_ACCURACY[SUITE_K]
    assert abs(teacher[SUITE_K] - recorded) <= 0.01, (  # 5 of 500 prompts: another machine's kernels may flip one
        f"the teacher at {SUITE_K} Euler steps scores {teacher[SUITE_K]:.3f}, recorded {recorded}: the eval changed; "
        "re-measure TEACHER_ACCURACY and TEACHER_EULER_ACCURACY with `python tests/e2e/test_learning.py dmd2 1`"
    )


@pytest.mark.standard  # 1.6 min: run with `./scripts/test.sh -m standard`
def test_dmd2_generator_nears_its_teacher_and_beats_as_many_euler_steps(ray_cluster, tmp_path):
    """The standards after SUITE_RECIPE (30 rollouts at a constant lr): the default suite ran this until 2026-12-07."""
    teacher = {20: TEACHER_ACCURACY, **teacher_accuracies((SUITE_K,))}
    generator = dmd2_run(SUITE_K, SEED, tmp_path, SUITE_RECIPE)
    assert not dmd2_shortfalls(SUITE_K, generator, teacher), (SUITE_K, generator, teacher)


@pytest.mark.standard  # 2.4 min: run with `./scripts/test.sh -m standard`
def test_dmd2_generator_with_its_recipe_nears_its_teacher(ray_cluster, tmp_path):
    """The same standards after the 2-step generator's whole recipe (60 rollouts, cosine lr decay)."""
    teacher = teacher_accuracies((20, SUITE_K))
    generator = dmd2_run(SUITE_K, SEED, tmp_path)
    assert not dmd2_shortfalls(SUITE_K, generator, teacher), (SUITE_K, generator, teacher)


@pytest.mark.timeout(1800)
@pytest.mark.background("tests/e2e/test_learning.py", "suite")
def test_the_default_run_raises_the_accuracy_of_the_shipped_model(background_job):
    # exactly the demo (no flags, its own seeds) but for the eval before training: the recorded `BASELINE` (fixed
    # eval noise; `python tests/e2e/test_learning.py default none` samples it); `TEACHER_EULER_ACCURACY`'s check in
    # `test_the_eval_still_scores_the_shipped_model_as_recorded` is the suite's check that the eval still scores
    # the shipped model as recorded
    result = suite_results(background_job)["default"]
    assert result[ACC][1] >= result[ACC][0] + MIN_NFT_ACCURACY_GAIN, result
    assert result[REWARD][1] >= result[REWARD][0] + MIN_NFT_REWARD_GAIN, result


# DRaFT-K (`RACE_RECIPES["draft"]`: K = 5, CFG-free, the fitted latent proxy `--shapes-learned-dir builtin:fitted`)
# after 20 rollouts, gold all-correct accuracy on the 500 eval prompts, measured 2026-12-06 (issue 51): seeds 1 / 2 / 3
# 0.420 -> 0.502 / 0.484 / 0.552 (+8.2 / +6.4 / +13.2; the difference of two evals has a std of about 3.1 points)
MIN_DRAFT_GOLD_GAIN = 0.05


@pytest.mark.standard  # 20 rollouts and two evals: minutes; run with `./scripts/test.sh -m standard`
def test_draft_on_the_fitted_proxy_raises_the_gold_accuracy(ray_cluster, tmp_path):
    """The reward-gradient learning claim: ascending a learned proxy through the last 5 sampling steps raises the
    programmatic gold, which is only logged (weight 0), never trained on."""
    train_diffusion.run(shapes_args(tmp_path, SEED, *RACE_RECIPES["draft"], "--num-rollout", "20"))
    accuracy = eval_series(tmp_path)[ACC]
    assert accuracy[-1] >= accuracy[0] + MIN_DRAFT_GOLD_GAIN, accuracy


@pytest.mark.standard  # 2.2 min: run with `./scripts/test.sh -m standard` (the suite's 15 minutes hold no more)
def test_the_default_run_still_learns_with_async_rollout(ray_cluster, tmp_path):
    """The same standard with every batch generated while the previous one trains (one update stale). The suite
    checks the async path bit for bit instead (`nft_async` in tests/e2e/test_golden.py)."""
    result = rl_run("default_async", None, tmp_path)
    assert result[ACC][1] >= result[ACC][0] + MIN_NFT_ACCURACY_GAIN, result
    assert result[REWARD][1] >= result[REWARD][0] + MIN_NFT_REWARD_GAIN, result


class TreeCpu:
    """CPU seconds (user + system) of this process and all its descendants (the Ray head, raylet and workers a local
    cluster starts), sampled every `period` s on a thread: a process's last sample stands for it once it exits, so up
    to one period of each process's CPU is missed. A process alive at entry (a worker an earlier run in this process kept)
    counts from its entry sample."""

    def __init__(self, period: float = 0.5):
        import threading

        self.period = period
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> its last user + system seconds
        self.at_entry: dict[tuple[int, float], float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def sample(self) -> None:
        import psutil

        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                self.seen[(process.pid, process.create_time())] = times.user + times.system
            except psutil.Error:  # it exited between the listing and the read: its previous sample stands
                pass

    def poll(self) -> None:
        while not self.done.wait(self.period):
            self.sample()

    def __enter__(self) -> TreeCpu:
        self.sample()
        self.at_entry = dict(self.seen)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.sample()

    @property
    def seconds(self) -> float:
        return sum(seconds - self.at_entry.get(key, 0.0) for key, seconds in self.seen.items())


def race_run(name: str, seed: int | None, out) -> dict:
    """One loss type's recipe (`RACE_RECIPES`) at the demo's budget: accuracy and eval reward at each eval (before
    training and every RACE_EVAL_INTERVAL rollouts), the samples it generated, its wall and CPU seconds and the
    load average (1 min) before and after."""
    import os
    import time

    args = shapes_args(out, seed, *RACE_RECIPES[name])
    args.eval_interval = RACE_EVAL_INTERVAL
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with TreeCpu() as cpu:
        train_diffusion.run(args)
    wall = time.perf_counter() - started
    series = eval_series(out, (ACC, REWARD))
    return {
        "recipe": name,
        "seed": seed,
        "eval_rollouts": [0, *range(RACE_EVAL_INTERVAL, args.num_rollout + 1, RACE_EVAL_INTERVAL)],
        "accuracy": series[ACC],
        "reward": series[REWARD],
        "samples": args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu.seconds, 1),
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "flags": list(RACE_RECIPES[name]),
    }


def race(which: list[str], seeds: list[int | None]) -> None:
    """`python tests/e2e/test_learning.py race grpo_guard,dance 1 2 3`: one JSON line per recipe and seed, one run
    at a time (`all`: every recipe)."""
    import json
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="miles-race-"))
    names = list(RACE_RECIPES) if which == ["all"] else which
    unknown = sorted(set(names) - set(RACE_RECIPES))
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}: the race knows {', '.join(RACE_RECIPES)}")
    for seed in seeds:
        for name in names:
            print(json.dumps(race_run(name, seed, root / f"{name}_{seed}")), flush=True)


def measure(which: list[str], seeds: list[int | None]) -> None:
    """Re-measure: prints one line per run and seed."""
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="miles-standards-"))
    if "dmd2" in which:
        teacher = teacher_accuracies()
        recorded = {20: TEACHER_ACCURACY, **TEACHER_EULER_ACCURACY}
        print("teacher (steps: accuracy)", teacher, "recorded", recorded, flush=True)
    for seed in seeds:
        for name in which:
            if name == "dmd2_reward":
                plain, guided = reward_guided_dmd2_runs(seed, root / f"dmd2_reward_{seed}")
                print(f"dmd2 from the CFG 1.5 teacher, seed {seed}: plain {plain:.3f}, reward-guided {guided:.3f}")
            elif name == "dmd2":
                for k in (1, 2):
                    generator = dmd2_run(k, seed, root / f"dmd2_{k}_{seed}")
                    verdict = "; ".join(dmd2_shortfalls(k, generator, teacher)) or "meets the standards"
                    print(f"dmd2 k={k} seed {seed}: {generator:.3f} ({verdict})", flush=True)
            else:
                result = rl_run(name, seed, root / f"{name}_{seed}")
                print(
                    f"{name} seed {seed}:", *(f"{key} {a:.3f} -> {b:.3f}" for key, (a, b) in result.items()), flush=True
                )


if __name__ == "__main__":
    if sys.argv[1] == "suite":  # the suite's background job (tests/background.py)
        folder = Path(sys.argv[2])
        (folder / "results.json").write_text(json.dumps(suite_measurements(folder)))
    elif sys.argv[1] == "race":
        race(sys.argv[2].split(","), [None if s == "none" else int(s) for s in sys.argv[3:]])
    else:
        measure(sys.argv[1].split(","), [None if s == "none" else int(s) for s in sys.argv[2:]])  # none: the parser's
