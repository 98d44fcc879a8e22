"""The record an algorithm declares itself with (ARCHITECTURE §12): its roles, the frozen networks each holds, what
it can do (a log-prob ratio, rewards, SDE sampling, engines), its flags, rules and computed defaults, its progress
keys and plot panels. Plain frozen dataclasses: the parser, the driver, the trunk, the rollout side, the checkpoint
code, the console and the plot ask them; none of those names an algorithm. Imports neither side (no Ray, no torch)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.utils.ranges import AT_LEAST_0, FINITE, POSITIVE, Range

# the settings a role other than the actor may override, each `--<role>-<override>` (dest `<role>_<override>`);
# unset ones fall back to the actor's flag (`lr` -> --lr, `save` -> --save, ...) or the role's own default
ROLE_OVERRIDES = ("checkpoint", "lr", "load", "save", "num_steps_per_rollout", "micro_batch_size")
ACTOR_DESTS = {"checkpoint": "hf_checkpoint"}  # the actor reads the run's own flags; its init is --hf-checkpoint

ProgressKey = tuple[str, str, str]  # (label, metrics key, format spec) shown on the console's progress bar
PlotPanel = tuple[str, tuple[str, ...]]  # (title, metrics keys drawn in it) of metrics.png


def role_dest(role: str, override: str) -> str:
    """The args dest a role's setting lives in: the actor's own flag (`hf_checkpoint`, `lr`, ...), another role's
    `<role>_<override>` (`critic_lr`)."""
    if override not in ROLE_OVERRIDES:
        raise ValueError(f"{override!r} is not a role override (one of {', '.join(ROLE_OVERRIDES)})")
    return ACTOR_DESTS.get(override, override) if role == "actor" else f"{role}_{override}"


def role_flag(role: str, override: str) -> str:
    """`--critic-lr` for the critic's `lr`, `--hf-checkpoint` for the actor's `checkpoint`."""
    return "--" + role_dest(role, override).replace("_", "-")


@dataclass(frozen=True)
class FrozenNetwork:
    """A network a role holds besides the trained one, never updated by its optimizer.

    - `checkpoint`: loaded from the folder the flag `path_flag` (an args dest, e.g. `teacher_load`) names, when given.
    - `shadow`: a copy of the trained weights that only the role's per-rollout step moves (θ_s ← d·θ_s + (1 − d)·θ).
    `ref` (the KL reference: LoRA base or EMA, from --ref-mode) is not declared: every role holds it when asked.
    """

    name: str
    source: str
    path_flag: str | None = None

    def __post_init__(self) -> None:
        if self.source not in ("checkpoint", "shadow"):
            raise ValueError(
                f"FrozenNetwork {self.name!r}: source must be 'checkpoint' or 'shadow', not {self.source!r}"
            )
        if (self.source == "checkpoint") != (self.path_flag is not None):
            raise ValueError(f"FrozenNetwork {self.name!r}: a checkpoint network names its path_flag, a shadow none")


TEACHER = FrozenNetwork("teacher", "checkpoint", "teacher_load")  # --teacher-load
OLD_POLICY = FrozenNetwork("old", "shadow")  # DiffusionNFT's old policy


@dataclass(frozen=True)
class FirstWindowMetrics:
    """The window-0 metrics of the first train call that the first-window guard reads: before any update the policy
    ratio's mean must be 1 and the train/rollout log-prob gap ~0 (None: the loss has no engine log-prob to compare,
    e.g. AWM's likelihood is the trainer's own)."""

    ratio: str = "train/ratio_mean"
    log_prob_abs_diff: str | None = "train/log_prob_abs_diff"


@dataclass(frozen=True)
class Computed:
    """A role override's default computed from the args; `says` is how --help words it."""

    compute: Callable[[argparse.Namespace], Any]
    says: str


@dataclass(frozen=True)
class Role:
    """One trained network of an algorithm. The actor is the policy / generator / SFT model and reads the run's own
    flags; any other role takes the `--<name>-*` overrides of ROLE_OVERRIDES, each falling back to the actor's flag
    unless `defaults` gives it another: an args dest to copy (dmd2's critic starts from the teacher:
    {"checkpoint": "teacher_load"}) or a `Computed` value."""

    name: str
    frozen_networks: tuple[FrozenNetwork, ...] = ()
    defaults: Mapping[str, str | Computed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"Role {self.name!r}: a role name is lower case letters, digits and '_' (its flags)")
        unknown = sorted(set(self.defaults) - set(ROLE_OVERRIDES))
        if unknown or (self.defaults and self.name == "actor"):
            raise ValueError(f"Role {self.name!r}: defaults only for a non-actor role's {', '.join(ROLE_OVERRIDES)}")

    @property
    def overridable(self) -> bool:
        return self.name != "actor"

    def flag(self, override: str) -> str:
        return role_flag(self.name, override)

    def dest(self, override: str) -> str:
        return role_dest(self.name, override)


ACTOR = Role("actor")


def no_arguments(parser: argparse.ArgumentParser) -> None:
    return None


def no_rules(args: argparse.Namespace) -> list[str]:
    return []


def no_derivation(args: argparse.Namespace) -> dict[str, Any]:
    return {}


def no_notes(args: argparse.Namespace) -> list[str]:
    return []


def never(args: argparse.Namespace) -> bool:
    return False


def always(args: argparse.Namespace) -> bool:
    return True


# ---- rules several algorithms share (each returns its messages, naming the flags) -------------------------------
def reference_rule(args: argparse.Namespace) -> list[str]:
    """A KL term to the reference (--diffusion-kl-beta > 0) needs one: --ref-mode lora_base or ema."""
    if args.diffusion_kl_beta > 0 and args.ref_mode == "none":
        return ["--diffusion-kl-beta > 0 needs a reference: --ref-mode lora_base or ema"]
    return []


def stochastic_steps_rule(name: str, args: argparse.Namespace) -> list[str]:
    """A loss on SDE transitions: the kernel must draw them."""
    if args.diffusion_sde_type == "ode":
        return [f"--loss-type {name} needs stochastic steps: --diffusion-sde-type sde, dance or cps"]
    return []


DEFAULT_PROGRESS_KEYS: tuple[ProgressKey, ...] = (
    ("reward", "rollout/reward_mean", ".3f"),
    ("loss", "train/loss", ".4f"),
)
# the reward-hacking monitors (miles/rollout/monitors.py); a key with `*` draws every logged key it matches
MONITOR_PANELS: tuple[PlotPanel, ...] = (
    ("reward components", ("rollout/reward_*_mean",)),
    ("reward correlations", ("monitor/reward_corr/*",)),
    (
        "decoded brightness / saturation",
        (
            "monitor/x0_brightness_mean",
            "monitor/x0_brightness_std",
            "monitor/x0_saturation_mean",
            "monitor/x0_saturation_std",
        ),
    ),
    ("x0 latent RMS norm", ("monitor/x0_norm_mean", "monitor/x0_norm_std")),
    ("diversity within prompt groups", ("monitor/diversity_pixel", "monitor/diversity_clip")),
    ("KL to reference", ("train/kl",)),
    ("guard (--monitor-action)", ("monitor/tripped", "monitor/rollbacks")),
)
COMMON_PANELS: tuple[PlotPanel, ...] = (
    ("grad norm", ("train/grad_norm",)),
    ("seconds per rollout", ("perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/weight_sync_s", "perf/eval_s")),
    *MONITOR_PANELS,
)
EVAL_PANELS: tuple[PlotPanel, ...] = (
    (
        "held-out accuracy",
        ("eval/shapes_accuracy", "eval/shapes_shape_accuracy", "eval/shapes_count_accuracy", "eval/ocr_accuracy"),
    ),
    ("held-out reward", ("eval/shapes_reward_mean", "eval/ocr_reward_mean")),
    ("held-out proxy and gold (--gold-rm-type)", ("eval/proxy_reward", "eval/gold_reward")),
)
DEFAULT_PLOT_PANELS: tuple[PlotPanel, ...] = (
    ("rollout reward", ("rollout/reward_mean",)),
    *EVAL_PANELS,
    ("loss", ("train/loss",)),
    *COMMON_PANELS,
)


@dataclass(frozen=True)
class Algorithm:
    """What an algorithm is, declared once.

    - `roles`: in training order; each role's train output feeds the next (a critic trains before the actor it
      scores for). The last role is the actor, whose weights the engines sample.
    - `log_prob_ratio`: the loss takes a policy ratio against the rollout's log-probs (the recompute flag and the
      bf16 recompute default follow from it).
    - `first_window_metrics`: with `log_prob_ratio`, the metrics the first-window guard checks before the run's first
      update (`miles.backends.fsdp_utils.first_window_guard`; None: no guard).
    - `scores_rewards`: rollouts are scored and advantages computed (False: rewards only as metrics when asked).
    - `group_advantages`: the loss trains on the GRPO advantages (each sample's reward against the others of its
      prompt group), so --n-samples-per-prompt 1, where every advantage is 0, is refused (unless
      --custom-reward-post-process-path computes them).
    - `differentiable_reward(args)`: whether the loss back-propagates the reward in the trainer on this run (refl:
      always; dmd2: with --dmd2-reward-weight > 0): every weighted reward of --rm-type must then be differentiable (a
      `DifferentiableReward`), the others are refused at start-up by name.
    - `samples_sde`: rollouts record SDE trajectories (the step strategy and shared initial noise apply).
    - `uses_engines`: rollouts are generated by the engines (False: trains on dataset pairs, --train-only required).
    - `accepts_train_only`: with engines, --train-only (dataset pairs instead of rollouts) is still accepted.
    - `async_rollout`: --async-rollout is accepted (a batch generated one update behind the trainer is right for the
      loss); its rollout side's `RolloutSpec.stale_batch` says what the loss does with one (checked against it).
    - `guidance_scale`: the default of --diffusion-guidance-scale.
    - `guidance_flags`: its own flags (dests) holding a CFG scale its training forwards use beyond
      --diffusion-guidance-scale (a family that runs no CFG refuses them above 1 at start-up).
    - `globalize_reward_std`: the default of --globalize-reward-std (the GRPO advantage divides by the batch's
      reward std instead of each group's; --no-globalize-reward-std turns it off).
    - `shapes_eval_interval`: the default --eval-interval on builtin:shapes prompts (None: no held-out eval).
    - `add_arguments(parser)`: its own flags (the parser adds every registered algorithm's); `flag_ranges`: their
      numeric ranges (dest -> Range); `exclusive_flags`: its dests refused under any other --loss-type (they would
      be ignored there). Its own flags are read by it alone (miles/arguments/flag_readers.py refuses them, set, under
      another --loss-type); `reads`: other algorithms' flags (dests) it reads too, "*" for all of them (custom_loss,
      whose hooks may read any).
    - `validate(args) -> list[str]`: its rules, errors naming the flags, never mutating args; it sees the run's
      values with every computed default filled in. `derive(args) -> {dest: value}`: its computed defaults,
      applied once after every rule passed. `default_notes(args) -> list[str]`: the defaults it chose for this run
      (from the flags as given: what derive fills, in words), logged by the driver at start.
    - `progress_keys` (the console bar), `plot_panels` (metrics.png), `identifying_metrics` (keys only its runs log:
      how `python -m miles.plot DIR` recognises a run of it).
    """

    name: str
    roles: tuple[Role, ...] = (ACTOR,)
    log_prob_ratio: bool = False
    first_window_metrics: FirstWindowMetrics | None = None
    scores_rewards: bool = True
    group_advantages: bool = False
    differentiable_reward: Callable[[argparse.Namespace], bool] = never
    samples_sde: bool = True
    uses_engines: bool = True
    accepts_train_only: bool = False
    async_rollout: bool = False
    guidance_scale: float = 4.5
    guidance_flags: tuple[str, ...] = ()
    globalize_reward_std: bool = False
    shapes_eval_interval: int | None = None
    add_arguments: Callable[[argparse.ArgumentParser], None] = no_arguments
    flag_ranges: Mapping[str, Range] = field(default_factory=dict)
    exclusive_flags: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    validate: Callable[[argparse.Namespace], list[str]] = no_rules
    derive: Callable[[argparse.Namespace], dict[str, Any]] = no_derivation
    default_notes: Callable[[argparse.Namespace], list[str]] = no_notes
    progress_keys: tuple[ProgressKey, ...] = DEFAULT_PROGRESS_KEYS
    plot_panels: tuple[PlotPanel, ...] = DEFAULT_PLOT_PANELS
    identifying_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [role.name for role in self.roles]
        if not names or names[-1] != "actor" or len(set(names)) != len(names):
            raise ValueError(f"algorithm {self.name!r}: roles {names} must be distinct and end with 'actor'")
        if self.first_window_metrics is not None and not self.log_prob_ratio:
            raise ValueError(f"algorithm {self.name!r}: first_window_metrics needs log_prob_ratio=True (a ratio)")

    @property
    def role_names(self) -> list[str]:
        """The roles in training order."""
        return [role.name for role in self.roles]

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise ValueError(f"--loss-type {self.name} trains no {name!r} role (its roles: {', '.join(self.role_names)})")


# ---- what the reward-gradient losses (refl, draft, direct_align) share in their declarations: the flags of the
# reward objective (its scale, hinge and reference-velocity penalty; refl's parser group adds them, the others list
# them in `reads`), the rule of the penalty's reference, the progress keys and plot panels
# (docs/user-guide/reward-gradients.md)
# the dests of add_reward_gradient_arguments (and the penalty's reference), for the `reads` of the algorithms that
# do not add them
SHARED_DESTS = ("reward_grad_scale", "reward_grad_hinge", "reward_grad_kl_beta", "ref_mode")
SHARED_RANGES = {"reward_grad_scale": POSITIVE, "reward_grad_hinge": FINITE, "reward_grad_kl_beta": AT_LEAST_0}
REWARD_GRADIENT_PROGRESS: tuple[ProgressKey, ...] = (
    ("reward", "rollout/reward_mean", ".3f"),
    ("train reward", "train/reward_mean", ".3f"),
    ("grad", "train/grad_norm", ".3f"),
)
REWARD_GRADIENT_PANELS: tuple[PlotPanel, ...] = (
    ("rollout reward", ("rollout/reward_mean",)),
    *EVAL_PANELS,
    ("reward of the differentiated sample", ("train/reward_mean",)),
    ("reward-gradient loss", ("train/loss", "train/reward_loss", "train/velocity_penalty")),
    *COMMON_PANELS,
)


def add_reward_gradient_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reward gradients (refl, draft, direct_align)")
    group.add_argument("--reward-grad-scale", type=float, default=1.0, help="λ: the loss is λ·mean φ(R) per sample.")
    group.add_argument(
        "--reward-grad-hinge",
        type=float,
        default=None,
        help="c: φ(R) = ReLU(c − R), no gradient once R ≥ c (ReFL's hinge); unset: φ(R) = −R.",
    )
    group.add_argument(
        "--reward-grad-kl-beta",
        type=float,
        default=0.0,
        help="β of the reference-velocity penalty β·mean((v_θ − v_ref)²) at the differentiated input (needs "
        "--ref-mode lora_base or ema).",
    )


def reward_gradient_rules(args: argparse.Namespace) -> list[str]:
    """What every reward-gradient loss needs: a reference for its penalty."""
    if args.reward_grad_kl_beta > 0 and args.ref_mode == "none":
        return [
            f"--reward-grad-kl-beta > 0 (--loss-type {args.loss_type}) needs a reference: --ref-mode lora_base or ema"
        ]
    return []
