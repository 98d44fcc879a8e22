"""The refl rollout side: the differentiated step j drawn per rollout among the last M grid indices, seeded, and the
ODE request recording it."""

import pytest

from miles.arguments.parser import default_args
from miles.rollout.rollout_hub.refl import SPEC, refl_step
from miles.utils.types import Sample


def test_the_step_is_one_of_the_last_m_drawn_per_rollout():
    steps = [refl_step(10, 3, seed=1, rollout_id=r) for r in range(40)]
    assert set(steps) == {7, 8, 9}
    assert steps == [refl_step(10, 3, seed=1, rollout_id=r) for r in range(40)]  # seeded
    assert refl_step(10, 1, seed=1, rollout_id=0) == 9
    with pytest.raises(ValueError, match="--refl-last-steps 11"):
        refl_step(10, 11, seed=1, rollout_id=0)


def test_the_request_records_that_step_on_the_ode():
    args = default_args(loss_type="refl", diffusion_guidance_scale=4.5)
    samples = [Sample(index=0, prompt="a red circle", seed=3)]
    request = SPEC.build_request(args, samples, rollout_id=4, resolution=32)
    assert request.sde_type == "ode" and request.trained_steps == [
        refl_step(10, 3, seed=args.rollout_seed, rollout_id=4)
    ]
    assert SPEC.metrics(request) == {"rollout/refl_step": request.trained_steps[0]}
