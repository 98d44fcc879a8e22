"""What the e2e tests share within one session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def golden_series_here() -> dict[str, list[dict]]:
    """Each golden loss type's dp-2 series as this machine computed it (test_golden.py fills it; tests comparing
    another run with it on this machine read it, or run the golden flags themselves when it is missing)."""
    return {}
