"""The dp-2 plan the simulate and run tests both read, planned once."""

from __future__ import annotations

import pytest

from miles.plan.run import simulate
from tests.fast.plan.plan_cases import plan_args


@pytest.fixture(scope="session")
def dp2():
    """The default run (nft, full fine-tuning) at --dp-size 2 planned once: its args and simulation."""
    args = plan_args("--dp-size", "2")
    return args, simulate(args)
