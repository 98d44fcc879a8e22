"""The frozen-copy maths several algorithms share: velocity-space KL, the shadow decay schedule, the in-place EMA."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.shadow import ema_update_, old_policy_decay, velocity_kl


def test_velocity_kl_is_zero_for_equal_predictions():
    v = torch.randn(2, 3)
    torch.testing.assert_close(velocity_kl(v, v.clone()), torch.zeros(2))
    torch.testing.assert_close(velocity_kl(v, v + 2.0), torch.full((2,), 4.0))


def test_decay_schedule_values():
    assert [old_policy_decay(s) for s in (0, 1, 100, 500, 501, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.5, 0.5, 0.5]
    )
    assert old_policy_decay(50, rate=0.0075, max_decay=0.999, flat_steps=75) == 0.0
    assert old_policy_decay(175, rate=0.0075, max_decay=0.999, flat_steps=75) == pytest.approx(0.75)
    assert old_policy_decay(10_000, rate=0.0075, max_decay=0.999, flat_steps=75) == pytest.approx(0.999)
    assert old_policy_decay(300, rate=0.0, max_decay=0.0) == 0.0


def test_ema_update_in_place():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    new = [torch.tensor([3.0, 6.0]), torch.tensor([[4.0]])]
    ema_update_(old, new, 0.25)
    torch.testing.assert_close(old[0], torch.tensor([0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6]))
    torch.testing.assert_close(old[1], torch.tensor([[3.0]]))
    ema_update_(old, new, 0.0)
    torch.testing.assert_close(old[0], new[0])
    with pytest.raises(ValueError, match="1 new"):
        ema_update_(old, new[:1], 0.5)
