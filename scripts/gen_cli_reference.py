"""Regenerate docs/user-guide/cli-reference.md from the argument parser (the test suite checks it is current)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.algorithms import BUILTIN_ALGORITHMS  # noqa: E402
from miles.algorithms.roles import add_role_arguments  # noqa: E402
from miles.arguments.parser import build_parser  # noqa: E402
from miles.arguments.rules import flag_ranges  # noqa: E402
from miles.reward_server import SERVER_RANGES, add_server_arguments  # noqa: E402

HEADER = """# CLI reference

Every flag of `python train_diffusion.py`. Generated from the parser (`miles/arguments/parser.py` and each algorithm's
declaration in `miles/algorithms/`) by `python scripts/gen_cli_reference.py`; the test suite fails when this page and
the parser disagree.
Any flag can also be given in a `--config file.yaml` (keys with dashes or underscores; the command line wins); its
values go through the same type conversion, choices and ranges as the command line, and errors name the file and key.
Cross-flag rules (ARCHITECTURE §8) are checked by `validate_args` before any actor starts, then `derive_args` fills
the computed defaults; see the end of this page.
"""

ALGORITHMS_INTRO = """## Algorithms' own flags

Each algorithm declares its flags in its own file (`miles/algorithms/<name>.py`, `add_arguments`). The parser adds
those of every registered algorithm (a plugin's too, with `--algorithm-path`), so any of them parses under any
`--loss-type`; only the algorithm that reads a flag acts on it.
"""

ROLES_INTRO = """## Role overrides

Every trained role other than the actor gets the same six overrides, `--<role>-checkpoint`, `-lr`, `-load`, `-save`,
`-num-steps-per-rollout` and `-micro-batch-size`; everything else is shared with the actor. They are refused under an
algorithm without that role.
"""

SERVER_INTRO = """## The reward server's own flags

`python -m miles.reward_server` (docs/user-guide/reward-server.md) takes every flag above (a served reward reads
`--rm-type`, `--custom-rm-path`, `--clip-model-path`, ... as a training run does) and these.
"""

RULES = """## Rules checked before start-up

- Every numeric flag must lie in the range its row shows (floats must also be finite); a role override has the range
  of the actor's flag.
- An unknown `--loss-type` fails naming the registered ones; an `--algorithm-path` that fails to import fails naming
  the path.
- A flag you set (on the command line or as a `--config` key, even at its default value) that the run would not
  read is refused, naming the flag and what reads it (`miles/arguments/flag_readers.py`; a flag's declaration says who
  reads it, and an undeclared one is read by every run). An algorithm's own flags are read by it alone, and by an
  algorithm whose declaration lists them in `reads` (`grpo_guard` and `flow_dppo` read `--diffusion-kl-beta`;
  `custom_loss`'s hooks any but another algorithm's `exclusive_flags`): `--diffusion-nft-beta 2 --loss-type
  policy_loss` fails with `--diffusion-nft-beta is read only by --loss-type nft, custom_loss; --loss-type
  policy_loss ignores it: drop it`. `--allow-rollout-mismatch` is read by the algorithms with the first-window guard,
  `--diffusion-recompute-old-log-prob` by those with a log-prob ratio (not `sft_loss`, `nft`, `dmd2`, `dpo`),
  `--diffusion-sde-type`, `--diffusion-noise-level`, `--diffusion-num-sde-steps` and `--diffusion-sde-window-range`
  by those that sample SDE trajectories (and `awm`, whose `--awm-sampler sde` uses them), `--ref-mode` by those
  with a KL term (`policy_loss`, `grpo_guard`, `flow_dppo`, `nft`, `awm`, `custom_loss`: their `reads`);
  `--lora-*` only with `--use-lora`, `--ema-decay` / `--ema-warmup` / `--ema-update-interval` only with
  `--use-ema`, `--wandb-*` only with `--use-wandb`, `--restart-timeout` only with `--max-restarts` above 0,
  `--dynamic-sampling-max-rounds` only with `--dynamic-sampling-filter-path`, `--vlm-judge-*` only with the
  `vlm_judge` reward.
- Every loss type runs on its defaults alone (`--loss-type X`, the shipped model and prompts); the defaults it
  chose are logged at start. `sft_loss` (no engines) implies `--train-only`. `dmd2` without `--teacher-load`
  distills the model itself (`--teacher-load` defaults to `--hf-checkpoint`, as in the authors' setup); the flag is
  accepted under every loss type. `custom_loss` needs your two hooks and says so in one line. Under `dmd2`,
  `--diffusion-guidance-scale` above 1 is rejected (the generator is CFG-free; the teacher's CFG is
  `--dmd2-real-guidance-scale`).
- `--custom-prepare-train-batch-path`, `--custom-loss-function-path`, `--custom-train-input-postprocess-path`,
  `--custom-train-output-path` only under `custom_loss`, which requires the first two.
- A role's `--<role>-*` overrides only under an algorithm with that role (`--critic-*`: `dmd2`); unset ones take
  the actor's values unless the role declares another default (dmd2: `--critic-checkpoint` defaults to
  `--teacher-load`, `--critic-num-steps-per-rollout` to `--dmd2-critic-updates-per-step` x
  `--num-steps-per-rollout`). `--<role>-save` defaults to `--save`. `--<role>-load` defaults to `--load`, except
  when the role saves to its own folder (`--<role>-save` other than `--save`) and `--load` is given: then it
  resumes from `--<role>-save`. Every role's save folder is locked for the run's lifetime. The run resumes only
  when every role's folder points at the same rollout (see `failures.md`).
- `--save-interval` needs `--save` (or a role's `--<role>-save`, e.g. `--critic-save` under `dmd2`).
- Prompt data with fewer distinct prompts than `--rollout-batch-size` is refused unless `--allow-repeated-prompts`.
- Batch invariant: `--rollout-batch-size` x `--n-samples-per-prompt` = `--global-batch-size` x
  `--num-steps-per-rollout`; `--global-batch-size` divisible by `--dp-size` (it defaults to the value that
  satisfies the invariant).
- `--diffusion-shared-initial-noise` is rejected under an algorithm that samples no SDE trajectories (`nft`: its ODE
  samples of a prompt would all be one image; `dmd2`).
- An algorithm without engines (`sft_loss`) runs `--train-only` (implied); `--train-only` is rejected under one
  that needs them (`policy_loss`, `nft`, `dmd2`). `sft_loss` trains each pair once: `--n-samples-per-prompt` is set to 1.
- `--diffusion-guidance-scale` unset takes the algorithm's default, and so does `--globalize-reward-std` (on under
  `awm`; `--no-globalize-reward-std` turns it off); `--eval-interval` unset takes the algorithm's on
  builtin:shapes prompts with an image family (off for video families: the shapes eval scores images).
- `--load DIR` must exist unless it equals `--save` (auto-resume); likewise `--<role>-load` and `--<role>-save`.
- A rollout-step path flag the run never reads is rejected: every one of them needs a generating rollout
  (not `--train-only`); `--dynamic-sampling-filter-path`, `--rollout-sample-filter-path` and
  `--custom-reward-post-process-path` need an algorithm that trains on rewards (not `dmd2`);
  `--diffusion-step-strategy-path` one that samples SDE trajectories (`policy_loss`, `custom_loss`). Every path flag
  given is loaded and its signature checked before any actor starts (docs/user-guide/customization.md lists them).
- Each algorithm's own rules (its `validate`) see the run's values with the computed defaults filled in: `dmd2`
  refuses `--diffusion-guidance-scale` above 1; `policy_loss` needs stochastic steps;
  a KL weight above 0 needs a `--ref-mode` (`awm`'s `--awm-kl-beta` unset is the authors' 1e-3 with a
  reference, 0 without one: the KL to its EMA anchor stays); `dpo` pairs `--train-only` with `--dpo-preference-data` (offline; each
  record is one pair, `--n-samples-per-prompt` is set to 1, no eval), reads and checks that file line by line (keys,
  images that exist and open, `preferred` 0 or 1; errors name FILE:LINE), and online needs `--n-samples-per-prompt`
  ≥ 2 (`--dpo-keep-zero-spread` only online); `awm` needs its `--awm-train-timesteps` strata to fit in the grid
  indices [1, int(`--awm-timestep-fraction` x `--diffusion-num-steps`)), and `--awm-sampler sde` a stochastic
  `--diffusion-sde-type`.
- `--rm-url` must start with `http://` or `https://`. Without `vlm_judge` in `--rm-type`, every `--rm-url` is a
  reward server (`remote<K>` in the reward spec and the metrics; with no `--rm-type` and no `--custom-rm-path` the
  servers are the whole spec) and `--rm-url-weight`, when given, has one weight per `--rm-url`; `--rm-model` is
  refused. With `vlm_judge`, exactly one `--rm-url` (the judge's base URL) and `--rm-model` are required,
  `--rm-url-weight` is refused, and `--vlm-judge-prompt-file` must exist. `--rm-token-env` must name a set,
  non-empty environment variable.
- A run that scores rewards (its algorithm trains on them, or `--rm-type`, `--custom-rm-path` or `--rm-url` asks to
  log them; never under `--train-only`) refuses a reward it cannot run: one whose optional package is missing (`ocr`:
  `pip install miles[ocr]`), a CLIP reward without its `--clip-model-path` / `--pickscore-model-path` folder holding
  a `config.json`; and at start-up, before any model loads, a video reward on an image family or an image reward on a
  video family, `edit_preservation` on a family without source images, `ocr` on prompts without quoted text
  (docs/user-guide/failures.md). An eval of `--eval-prompt-data builtin:ocr` needs the OCR package too.
- `awm` turns `--diffusion-recompute-old-log-prob` on (its `derive`): the rollout records no log-prob, so the old
  log-prob of windows 1.. is the trainer's recompute pass with the pre-update weights (window 0 its own value).
"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and action.default is None:
        return "per algorithm"  # unset: the declaration's default (its help names where it is on)
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return "—"
    return f"`{action.default}`"


def _tables(parser: argparse.ArgumentParser, level: str) -> list[str]:
    ranges = {**flag_ranges(BUILTIN_ALGORITHMS), **SERVER_RANGES}
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        lines += [f"{level} {title}", "", "| flag | default | choices / range | description |", "|---|---|---|---|"]
        for action in actions:
            choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
            if action.dest in ranges:
                choices = ranges[action.dest].describe()
            help_text = (action.help or "").replace("|", "\\|")
            flags = " ".join(f"`{flag}`" for flag in action.option_strings)  # the name, then any older aliases
            lines.append(f"| {flags} | {_default(action)} | {choices} | {help_text} |")
        lines.append("")
    return lines


def render() -> str:
    """The shared flags, each built-in algorithm's own flags, the role overrides, then the rules."""
    lines = [HEADER, *_tables(build_parser(algorithms=()), "##"), ALGORITHMS_INTRO]
    for algorithm in BUILTIN_ALGORITHMS:
        own = argparse.ArgumentParser(add_help=False)
        algorithm.add_arguments(own)
        lines += _tables(own, "###")
    roles = argparse.ArgumentParser(add_help=False)
    add_role_arguments(roles, BUILTIN_ALGORITHMS)
    server = argparse.ArgumentParser(add_help=False)
    add_server_arguments(server)
    lines += [ROLES_INTRO, *_tables(roles, "###"), SERVER_INTRO, *_tables(server, "###"), RULES]
    return "\n".join(lines)


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs/user-guide/cli-reference.md")
    with open(path, "w") as f:
        f.write(render())


if __name__ == "__main__":
    main()
