"""How much of one update's gradient is signal: Flow-GRPO (`policy_loss`) against DiffusionNFT (`nft`), side by side.

Each repeat draws a fresh rollout (new prompts, new noise) from the same weights, scores it, computes GRPO
advantages and takes the gradient of the loss at those weights through the trainer's own loss hooks, as the first
window of a train step sees it: the ratio is 1 for policy_loss, and nft's old policy is the current one. Every
coordinate is divided by its RMS over the repeats (what Adam divides by), and the mean cosine between two repeats'
gradients estimates the share of signal in one update: with g_r = g + n_r, E[cos] ≈ |g|² / (|g|² + E|n_r|²). An
update is half signal at about N·(1 − c)/c samples (N per rollout, c the agreement). Both losses see the same
prompts, rewards and advantages' recipe; the rollout of policy_loss samples its SDE window, the one of nft the ODE.

    python benchmarks/bench_gradient_signal.py                       # shipped shapes model, CFG-free, 8 x 8
    python benchmarks/bench_gradient_signal.py --reward brightness   # a smooth reward, for contrast
    python benchmarks/bench_gradient_signal.py --guidance-scale 4.5 --losses policy_loss

Measured on a 2-core CPU (shipped model, 8 prompts x 8 samples, 10 steps, 32 repeats, 1-2 min per loss), the
agreement ± its standard error:

| reward, CFG (rollouts and training) | policy_loss | nft | nft / policy_loss |
|---|---|---|---|
| shapes, CFG-free | 0.0025 ± 0.0032 | 0.032 ± 0.008 | 12.8 |
| shapes, CFG 4.5 | -0.0001 ± 0.0022 | 0.0004 ± 0.0056 | |
| brightness, CFG-free | 0.092 ± 0.016 | 0.285 ± 0.010 | 3.1 |

The policy-gradient estimator works (the smooth brightness reward gets a clear signal), but on the shapes reward a
policy_loss update of 64 samples is noise: half signal would take ~26 000 samples, over ten times what nft needs
(~2 000, less than its 40-rollout standard run sees in all). With CFG 4.5, the default run's setting, neither loss
shows a signal: a group's samples differ less (reward spread 0.034 against 0.055) and not in ways the gradient can
use.
policy_loss on the shapes reward stayed below 0.012 whatever else was varied (the same statistic, 16-32 repeats
each, CFG-free unless said): CFG 4.5; a one-step window at step 0, 1, 2, 3, 4, 6 or 8; one start latent per prompt
with a one-step window among the first three; the `cps` kernel at noise level 0.5 and 0.7; four- and ten-times
softer shape and position scores. Cruder checks (6 repeats, CFG 4.5; raw cosines) of noise level 1.0, every step
trained, no std normalisation and the strict all-correct reward showed nothing beyond their noise either. Our
reading: a sample's correctness turns on a few latent directions that the 1024-dimensional noise of a few SDE steps
rarely moves, while nft regresses on whole clean samples.
Training agrees: 150 CFG-free policy_loss rollouts (9 600 samples, lr 1e-4 or 5e-5) left accuracy at 0.404 / 0.410
(from 0.420), where 40 nft rollouts (2 560 samples) gain 8-12 points; only after 300 rollouts at lr 5e-5 (19 200
samples, 16 min) did policy_loss gain, 6.2 / 5.8 / 8.2 points in three seeds (tests/e2e/test_learning.py).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from miles.arguments.parser import parse_args as parse_train_args  # noqa: E402
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS  # noqa: E402
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics  # noqa: E402
from miles.data.shapes import shapes_prompts  # noqa: E402
from miles.models.builtin import resolve_checkpoint  # noqa: E402
from miles.rollout.advantages import compute_grpo_advantages  # noqa: E402
from miles.rollout.engine import DiffusionEngine  # noqa: E402
from miles.rollout.engine_api import GenerateRequest  # noqa: E402
from miles.rollout.rm_hub.shapes import shapes_reward  # noqa: E402
from miles.rollout.rollout_hub.nft import nft_pairs  # noqa: E402
from miles.rollout.rollout_hub.pairs import sde_pairs  # noqa: E402
from miles.rollout.step_strategy_hub import window_steps  # noqa: E402
from miles.utils.types import shard_pairs  # noqa: E402

logger = logging.getLogger("bench_gradient_signal")
LOSSES = ("policy_loss", "nft")
REWARDS = ("shapes", "brightness")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-checkpoint", default="builtin:tiny-shapes")
    parser.add_argument("--losses", default="policy_loss,nft", help="Comma-separated, from: " + ", ".join(LOSSES))
    parser.add_argument("--reward", choices=REWARDS, default="shapes", help="brightness: mean pixel value.")
    parser.add_argument("--prompts", type=int, default=8, help="Prompt groups per rollout.")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=32, help="Independent rollouts (gradients) per loss.")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="Rollouts and training, both losses.")
    parser.add_argument("--num-sde-steps", type=int, default=3, help="policy_loss's window (placed at random).")
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--sde-type", choices=("sde", "cps"), default="sde")
    parser.add_argument("--nft-timestep-fraction", type=float, default=0.6)
    parser.add_argument("--nft-beta", type=float, default=1.0)
    parser.add_argument("--adv-clip-max", type=float, default=5.0)
    parser.add_argument("--micro-batch-size", type=int, default=64, help="Pairs per backward.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.losses = [name.strip() for name in args.losses.split(",") if name.strip()]
    unknown = sorted(set(args.losses) - set(LOSSES))
    if unknown or not args.losses:
        parser.error(f"--losses: unknown {unknown or 'none given'}; valid: {', '.join(LOSSES)}")
    if args.repeats < 2:
        parser.error("--repeats must be >= 2: the agreement compares pairs of gradients")
    if args.samples_per_prompt < 2:
        parser.error("--samples-per-prompt must be >= 2: GRPO advantages need a group")
    if args.prompts < 1:
        parser.error("--prompts must be >= 1")
    if not 1 <= args.num_sde_steps <= args.num_steps - 1:
        parser.error(
            f"--num-sde-steps must lie in [1, --num-steps - 1 = {args.num_steps - 1}] (the last step is never trained)"
        )
    return args


def agreement(grads: torch.Tensor) -> tuple[float, float]:
    """Mean pairwise cosine of R gradients (R, P) after dividing each coordinate by its RMS over the R, and its
    jackknife standard error over the repeats."""
    if grads.ndim != 2 or grads.shape[0] < 2:
        raise ValueError(f"agreement needs a (R >= 2, P) matrix of gradients, got shape {tuple(grads.shape)}")
    grads = grads.double()
    scaled = grads / grads.pow(2).mean(dim=0).sqrt().clamp_min(1e-300)
    unit = scaled / scaled.norm(dim=1, keepdim=True).clamp_min(1e-300)
    cos = unit @ unit.T
    repeats = cos.shape[0]
    rows = cos.sum(dim=1) - cos.diagonal()  # each repeat's cosines with the others
    total = rows.sum()  # every off-diagonal entry, each pair twice
    mean = float(total / (repeats * (repeats - 1)))
    if repeats < 3:
        return mean, math.nan
    leave_out = (total - 2 * rows) / ((repeats - 1) * (repeats - 2))  # the mean without repeat r
    return mean, float(((repeats - 1) / repeats * (leave_out - leave_out.mean()).pow(2).sum()).sqrt())


def samples_for_half_signal(agree: float, samples: int) -> float:
    """Samples per update at which signal and noise weigh the same (inf when no signal was measured)."""
    return samples * (1 - agree) / agree if agree > 0 else math.inf


def score(args: argparse.Namespace, images: np.ndarray, records: list[dict]) -> torch.Tensor:
    if args.reward == "brightness":
        return torch.tensor([float(image.astype(np.float32).mean() / 255.0) for image in images])
    return torch.tensor([s.reward for s in shapes_reward(list(images), [r["metadata"] for r in records])])


def rollout(engine: DiffusionEngine, args: argparse.Namespace, loss: str, repeat: int, pool: list[dict]):
    """One rollout of `loss` (fresh prompts and noise per repeat), its train pairs, and the group reward std."""
    rng = np.random.default_rng([args.seed, repeat])
    groups = [pool[i] for i in rng.choice(len(pool), args.prompts, replace=False)]
    records = [g for g in groups for _ in range(args.samples_per_prompt)]
    seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=len(records))]
    nft = loss == "nft"
    steps = (
        []
        if nft
        else window_steps(args.num_steps, args.num_sde_steps, 0, args.num_steps - 1, seed=args.seed, rollout_id=repeat)
    )
    request = GenerateRequest(
        prompts=[r["prompt"] for r in records],
        seeds=seeds,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        negative_prompt="",
        sde_type="ode" if nft else args.sde_type,
        noise_level=args.noise_level,
        trained_steps=steps,
    )
    result = engine.generate(request)
    rewards = score(args, result.images, records)
    advantages = compute_grpo_advantages(rewards, args.samples_per_prompt)
    if nft:
        nft_args = argparse.Namespace(
            diffusion_nft_timestep_fraction=args.nft_timestep_fraction, rollout_seed=args.seed
        )
        pairs = nft_pairs(nft_args, [], result, advantages, rollout_id=repeat)
    else:
        pairs = sde_pairs(args, [], result, advantages, rollout_id=repeat)
    spread = float(rewards.reshape(args.prompts, -1).std(dim=1, unbiased=False).mean())
    return pairs, spread


def train_context(engine: DiffusionEngine, args: argparse.Namespace, loss: str, repeat: int) -> DiffusionLossContext:
    """What the trainer's hooks see for this loss, with the benchmark's settings as trainer flags."""
    own = {  # each loss's own flags: a flag the run would not read is refused
        "nft": ["--diffusion-nft-guidance-scale", str(args.guidance_scale), "--diffusion-nft-beta", str(args.nft_beta)],
        "policy_loss": ["--diffusion-sde-type", args.sde_type, "--diffusion-noise-level", str(args.noise_level)],
    }[loss]
    train_args = parse_train_args(
        [
            "--loss-type",
            loss,
            "--diffusion-guidance-scale",
            str(args.guidance_scale),
            *own,
            "--diffusion-adv-clip-max",
            str(args.adv_clip_max),
            "--seed",
            str(args.seed),
        ]
    )
    return DiffusionLossContext(
        args=train_args,
        role="actor",
        rollout_id=repeat,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=engine.family,
        networks={"actor": engine.transformer},
    )


def gradient(engine: DiffusionEngine, args: argparse.Namespace, loss: str, pairs: dict, repeat: int) -> torch.Tensor:
    """d(mean per-pair loss)/dθ over the whole rollout, flattened: the trainer's own prepare and formula hooks, as
    in a train step's first window (policy_loss's old log-probs taken from this forward, so the ratio is 1)."""
    hooks = LOSS_HOOKS[(loss, "actor")]
    ctx = train_context(engine, args, loss, repeat)
    params = [p for p in engine.transformer.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    pairs = shard_pairs(pairs, 1)[0]  # one rank: the pairs with their pair_index, as the trainer receives them
    total = len(next(iter(pairs.values())))
    with torch.enable_grad():
        for microbatch_id, start in enumerate(range(0, total, args.micro_batch_size)):
            batch = {key: value[start : start + args.micro_batch_size] for key, value in pairs.items()}
            prepared = hooks.prepare(ctx, batch, microbatch_id=microbatch_id, optim_step_idx=0, pad_to_len=None)
            new_pred = engine.family.predict_velocity(
                engine.transformer,
                prepared.latents,
                prepared.sigmas,
                prepared.embeds,
                guidance_scale=prepared.guidance_scale,
                negative=prepared.negative,
            )
            # The only frozen network these hooks name here is nft's old policy, which is the current weights.
            frozen_preds = {name: new_pred.detach() for name in prepared.frozen_networks}
            loss_sum = hooks.formula(
                ctx,
                batch,
                prepared,
                new_pred=new_pred,
                frozen_preds=frozen_preds,
                metrics=WindowMetrics(),
                optim_step_idx=0,
                train_output_inputs=[],
                old_log_prob_from_new=True,
            )
            (loss_sum / total).backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def measure(engine: DiffusionEngine, args: argparse.Namespace, loss: str, pool: list[dict]) -> dict[str, float]:
    """The loss's gradient agreement over `args.repeats` rollouts."""
    start = time.perf_counter()
    grads, spreads = [], []
    for repeat in range(args.repeats):
        pairs, spread = rollout(engine, args, loss, repeat, pool)
        grads.append(gradient(engine, args, loss, pairs, repeat))
        spreads.append(spread)
        logger.info("%s: repeat %d/%d", loss, repeat + 1, args.repeats)
    agree, stderr = agreement(torch.stack(grads))
    return {
        "agreement": agree,
        "stderr": stderr,
        "reward_spread": float(np.mean(spreads)),
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    engine = DiffusionEngine(resolve_checkpoint(args.hf_checkpoint))
    engine.transformer.requires_grad_(True)
    pool = shapes_prompts(2048, seed=args.seed, split="train")
    samples = args.prompts * args.samples_per_prompt
    results = {loss: measure(engine, args, loss, pool) for loss in args.losses}
    logger.info(
        "checkpoint %s | reward %s, CFG %.1f | %d prompts x %d samples, %d steps, %d repeats",
        args.hf_checkpoint,
        args.reward,
        args.guidance_scale,
        args.prompts,
        args.samples_per_prompt,
        args.num_steps,
        args.repeats,
    )
    logger.info(
        "%-12s %10s %8s %14s %20s %8s", "loss", "agreement", "± s.e.", "reward spread", "samples/half signal", "s"
    )
    for loss, r in results.items():
        half = samples_for_half_signal(r["agreement"], samples)
        logger.info(
            "%-12s %10.4f %8.4f %14.4f %20s %8.0f",
            loss,
            r["agreement"],
            r["stderr"],
            r["reward_spread"],
            "no signal" if math.isinf(half) else f"{half:.0f}",
            r["seconds"],
        )
    for a, b in itertools.combinations(results, 2):
        silent = [name for name in (a, b) if results[name]["agreement"] <= 0]
        if silent:
            logger.info("%s / %s agreement: no signal measured for %s", b, a, " and ".join(silent))
        else:
            logger.info("%s / %s agreement: %.1f", b, a, results[b]["agreement"] / results[a]["agreement"])
    return results


if __name__ == "__main__":
    main()
