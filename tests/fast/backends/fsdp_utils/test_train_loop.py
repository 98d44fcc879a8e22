"""The trunk runs every forward a prepare names (each with its guidance) and hands the formula their predictions by
name; the trunk's files name no loss type (the algorithm's declaration says what a role holds)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import miles.backends.fsdp_utils as fsdp_utils
from miles.algorithms import OLD_POLICY, TEACHER, Role, get_algorithm
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks, check_declaration, sft
from miles.backends.fsdp_utils.loss_hub.types import Guidance, PreparedBatch
from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule
from miles.backends.fsdp_utils.train_loop import TrainLoop


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x):
        return self.factor * x


class Family:
    """v = network(latents), plus the guidance scale and negative it was called with (to see what each forward got)."""

    def predict_velocity(self, network, latents, sigmas, embeds, *, guidance_scale=1.0, negative=None):
        return network(latents) + 10 * guidance_scale + (0.0 if negative is None else negative)


class Loop(TrainLoop):
    def __init__(self, networks):
        self.model, self.family, self.role = networks["policy"], Family(), "actor"
        self.networks = networks


def prepared(frozen=(), **fields):
    return PreparedBatch(latents=torch.ones(2, 3), sigmas=torch.ones(2), embeds=None, frozen_networks=frozen, **fields)


def test_every_named_frozen_network_runs_once_without_grad_and_is_handed_by_name():
    loop = Loop({"policy": Scale(1.0), "old": Scale(2.0), "ref": Scale(3.0), "teacher": Scale(4.0)})
    out = loop._forward(prepared(frozen=("old", "ref", "old")))
    assert set(out) == {"new_pred", "frozen_preds"}  # one channel: no `ref_pred` beside `frozen_preds`
    assert out["new_pred"].requires_grad and torch.equal(out["new_pred"], torch.full((2, 3), 11.0))
    assert list(out["frozen_preds"]) == ["old", "ref"]
    assert torch.equal(out["frozen_preds"]["old"], torch.full((2, 3), 12.0))
    assert torch.equal(out["frozen_preds"]["ref"], torch.full((2, 3), 13.0))
    assert not any(p.requires_grad for p in out["frozen_preds"].values())
    with pytest.raises(TypeError):
        out["frozen_preds"]["teacher"] = torch.zeros(1)  # read-only for the formula


def test_a_frozen_network_runs_with_its_own_guidance_the_others_with_the_batchs():
    loop = Loop({"policy": Scale(1.0), "ref": Scale(3.0), "teacher": Scale(4.0)})
    batch = prepared(
        frozen=("teacher", "ref"),
        guidance_scale=2.0,
        negative=0.5,
        frozen_guidance={"teacher": Guidance(scale=7.0, negative=0.25)},
    )
    out = loop._forward(batch)
    assert torch.equal(out["frozen_preds"]["teacher"], torch.full((2, 3), 4.0 + 70.0 + 0.25))
    assert torch.equal(out["frozen_preds"]["ref"], torch.full((2, 3), 3.0 + 20.0 + 0.5))
    assert torch.equal(out["new_pred"], torch.full((2, 3), 1.0 + 20.0 + 0.5))


def test_no_frozen_network_named_means_no_frozen_forward():
    out = Loop({"policy": Scale(1.0)})._forward(prepared())
    assert dict(out["frozen_preds"]) == {}


def test_an_unroll_runs_the_policy_over_the_grid_with_gradient_and_hands_the_result():
    """PreparedBatch.unroll_sigmas: K Euler steps of the trained network from the latents (v = a·x + 10 here, the
    Family's guidance 1 term), the first step's velocity as new_pred, the result as `unrolled`; frozen networks run
    once at the latents."""
    loop = Loop({"policy": Scale(0.5), "ref": Scale(3.0)})
    grid = torch.tensor([1.0, 0.6, 0.0])
    out = loop._forward(prepared(frozen=("ref",), unroll_sigmas=grid))
    x = torch.ones(2, 3)
    first = 0.5 * x + 10
    x1 = x + first * (0.6 - 1.0)
    expected = x1 + (0.5 * x1 + 10) * (0.0 - 0.6)
    torch.testing.assert_close(out["unrolled"], expected)
    torch.testing.assert_close(out["new_pred"], first)
    torch.testing.assert_close(out["frozen_preds"]["ref"], 3.0 * x + 10)
    out["unrolled"].sum().backward()
    a, hand = loop.model.factor, (x * -0.4 * (1 + 0.5 * -0.6) + x1 * -0.6).sum()  # d/da of Σ x_2 at a = 0.5
    torch.testing.assert_close(a.grad, hand)


def test_a_network_the_role_does_not_hold_is_named_in_the_error():
    with pytest.raises(KeyError, match="teacher"):
        Loop({"policy": Scale(1.0)})._forward(prepared(frozen=("teacher",)))


def test_the_recompute_keywords_reach_only_an_algorithm_with_a_log_prob_ratio():
    loop = Loop({"policy": Scale(1.0)})
    assert loop._ratio_keywords(write=True, from_new=False) == {}
    loop.log_prob_ratio = True
    assert loop._ratio_keywords(write=True, from_new=False) == {
        "write_old_log_prob": True,
        "old_log_prob_from_new": False,
    }


def test_declarations_say_what_the_trunk_used_to_hard_code():
    assert get_algorithm("nft").role("actor").frozen_networks == (OLD_POLICY,)
    assert get_algorithm("dmd2").role("critic").frozen_networks == (TEACHER,)
    assert get_algorithm("dmd2").role("actor").frozen_networks == ()
    nft = LOSS_HOOKS[("nft", "actor")]
    assert nft.engine_weights == "old"
    args = SimpleNamespace(
        diffusion_nft_old_decay_rate=0.01, diffusion_nft_old_decay_max=0.5, diffusion_nft_old_decay_flat_steps=0
    )
    assert nft.after_train(SimpleNamespace(args=args), global_step=10) == {"old": pytest.approx(0.1)}
    assert LOSS_HOOKS[("policy_loss", "actor")].after_train(None, global_step=10) == {}


def test_engine_weights_must_name_a_shadow_the_role_declares():
    hooks = LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula, engine_weights="old")
    check_declaration(hooks, Role("actor", frozen_networks=(OLD_POLICY,)), "here")
    for role in (Role("actor"), Role("actor", frozen_networks=(TEACHER,))):
        with pytest.raises(ValueError, match=r"engine_weights 'old' must name a shadow"):
            check_declaration(hooks, role, "here")


def test_after_train_may_decay_only_a_declared_shadow():
    loop = Loop({"policy": Scale(1.0)})
    loop.shadows, loop.global_step = {}, 3
    loop.hooks = LossHooks(
        prepare=sft.prepare_sft_batch, formula=sft.sft_formula, after_train=lambda ctx, *, global_step: {"old": 0.5}
    )
    with pytest.raises(KeyError, match="'old', which is not a shadow"):
        loop._update_shadows(None)


def test_a_pair_weight_divides_each_window_by_its_pairs_that_train():
    loop = Loop({"policy": Scale(1.0)})
    loop.world_size, loop.role = 1, "actor"
    schedule = build_microbatch_schedule(num_pairs=8, num_windows=2, micro_batch_size=3)
    pairs = {"weight": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])}
    loop.hooks = LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula)
    assert loop._window_denominators(pairs, schedule) == [4, 4]  # no pair weight: the pair counts
    loop.hooks = LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula, pair_weight="weight")
    assert loop._window_denominators(pairs, schedule) == [3.0, 4]  # 3 pairs train; none: the loss is 0
    with pytest.raises(KeyError, match="no 'weight' column"):
        loop._window_denominators({"x0": torch.zeros(8)}, schedule)
    assert LOSS_HOOKS[("dpo", "actor")].pair_weight == "weight"


@pytest.mark.parametrize("name", ["actor.py", "train_loop.py"])
def test_the_trunk_names_no_loss_type(name):
    text = (Path(fsdp_utils.__file__).parent / name).read_text()
    assert "loss_type" not in text
    for loss_type in ("sft_loss", "policy_loss", '"nft"', "dmd2", "custom_loss"):
        assert loss_type not in text
