"""The draft rollout side: the ODE request records the input of step N − K, where the trainer's unroll starts."""

import pytest

from miles.arguments.parser import default_args
from miles.rollout.rollout_hub.draft import SPEC
from miles.utils.types import Sample


@pytest.mark.parametrize(("k", "step"), [(1, 9), (3, 7), (10, 0)])
def test_the_request_records_step_n_minus_k(k, step):
    args = default_args(loss_type="draft", draft_k=k, diffusion_guidance_scale=1.0)
    request = SPEC.build_request(args, [Sample(index=0, prompt="x", seed=1)], rollout_id=0, resolution=32)
    assert (request.sde_type, request.trained_steps) == ("ode", [step])
