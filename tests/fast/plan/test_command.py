"""`--plan` as a command (miles/plan/command.py)."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from miles.plan.command import make_plan


def test_an_unknown_hub_id_names_the_shipped_ones():
    with pytest.raises(ValueError, match="black-forest-labs/FLUX.1-dev"):
        make_plan(parse_args(["--plan", "--hf-checkpoint", "nobody/nothing"]))
