"""The `--rm-type` grammar (`name` or `name:weight,...`) and its consistency with `--custom-rm-path`.

It lives here, not in `rollout/rm_hub/`, so that argument validation checks a spec without importing the rollout
side; `rollout/rm_hub` maps the same names to the reward functions (a test keeps the two lists equal).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from miles.algorithms import ALGORITHMS
from miles.models.builtin import makes_video
from miles.models.shapes_reward.weights import IMAGE, LATENT, WEIGHT_FILES, weights_dir
from miles.utils.misc import HookLoadError, load_function

BUILTIN_MOVING_SHAPES = "builtin:moving-shapes"  # miles.data.moving_shapes's (no data modules here)
CUSTOM = "custom"  # the reward loaded from --custom-rm-path
BUILTIN_REWARDS: tuple[str, ...] = (
    "shapes",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "clip_score",
    "pickscore",
    "ocr",
    "temporal_consistency",
    "motion_direction",
    "vlm_judge",
    "edit_preservation",
    "moving_shapes",
    "shapes_strict",
    "moving_shapes_strict",
    "shapes_learned",
    "shapes_learned_latent",
)
REMOTE = "remote"  # remote<K>: the reward server of the K-th --rm-url (not a --rm-type name)
JUDGE = "vlm_judge"  # takes --rm-url as its chat-completions endpoint instead of a reward server

# Rewards whose model comes from an optional extra: (the module they import, how to install it).
REWARD_PACKAGES: dict[str, tuple[str, str]] = {"ocr": ("rapidocr_onnxruntime", "pip install miles[ocr]")}
# Rewards whose model loads from a local folder a flag names (nothing is downloaded).
REWARD_MODEL_FLAGS: dict[str, str] = {"clip_score": "clip_model_path", "pickscore": "pickscore_model_path"}
# The built-ins that score video (sample.frames); vlm_judge scores either; the others score images (sample.image).
VIDEO_REWARDS: tuple[str, ...] = ("temporal_consistency", "motion_direction", "moving_shapes", "moving_shapes_strict")
EITHER_MEDIA: tuple[str, ...] = (JUDGE,)
SOURCE_IMAGE_REWARDS: tuple[str, ...] = ("edit_preservation",)  # compare each result with its source image
# The built-ins that are differentiable functions of what they score, and what that is: "image" (pixels in [0, 1])
# or "latent" (a checkpoint's normalised latents). Their functions carry the torch scorer as a `differentiable`
# attribute (`miles.models.shapes_reward.differentiable.DifferentiableReward`; a test keeps the two equal); a reward-gradient algorithm
# refuses a reward that is not here and whose function has no such attribute.
DIFFERENTIABLE_REWARDS: dict[str, str] = {"shapes_learned": "image", "shapes_learned_latent": "latent"}
# The learned shapes rewards' weight files, in miles/assets/shapes_reward/ or the folder --shapes-learned-dir names.
SHAPES_LEARNED_FILES: dict[str, str] = {
    "shapes_learned": WEIGHT_FILES[IMAGE],
    "shapes_learned_latent": WEIGHT_FILES[LATENT],
}


DIFFERENTIABLE_DEFAULT = "shapes_learned,shapes:0"  # a reward-gradient loss's default on an image family


def valid_reward_names() -> str:
    return ", ".join([*BUILTIN_REWARDS, CUSTOM])


def parse_reward_spec(text: str) -> list[tuple[str, float]]:
    """'shapes' -> [('shapes', 1.0)]; 'shapes:1.0,jpeg_compressibility:0.1' -> both, weighted. Weights are finite
    floats (negative and zero allowed: a zero-weight reward is still computed and logged)."""
    if not text or not text.strip():
        raise ValueError(f"--rm-type is empty; give a reward name or name:weight list from: {valid_reward_names()}")
    spec: list[tuple[str, float]] = []
    for item in text.split(","):
        name, sep, weight_text = item.strip().partition(":")
        name = name.strip()
        if name not in BUILTIN_REWARDS and name != CUSTOM:
            raise ValueError(f"--rm-type {text!r}: unknown reward {name!r}; valid rewards: {valid_reward_names()}")
        weight = 1.0
        if sep:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = math.nan
            if not math.isfinite(weight):
                raise ValueError(
                    f"--rm-type {text!r}: weight {weight_text.strip()!r} of {name!r} is not a finite number"
                )
        if name in dict(spec):
            raise ValueError(f"--rm-type {text!r}: reward {name!r} is listed twice")
        spec.append((name, weight))
    return spec


def server_urls(args: argparse.Namespace) -> list[str]:
    """The --rm-url values that are reward servers: all of them, unless --rm-type has vlm_judge (its endpoint)."""
    urls = list(args.rm_url or [])
    text = args.rm_type or ""
    return [] if JUDGE in [item.partition(":")[0].strip() for item in text.split(",")] else urls


def remote_url(args: argparse.Namespace, name: str) -> str | None:
    """The URL of spec entry `name` when it is a reward server's (`remote<K>`), else None."""
    if not name.startswith(REMOTE) or not name[len(REMOTE) :].isdigit():
        return None
    urls = server_urls(args)
    index = int(name[len(REMOTE) :])
    return urls[index] if index < len(urls) else None


def remote_rules(args: argparse.Namespace) -> list[str]:
    """--rm-url and its companions: URLs, one weight per reward server, vlm_judge's endpoint and model."""
    errors: list[str] = []
    urls = list(args.rm_url or [])
    for url in urls:
        if not url.startswith(("http://", "https://")):
            errors.append(f"--rm-url {url!r} must start with http:// or https://")
    weights = list(args.rm_url_weight or [])
    judged = JUDGE in [name for name, _ in _given_spec(args)]
    if judged:
        if len(urls) != 1:
            errors.append(
                f"--rm-type vlm_judge needs exactly one --rm-url, the judge's OpenAI-compatible base URL "
                f"(http://host:port/v1), got {len(urls)}; serve other rewards from the same process or weight them in"
            )
        if not args.rm_model:
            errors.append("--rm-type vlm_judge needs --rm-model, the model name the judge's server serves")
        if weights:
            errors.append("--rm-url-weight weights reward servers; under --rm-type vlm_judge weight it there instead")
    else:
        if args.rm_model:
            errors.append("--rm-model names the VLM judge's model; it needs --rm-type vlm_judge")
        if weights and len(weights) != len(urls):
            errors.append(f"--rm-url-weight: {len(weights)} weights for {len(urls)} --rm-url; give one per --rm-url")
        for weight in weights:
            if not math.isfinite(weight):
                errors.append(f"--rm-url-weight {weight} is not a finite number")
    token_env = args.rm_token_env
    if token_env and not os.environ.get(token_env):
        errors.append(f"--rm-token-env {token_env}: the environment variable {token_env} is not set or empty")
    prompt_file = args.vlm_judge_prompt_file
    if judged and prompt_file and not os.path.isfile(prompt_file):
        errors.append(f"--vlm-judge-prompt-file {prompt_file}: file not found")
    return errors


def runs_rewards(args: argparse.Namespace, scores_rewards: bool) -> bool:
    """Whether the run scores rewards: its algorithm does (`scores_rewards`, its declaration), or it was given one
    to log; never with --train-only (no rollouts)."""
    asked = args.rm_type or args.custom_rm_path or args.rm_url
    return not args.train_only and bool(scores_rewards or asked)


def reward_model_problems(args: argparse.Namespace, spec: list[tuple[str, float]]) -> list[str]:
    """Each reward of `spec` whose model folder flag is unset or names no folder (found before any model loads)."""
    errors = []
    for name, _ in spec:
        dest = REWARD_MODEL_FLAGS.get(name)
        if dest is None:
            continue
        flag, path = "--" + dest.replace("_", "-"), getattr(args, dest, None)
        if not path:
            errors.append(f"--rm-type {name} needs {flag} DIR, a local folder with its model and processor")
        elif not os.path.isdir(path):
            errors.append(f"{flag} {path}: no such folder (--rm-type {name} loads its model from it)")
        elif not os.path.isfile(os.path.join(path, "config.json")):
            errors.append(f"{flag} {path}: no config.json in it (--rm-type {name} loads a transformers CLIP folder)")
    return errors


def shapes_learned_problems(args: argparse.Namespace, spec: list[tuple[str, float]]) -> list[str]:
    """--shapes-learned-dir without the weight file a learned shapes reward of `spec` loads from it."""
    folder = args.shapes_learned_dir
    if not folder:
        return []
    try:
        path = weights_dir(folder)
    except ValueError as error:
        return [str(error)]
    return [
        f"--shapes-learned-dir {folder}: no {SHAPES_LEARNED_FILES[name]} in it (--rm-type {name} loads it; "
        f"python scripts/train_shapes_reward.py --out-dir {folder} writes it)"
        for name, _ in spec
        if name in SHAPES_LEARNED_FILES and not os.path.isfile(os.path.join(path, SHAPES_LEARNED_FILES[name]))
    ]


def differentiable_reward_problems(args: argparse.Namespace, spec: list[tuple[str, float]]) -> list[str]:
    """Each weighted reward of `spec` a reward-gradient loss (--loss-type `args.loss_type`) cannot back-propagate: a
    built-in outside DIFFERENTIABLE_REWARDS, a reward server, or a --custom-rm-path function without a
    `DifferentiableReward` as its `differentiable` attribute. Zero-weight rewards are only logged (e.g. a gold)."""
    errors = []
    for name, weight in spec:
        if weight == 0 or name in DIFFERENTIABLE_REWARDS:
            continue
        if name == CUSTOM and args.custom_rm_path and _custom_is_differentiable(args.custom_rm_path):
            continue
        what = (
            f"--custom-rm-path {args.custom_rm_path} has no `differentiable` attribute"
            if name == CUSTOM
            else (f"{name} is known by its values only")
        )
        errors.append(
            f"--loss-type {args.loss_type} back-propagates the reward in the trainer, and --rm-type {name}:{weight:g} "
            f"is not differentiable ({what}): use {', '.join(DIFFERENTIABLE_REWARDS)} or a custom reward declaring a "
            "DifferentiableReward (docs/user-guide/rewards.md); a reward only to log takes weight 0"
        )
    return errors


def _custom_is_differentiable(path: str) -> bool:
    # here: the record's module imports torch, which a spec check without a custom reward never needs
    from miles.models.shapes_reward.differentiable import differentiable_of

    try:
        return differentiable_of(load_function(path)) is not None
    except HookLoadError:
        return True  # the custom reward's own check names the loading problem


def reward_media_problems(spec: list[tuple[str, float]], *, family: str, video: bool, source_images: bool) -> list[str]:
    """Each built-in reward of `spec` that cannot score what `family` makes: a video reward on images, an image
    reward on video, a source-image reward without source images."""
    errors = []
    image_rewards = [n for n in BUILTIN_REWARDS if n not in VIDEO_REWARDS and n not in EITHER_MEDIA]
    for name, _ in spec:
        if name in VIDEO_REWARDS and not video:
            errors.append(
                f"--rm-type {name} scores video (sample.frames), and {family} makes images: use an image reward "
                f"({', '.join(image_rewards)}), or a video family (e.g. --hf-checkpoint builtin:tiny-moving-shapes)"
            )
        elif name in image_rewards and video:
            errors.append(
                f"--rm-type {name} scores images (sample.image), and {family} makes video: use a video reward "
                f"({', '.join(VIDEO_REWARDS)}), vlm_judge, or a --custom-rm-path reward that reads sample.frames"
            )
        if name in SOURCE_IMAGE_REWARDS and not source_images:
            errors.append(
                f"--rm-type {name} compares each result with its source image, and {family} takes none: it needs an "
                "editing family (e.g. --hf-checkpoint builtin:tiny-shapes-edit) and prompts with source images"
            )
    return errors


def _given_spec(args: argparse.Namespace) -> list[tuple[str, float]]:
    try:
        return parse_reward_spec(args.rm_type) if args.rm_type else []
    except ValueError:
        return []  # reward_spec_from_args names the problem


def reward_spec_from_args(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The spec of `--rm-type` (unset: `custom` with `--custom-rm-path`, else `moving_shapes` on builtin:moving-shapes
    prompts, `shapes` (`shapes_learned,shapes:0` under a reward-gradient loss: the proxy trained, the gold logged), or `temporal_consistency` for a video family; only the servers when --rm-url is given), then `remote<K>` for the K-th reward server's --rm-url
    with its --rm-url-weight (default 1); a `--custom-rm-path` that the spec leaves out would be ignored silently,
    so it is an error."""
    custom_path = args.custom_rm_path
    remote = [(f"{REMOTE}{k}", weight) for k, weight in enumerate(args.rm_url_weight or [1.0] * len(server_urls(args)))]
    if remote and not args.rm_type and not custom_path:
        return remote
    video = makes_video(args.hf_checkpoint, args.model_family)
    default = "temporal_consistency" if video else "shapes"
    if args.prompt_data == BUILTIN_MOVING_SHAPES:
        default = "moving_shapes"  # the world's own reward
    elif not video and args.loss_type in ALGORITHMS and ALGORITHMS[args.loss_type].differentiable_reward(args):
        default = DIFFERENTIABLE_DEFAULT  # a reward-gradient loss trains on the learned proxy, logs the gold
    text = args.rm_type or (CUSTOM if custom_path else default)
    spec = parse_reward_spec(text) + remote
    names = [name for name, _ in spec]
    if CUSTOM in names and not custom_path:
        raise ValueError(f"--rm-type {text!r} names 'custom' but --custom-rm-path is not set")
    if custom_path and CUSTOM not in names:
        raise ValueError(
            f"--custom-rm-path is set but --rm-type {text!r} does not include 'custom'; use --rm-type custom "
            f"or weight it in, e.g. --rm-type custom:1.0,{names[0]}:0.5"
        )
    for name in names:
        if name in REWARD_PACKAGES and importlib.util.find_spec(REWARD_PACKAGES[name][0]) is None:
            module, install = REWARD_PACKAGES[name]
            raise ValueError(f"--rm-type {text!r}: reward {name!r} needs the {module} package: {install}")
    return spec
