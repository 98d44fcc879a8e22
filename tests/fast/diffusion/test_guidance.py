"""CFG combine and the batched [uncond; cond] split."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.guidance import cfg_combine, guided_velocity, make_cfg_batch, split_cfg_batch, uses_cfg


def test_cfg_combine_formula_and_scale_one_is_cond():
    uncond, cond = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(cfg_combine(uncond, cond, 4.5), uncond + 4.5 * (cond - uncond))
    torch.testing.assert_close(cfg_combine(uncond, cond, 1.0), cond)
    torch.testing.assert_close(cfg_combine(uncond, cond, 0.0), uncond)


def test_batched_forward_round_trip():
    uncond, cond = torch.randn(2, 3), torch.randn(2, 3)
    batch = make_cfg_batch(uncond, cond)
    assert batch.shape == (4, 3)
    u, c = split_cfg_batch(batch)
    torch.testing.assert_close(u, uncond)
    torch.testing.assert_close(c, cond)
    # A per-row "model" applied to the batch equals applying it to each branch separately.
    torch.testing.assert_close(guided_velocity(batch * 2, 3.0), 2 * uncond + 3.0 * (2 * cond - 2 * uncond))


def test_odd_batch_is_rejected_and_uses_cfg():
    with pytest.raises(ValueError, match="even"):
        split_cfg_batch(torch.randn(3, 2))
    assert uses_cfg(4.5) and not uses_cfg(1.0)
