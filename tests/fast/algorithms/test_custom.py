"""custom_loss runs the user's hooks: without them, one line names the two flags to add."""

from __future__ import annotations

from tests.fast.arguments.test_parser import parse_error


def test_custom_loss_names_the_hooks_to_add_in_one_line(capsys):
    err = parse_error(["--loss-type", "custom_loss"], capsys).strip().splitlines()[-1]
    assert err.endswith(
        "error: --loss-type custom_loss runs your hooks: add --custom-prepare-train-batch-path and "
        "--custom-loss-function-path (pkg.mod.fn or file.py:fn; docs/user-guide/customization.md)"
    )
