"""The guard's flags: a rollback without checkpoints to restore (no --save, no --save-interval, a role without its
save folder, --async-rollout's batch generated ahead), a gold without the eval's samples or that the run trains on,
and the gold's own flags without a gold, are refused at parse time naming the flag; a guard that can act parses."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE, parse_error

POLICY = BASE + ["--loss-type", "policy_loss", "--diffusion-num-steps", "10"]

ROLLBACK = POLICY + ["--monitor-action", "rollback"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (ROLLBACK, "--monitor-action rollback restores checkpoints: pass --save DIR"),
        (
            ROLLBACK + ["--save", "/tmp/s"],
            "without --save-interval the run saves only at its end: pass --save-interval",
        ),
        (ROLLBACK + ["--save", "/tmp/s", "--save-interval", "1", "--async-rollout"], "cannot undo the rollout"),
        (
            BASE
            + ["--loss-type", "dmd2", "--teacher-load", "/tmp/t", "--monitor-action", "rollback", "--save", "/s"]
            + ["--save-interval", "1", "--critic-save", ""],
            "pass --critic-save DIR",
        ),
        (POLICY + ["--gold-rm-type", "shapes", "--eval-interval", "0"], "--gold-rm-type scores the held-out eval"),
        (POLICY + ["--gold-rm-type", "shapes"], "shapes is trained on (--rm-type); the gold must be a reward the run"),
        (
            POLICY + ["--rm-type", "jpeg_compressibility", "--gold-rm-type", "shape"],
            "--gold-rm-type 'shape': unknown reward 'shape'",
        ),
        (POLICY + ["--gold-rm-type", "custom"], "--gold-rm-type takes built-in rewards"),
        (POLICY + ["--monitor-gold-margin", "0.1"], "--monitor-gold-margin is read only with --gold-rm-type"),
        (POLICY + ["--monitor-rollback-lr-factor", "0"], "--monitor-rollback-lr-factor must be in (0, 1]"),
    ],
)
def test_a_guard_that_cannot_act_is_refused_at_parse_time(extra, message, capsys):
    assert message in parse_error(extra, capsys)


def test_a_guard_that_can_act_parses():
    args = parse_args(ROLLBACK + ["--save", "/tmp/s", "--save-interval", "2", "--rm-type", "jpeg_compressibility"]
                      + ["--gold-rm-type", "shapes", "--monitor-gold-margin", "0.02", "--monitor-gold-window", "5"])  # fmt: skip
    assert (args.monitor_action, args.gold_rm_type, args.monitor_gold_margin, args.monitor_gold_window) == (
        "rollback", "shapes", 0.02, 5
    )  # fmt: skip
    assert (args.monitor_after_rollback, args.monitor_rollback_lr_factor, args.monitor_max_rollbacks) == (
        "continue", 0.5, 2
    )  # fmt: skip
