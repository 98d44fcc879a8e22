"""Whether this code runs inside the planner's simulation (`--plan`): tensors are fake (shapes and dtypes, no bytes),
so steps that read or write real bytes (a checkpoint's weights) are skipped by the code that does them."""

from __future__ import annotations

import contextlib

from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily


def simulating() -> bool:
    """True under an active `FakeTensorMode` (the planner's): tensors made now hold no data."""
    return detect_fake_mode() is not None


def real_tensors() -> contextlib.AbstractContextManager:
    """Tensors made inside are real even under the planner's fake mode: for values cached across calls (a σ table
    memoised by a module), which must never be fake when a real run reads them later in the same process."""
    return unset_fake_temporarily()
