"""Regenerate docs/user-guide/cli-reference.md from the argument parser (the test suite checks it is current)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.utils.arguments import build_parser  # noqa: E402

HEADER = """# CLI reference

Every flag of `python train_diffusion.py`. Generated from `miles/utils/arguments.py` by
`python scripts/gen_cli_reference.py`; the test suite fails when this page and the parser disagree.
Any flag can also be given in a `--config file.yaml` (keys with dashes or underscores; the command line wins).
Cross-flag rules (ARCHITECTURE §8) are checked by `validate_args` before any actor starts; see the end of this page.
"""

RULES = """## Rules checked before start-up

- `--diffusion-recompute-old-log-prob` is rejected under `sft_loss`, `nft` and `dmd2` (no log-prob ratio).
- `--loss-type dmd2` requires `--teacher-load`; `--teacher-load` is accepted under every loss type. Under `dmd2`,
  `--diffusion-guidance-scale` above 1 is rejected (the generator is CFG-free; the teacher's CFG is
  `--dmd2-real-guidance-scale`).
- `--custom-prepare-train-batch-path`, `--custom-loss-function-path`, `--custom-train-input-postprocess-path`,
  `--custom-train-output-path` only under `custom_loss`, which requires the first two.
- The `--critic-*` overrides only under `dmd2`; unset ones take the actor's values (`--critic-checkpoint`
  defaults to `--teacher-load`).
- Batch invariant: `--rollout-batch-size` x `--n-samples-per-prompt` = `--global-batch-size` x
  `--num-steps-per-rollout`; `--global-batch-size` divisible by `--dp-size` (it defaults to the value that
  satisfies the invariant).
- `--diffusion-shared-initial-noise` is rejected under `nft` (its ODE samples of a prompt would all be one image)
  and `dmd2`.
- `--loss-type sft_loss` needs `--train-only` and `--n-samples-per-prompt 1`.
- `--load DIR` must exist unless it equals `--save` (auto-resume).
- A rollout-step path flag the loss type never reads is rejected: every one of them needs a generating rollout
  (not `sft_loss`); `--dynamic-sampling-filter-path`, `--rollout-sample-filter-path` and
  `--custom-reward-post-process-path` need a loss that trains on rewards (not `dmd2`);
  `--diffusion-step-strategy-path` only under `policy_loss` and `custom_loss` (SDE rollouts). Every path flag given
  is loaded and its signature checked before any actor starts (docs/user-guide/customization.md lists them).
"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return "—"
    return f"`{action.default}`"


def render() -> str:
    parser = build_parser()
    lines = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        lines += [f"## {title}", "", "| flag | default | choices | description |", "|---|---|---|---|"]
        for action in actions:
            choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
            help_text = (action.help or "").replace("|", "\\|")
            flags = " ".join(f"`{flag}`" for flag in action.option_strings)  # the name, then any older aliases
            lines.append(f"| {flags} | {_default(action)} | {choices} | {help_text} |")
        lines.append("")
    lines.append(RULES)
    return "\n".join(lines)


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs/user-guide/cli-reference.md")
    with open(path, "w") as f:
        f.write(render())


if __name__ == "__main__":
    main()
