import math

import pytest

from miles.backends.fsdp_utils.optim import lr_multiplier


def test_warmup_is_linear_then_constant():
    values = [lr_multiplier(s, warmup_steps=4, decay_steps=10, decay_style="constant", min_ratio=0.0) for s in range(6)]
    assert values == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("step", [2, 5, 7, 12])
def test_cosine_and_linear_decay_match_their_formulas(step):
    progress = min((step - 2) / 8, 1.0)
    cos = lr_multiplier(step, warmup_steps=2, decay_steps=10, decay_style="cosine", min_ratio=0.1)
    lin = lr_multiplier(step, warmup_steps=2, decay_steps=10, decay_style="linear", min_ratio=0.1)
    assert cos == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert lin == pytest.approx(0.1 + 0.9 * (1 - progress))
