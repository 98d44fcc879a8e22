"""A run's start-up before any actor: its save folders locked, every check that needs no actor (flags, hook paths,
the family, prompt files, the roles' resume points) on a worker thread while `ray.init` runs on the main thread."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from miles.algorithms import algorithm_of
from miles.arguments.evaluation import BUILTIN_MOVING_SHAPES, eval_enabled
from miles.arguments.hook_paths import load_path_flags
from miles.arguments.reward_spec import parse_reward_spec, reward_media_problems, reward_spec_from_args, runs_rewards
from miles.backends.fsdp_utils.loss_hub import get_loss_hooks
from miles.ray.checkpoint_folders import check_resume_settings, check_roles_agree, lock_save_folders
from miles.ray.cluster import ray_init_settings, start_ray, stop_ray
from miles.rollout.input_files import check_input_files
from miles.utils.failures import run_cleanup
from miles.utils.locks import FolderLocks

logger = logging.getLogger(__name__)


def check_startup(args: argparse.Namespace) -> None:
    """Every path flag loads with the right signature, the family accepts its options and the run's flags (--sp-size
    among them), the loss type has its entries."""
    # diffusers and transformers (~3 s of CPU): imported here, on the checks' thread while ray.init runs
    from miles.models.base import family_options, get_train_pipeline_config, load_family_class
    from miles.models.compile import check_compile
    from miles.rollout.rollout_hub import check_async_rollout, rollout_spec_of

    load_path_flags(args)
    if args.train_pipeline_config_path:
        load_family_class(args.train_pipeline_config_path)
    # the family's options (--num-frames, ...) against the folder, and its own checks of the run's flags
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    family.check_run_args(args, algorithm_of(args))  # the record: models/ imports nothing from algorithms/
    args.source_image_range = tuple(family.source_image_range)  # what the data loaders and the eval read
    if family.takes_source_images and args.resolution is None:  # the eval loads source images at the run's size
        args.resolution = family.default_resolution
    problems = family.sequence_parallel_problems(args.sp_size, args.resolution)  # --sp-size: support, heads, tokens
    if problems:
        raise ValueError("; ".join(problems))
    check_compile(family, args.compile)  # a family that cannot be compiled is refused here, naming its reason
    video = len(family.latent_shape(args.resolution)) != 3
    if runs_rewards(args, algorithm_of(args).scores_rewards):  # a reward that cannot score what the family makes
        problems = reward_media_problems(
            reward_spec_from_args(args), family=family.name, video=video, source_images=family.takes_source_images
        )
        if args.gold_rm_type:  # the proxy-gold monitor's gold scores the eval's samples
            gold = parse_reward_spec(args.gold_rm_type)
            problems += [problem.replace("--rm-type", "--gold-rm-type", 1) for problem in reward_media_problems(
                gold, family=family.name, video=video, source_images=family.takes_source_images
            )]  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
    clips = args.eval_prompt_data == BUILTIN_MOVING_SHAPES  # the one built-in eval of video
    if eval_enabled(args) and not args.eval_function_path and video != clips:
        if video:
            raise ValueError(
                f"the built-in shapes eval scores images, and {family.name} makes video: pass --eval-interval 0, "
                f"--eval-prompt-data {BUILTIN_MOVING_SHAPES} (clips of the moving-shapes world) or your own "
                "--eval-function-path"
            )
        raise ValueError(
            f"--eval-prompt-data {BUILTIN_MOVING_SHAPES} scores clips, and {family.name} makes images: use a video "
            "family (builtin:tiny-moving-shapes) or another --eval-prompt-data"
        )
    for role in algorithm_of(args).role_names:
        get_loss_hooks(args, role)
    rollout_spec_of(args)
    check_async_rollout(args)


def startup_checks(args: argparse.Namespace) -> float:
    """Built-in checkpoint names resolved, then every check that needs no actor: `check_startup`, the prompt files
    (FILE:LINE errors), the roles' resume points. Returns when they ended (`time.perf_counter`)."""
    from miles.models.builtin import resolve_checkpoint  # the family modules (as in check_startup)
    from miles.plan.startup import check_plan  # the trainer's and the engine's modules, imported here meanwhile

    for dest in ("hf_checkpoint", "teacher_load", "critic_checkpoint"):  # builtin:NAME -> the packaged folder
        setattr(args, dest, resolve_checkpoint(getattr(args, dest)))
    check_startup(args)
    check_input_files(args)
    check_roles_agree(args, algorithm_of(args).role_names)
    check_resume_settings(args, algorithm_of(args).role_names)  # LoRA or full weights, as the checkpoints were
    check_plan(args)  # on CUDA: the run simulated on fake tensors; refused when a GPU would run out of memory
    # what RunGroups.launch imports next (peft, the engine and trainer modules), imported here meanwhile
    import miles.ray.evaluator  # noqa: F401
    import miles.ray.rollout_manager  # noqa: F401
    import miles.ray.train_group  # noqa: F401

    return time.perf_counter()


@dataclass(frozen=True)
class StartUp:
    """What the start-up leaves the run: whether this process started Ray (and so stops it), the save-folder locks,
    and when its phases ended (`time.perf_counter`)."""

    own_ray: bool
    locks: FolderLocks
    sized: float
    checked: float
    ray_ready: float

    def log_phases(self, started: float) -> None:
        """One line: sizing, the checks alongside ray.init, the actors' start (until now)."""
        logger.info(
            "start-up phases: sizing the cluster %.1fs, then checks %.1fs alongside ray.init %.1fs, actors (started "
            "together) %.1fs",
            self.sized - started,
            self.checked - self.sized,
            self.ray_ready - self.sized,
            time.perf_counter() - max(self.checked, self.ray_ready),
        )

    def shutdown_steps(self) -> list[tuple[str, Callable[[], Any]]]:
        steps = [("ray.shutdown", stop_ray)] if self.own_ray else []
        return [*steps, ("releasing the save-folder locks", self.locks.release)]


def start_up(args: argparse.Namespace) -> StartUp:
    """Size the cluster and lock the save folders (held until the run ends, released if the process dies), then
    `startup_checks` on a thread while Ray starts here: their errors still come before any actor, and a failed check
    is the error reported even when Ray failed too (Ray's stays attached as its context)."""
    settings = ray_init_settings(args)
    locks = lock_save_folders(args)
    sized = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-checks") as pool:
        checks = pool.submit(startup_checks, args)
        try:
            own_ray = start_ray(settings)
        except BaseException:
            locks.release()
            failed_check = checks.exception()  # waits for the checks
            if failed_check is not None:
                raise failed_check  # noqa: B904 - Ray's error stays attached as its context
            raise
        ray_ready = time.perf_counter()
        try:
            checked = checks.result()
        except BaseException:
            run_cleanup(StartUp(own_ray, locks, sized, sized, ray_ready).shutdown_steps())
            raise
    return StartUp(own_ray, locks, sized, checked, ray_ready)
