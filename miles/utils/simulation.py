"""Whether this code runs inside the planner's simulation (`--plan`): tensors are fake (shapes and dtypes, no bytes),
so steps that read or write real bytes (a checkpoint's weights) are skipped by the code that does them."""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake as _is_fake


def simulating() -> bool:
    """True under an active `FakeTensorMode` (the planner's): tensors made now hold no data."""
    return detect_fake_mode() is not None


def is_fake(tensor: torch.Tensor) -> bool:
    """A planner's tensor: a fake one, or a DTensor whose local shard is fake."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return bool(_is_fake(local))
