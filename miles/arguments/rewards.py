"""Flags of the rewards and advantages (built-in, custom and remote rewards, the VLM judge, the advantages'
normalisation) and their rules."""

from __future__ import annotations

import argparse

from miles.algorithms import BUILTIN_ALGORITHMS, Algorithm
from miles.arguments.flag_readers import ByReward, ReadBy
from miles.arguments.reward_spec import (
    SHAPES_LEARNED_FILES,
    differentiable_reward_problems,
    remote_rules,
    reward_model_problems,
    reward_spec_from_args,
    runs_rewards,
    shapes_learned_problems,
)


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rewards and advantages")
    group.add_argument(
        "--rm-type",
        default=None,
        help="Reward or weighted list name:w,... (default shapes, moving_shapes on builtin:moving-shapes, "
        "temporal_consistency for a video family, shapes_learned,shapes:0 under refl, draft, direct_align; custom "
        "with --custom-rm-path).",
    )
    group.add_argument("--custom-rm-path", default=None, help="Batched [async] def rm(args, samples) -> list[float].")
    group.add_argument("--rm-num-workers", type=int, default=0, help="Reward worker actors (0: in the driver).")
    add_remote_reward_arguments(parser)
    group.add_argument(
        "--generate-chunk-size",
        type=int,
        default=0,
        help="Generate each rollout N samples at a time and score each chunk while the next generates (0: the whole "
        "batch, then scoring). Worth it when rewards are slow; the engines' batch is N (results then agree with an "
        "unchunked run to float rounding, not bit for bit).",
    )
    group.add_argument("--clip-model-path", default=None, help="Local CLIP folder for clip_score.")
    group.add_argument("--pickscore-model-path", default=None, help="Local PickScore folder for pickscore.")
    ReadBy(group, ByReward(tuple(SHAPES_LEARNED_FILES))).add_argument(
        "--shapes-learned-dir",
        default=None,
        help="shapes_learned, shapes_learned_latent: the folder of their weights (what scripts/"
        "train_shapes_reward.py --out-dir writes; default: the shipped miles/assets/shapes_reward), or builtin:fitted "
        "(shipped: the proxies fitted also to the model's own CFG-free samples, labelled by the gold).",
    )
    group.add_argument(
        "--ocr-num-threads",
        type=int,
        default=1,
        help="onnxruntime threads of the ocr reward's models in each reward process (0: onnxruntime's default, one "
        "per core; spread a large batch with --rm-num-workers instead).",
    )
    add_advantage_arguments(group)


def add_advantage_arguments(group: argparse._ArgumentGroup) -> None:
    """How rewards become advantages: the std the group normalisation divides by, per-reward normalisation, the
    clamp, a custom post-process."""
    batch_std = ", ".join(a.name for a in BUILTIN_ALGORITHMS if a.globalize_reward_std)
    group.add_argument(
        "--globalize-reward-std",
        action="store_true",
        default=None,  # unset: the algorithm's default (`Algorithm.globalize_reward_std`, filled by derive_args)
        help=f"Normalise by the batch-wide reward std instead of each group's (the default under {batch_std}).",
    )
    group.add_argument(
        "--no-globalize-reward-std",
        dest="globalize_reward_std",
        action="store_false",
        default=None,
        help=f"Normalise by each group's reward std (the default except under {batch_std}).",
    )
    group.add_argument(
        "--disable-grpo-std-normalization", action="store_true", help="Advantages are reward minus group mean."
    )
    group.add_argument(
        "--per-reward-group-norm",
        action="store_true",
        help="Several rewards: normalise each within its prompt group (GRPO) before weighting, A = sum_k w_k A_k, so "
        "a reward with a large scale does not drown the others (docs/user-guide/rewards.md).",
    )
    group.add_argument("--diffusion-adv-clip-max", type=float, default=5.0, help="Clamp advantages to ± this.")
    group.add_argument(
        "--custom-reward-post-process-path", default=None, help="fn(args, samples, rewards) -> advantages."
    )


def add_remote_reward_arguments(parser: argparse.ArgumentParser) -> None:
    """Rewards scored by another process: reward servers (`python -m miles.reward_server`) and the VLM judge
    (docs/user-guide/reward-server.md)."""
    group = parser.add_argument_group("remote rewards (reward servers, VLM judge)")
    group.add_argument(
        "--rm-url",
        action="append",
        default=None,
        help="A reward server (python -m miles.reward_server) scored as reward remote<K> for the K-th flag; "
        "repeatable. Under --rm-type vlm_judge: the judge's OpenAI-compatible base URL (http://host:port/v1).",
    )
    group.add_argument(
        "--rm-url-weight",
        type=float,
        action="append",
        default=None,
        help="Weight of the K-th --rm-url's reward in the total (one per --rm-url; default 1 each).",
    )
    group.add_argument(
        "--rm-timeout",
        type=float,
        default=120.0,
        help="Seconds one HTTP request may take in all, from connecting to the answer's last byte (a server that "
        "drips its answer is cut off there); then it is retried (--rm-retries).",
    )
    group.add_argument(
        "--rm-retries",
        type=int,
        default=2,
        help="Retries of a failed request (refused connection, timeout, 408/429/5xx, malformed answer) before "
        "the run fails naming the URL and the rollout; other 4xx answers are not retried.",
    )
    group.add_argument(
        "--rm-retry-backoff",
        type=float,
        default=1.0,
        help="Seconds before the first retry, doubling each retry (at most 30).",
    )
    group.add_argument(
        "--rm-token-env",
        default=None,
        help="Environment variable holding a bearer token sent as 'Authorization: Bearer ...' (not the token).",
    )
    group.add_argument("--rm-batch-size", type=int, default=16, help="Samples per request to a reward server.")
    group.add_argument(
        "--rm-max-concurrency", type=int, default=8, help="Requests in flight per remote reward at a time."
    )
    group.add_argument("--rm-model", default=None, help="vlm_judge: the model name the judge's server serves.")
    add_vlm_judge_arguments(group)


def add_vlm_judge_arguments(group: argparse._ArgumentGroup) -> None:
    """The VLM judge's own flags (--rm-type vlm_judge), in the remote rewards' group."""
    judge = ReadBy(group, ByReward(("vlm_judge",)))
    judge.add_argument(
        "--vlm-judge-prompt-file",
        default=None,
        help="vlm_judge: prompt template, {prompt} replaced by the sample's prompt (default: "
        "miles/assets/vlm_judge_prompt.txt, asking for 'Score: N' out of 10).",
    )
    judge.add_argument(
        "--vlm-judge-max-score",
        type=float,
        default=10.0,
        help="vlm_judge: the top of the judge's scale; reward = score / it.",
    )
    judge.add_argument(
        "--vlm-judge-unparsable",
        choices=["error", "default"],
        default="error",
        help="vlm_judge: an answer without a score in [0, max] fails the run, or scores --vlm-judge-default-score "
        "(counted in rollout/vlm_judge_unparsable_frac, the first such answer of a rollout logged).",
    )
    group.add_argument(
        "--vlm-judge-max-unparsable-frac",
        type=float,
        default=0.25,
        help="vlm_judge with --vlm-judge-unparsable default: the run fails when more than this fraction of a "
        "rollout's answers have no score (a judge that never scores would train on the default alone; 1: never).",
    )
    judge.add_argument(
        "--vlm-judge-default-score", type=float, default=0.0, help="vlm_judge: the reward of an unparsable answer."
    )
    judge.add_argument("--vlm-judge-frames", type=int, default=4, help="vlm_judge: key frames sent per video sample.")
    judge.add_argument("--vlm-judge-max-tokens", type=int, default=64, help="vlm_judge: max_tokens of each answer.")


def reward_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The rules of the reward flags: remote rewards, a reward that cannot run (refused before any model loads),
    groups of one sample under a loss that trains on group advantages, and --per-reward-group-norm where nothing
    would read it."""
    errors = remote_rules(args)
    gradient = algorithm.differentiable_reward(args)  # the trainer scores the reward with gradient
    if runs_rewards(args, algorithm.scores_rewards) or gradient:  # a reward that cannot run is refused before loads
        try:
            spec = reward_spec_from_args(args)
            errors += reward_model_problems(args, spec) + shapes_learned_problems(args, spec)
            if gradient:
                errors += differentiable_reward_problems(args, spec)
        except ValueError as exc:
            errors.append(str(exc))
    if algorithm.group_advantages and runs_rewards(args, True) and not args.custom_reward_post_process_path:
        errors += group_advantage_problems(args, algorithm)
    if args.per_reward_group_norm and (args.custom_reward_post_process_path or not algorithm.scores_rewards):
        why = (
            "--custom-reward-post-process-path computes the advantages instead"
            if args.custom_reward_post_process_path
            else f"--loss-type {algorithm.name} computes no advantages from rewards"
        )
        errors.append(f"--per-reward-group-norm would be ignored: {why}")
    return errors


def group_advantage_problems(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """What would make every GRPO advantage 0, so that nothing trains: groups of one sample, or rewards that all
    weigh 0 (--rm-type shapes:0 logs a reward without training on it; alone it leaves nothing to train on)."""
    errors = []
    if args.n_samples_per_prompt == 1:
        errors.append(
            f"--n-samples-per-prompt 1: --loss-type {algorithm.name} trains on each sample's reward against the "
            "others of its prompt group, and a group of one has none (every advantage would be 0 and nothing "
            "would train): use --n-samples-per-prompt 2 or more, or --custom-reward-post-process-path"
        )
    try:
        spec = reward_spec_from_args(args)
    except ValueError:
        return errors  # reward_rules names a bad spec
    if spec and all(weight == 0 for _, weight in spec):
        errors.append(
            f"--rm-type {args.rm_type}: every reward weighs 0, so every advantage would be 0 and --loss-type "
            f"{algorithm.name} would train nothing: give the reward to train on a weight above 0"
        )
    return errors
