"""What the hooks see: the frozen rollout-level context (no loop state), the prepared micro-batch's guidance per
network, a frozen network's prediction or an error saying how to get it, the window metrics' per-pair means, and
the conditioning stored in train pairs."""

import argparse
import dataclasses
from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    Guidance,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)


def make_context():
    return DiffusionLossContext(
        args=argparse.Namespace(),
        role="actor",
        rollout_id=0,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=None,
        networks=MappingProxyType({}),
    )


def test_context_is_frozen():
    ctx = make_context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rollout_id = 1


@pytest.mark.parametrize("name", ["microbatch_id", "optim_step_idx", "train_output_inputs"])
def test_context_carries_no_loop_state(name):
    with pytest.raises(AttributeError):
        getattr(make_context(), name)


def test_a_network_runs_with_its_own_guidance_or_the_batchs():
    negative = object()
    prepared = PreparedBatch(
        latents=torch.zeros(1),
        sigmas=torch.zeros(1),
        embeds=None,
        negative=negative,
        guidance_scale=4.5,
        frozen_guidance={"teacher": Guidance(3.0)},
    )
    assert prepared.guidance_of("policy") == Guidance(4.5, negative)
    assert prepared.guidance_of("teacher") == Guidance(3.0, None)
    assert PreparedBatch(torch.zeros(1), torch.zeros(1), None).guidance_of("ref") == Guidance(1.0, None)


def test_a_missing_frozen_prediction_says_how_to_get_it():
    ref = torch.ones(2)
    assert frozen_prediction({"ref": ref}, "ref", "the KL") is ref
    with pytest.raises(
        KeyError, match=r"the KL needs the 'teacher' network's prediction: .*frozen_networks .*\['ref'\]"
    ):
        frozen_prediction({"ref": ref}, "teacher", "the KL")


def test_window_metrics_are_means_over_every_pair_added():
    metrics = WindowMetrics()
    assert metrics.means() == {}
    metrics.add("train/loss", torch.tensor([1.0, 2.0]))
    metrics.add("train/loss", torch.tensor([6.0]))
    metrics.add("train/kl", 0.5)
    assert metrics.means() == {"train/kl": 0.5, "train/loss": 3.0}
    totals = metrics.totals(["train/loss", "train/kl"])
    assert totals.dtype == torch.float64 and totals.tolist() == [[9.0, 3.0], [0.5, 1.0]]


def test_conditioning_comes_back_from_its_columns_with_a_prefix():
    pairs = {
        "cond/prompt_embeds": torch.ones(2, 3),
        "negative_cond/prompt_embeds": torch.zeros(2, 3),
        "x0": torch.zeros(2),
    }
    assert torch.equal(conditioning_from_pairs(pairs, torch.device("cpu"))["prompt_embeds"], torch.ones(2, 3))
    negative = conditioning_from_pairs(pairs, torch.device("cpu"), prefix="negative_")
    assert torch.equal(negative["prompt_embeds"], torch.zeros(2, 3))
    with pytest.raises(KeyError, match="the train pairs hold no cond/\\* columns"):
        conditioning_from_pairs({"x0": torch.zeros(2)}, torch.device("cpu"))
