"""The direct_align rollout side: the ODE request records step 0, whose input is the sample's initial noise ε."""

from miles.arguments.parser import default_args
from miles.rollout.rollout_hub.direct_align import SPEC
from miles.utils.types import Sample


def test_the_request_records_the_initial_noise_and_a_stale_batch_is_accepted():
    args = default_args(loss_type="direct_align", diffusion_guidance_scale=1.0)
    request = SPEC.build_request(args, [Sample(index=0, prompt="x", seed=1)], rollout_id=0, resolution=32)
    assert (request.sde_type, request.trained_steps) == ("ode", [0])
    assert SPEC.stale_batch and "known noise" in SPEC.stale_batch
