"""Whether code runs in the planner's fake-tensor simulation, and real tensors made inside it on purpose."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from miles.utils.simulation import real_tensors, simulating


def test_simulating_only_under_a_fake_mode_and_real_tensors_stay_real_inside_it():
    assert not simulating()
    with FakeTensorMode():
        assert simulating()
        assert isinstance(torch.ones(2), FakeTensor)
        with real_tensors():
            assert not simulating()
            table = torch.arange(3.0)
        assert simulating()
    assert not isinstance(table, FakeTensor) and table.tolist() == [0.0, 1.0, 2.0]
