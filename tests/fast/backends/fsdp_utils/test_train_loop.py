"""The trunk runs every forward a prepare names and hands the formula their predictions by name; the trunk's
files name no loss type (the loss-hub entry declares what a role holds)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import miles.backends.fsdp_utils as fsdp_utils
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks, sft
from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch
from miles.backends.fsdp_utils.train_loop import TrainLoop, frozen_forward_order


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = torch.nn.Parameter(torch.tensor(factor))

    def forward(self, x):
        return self.factor * x


class Family:
    def predict_velocity(self, network, latents, sigmas, embeds, *, guidance_scale=1.0, negative=None):
        return network(latents)


class Loop(TrainLoop):
    def __init__(self, networks):
        self.model, self.family, self.role = networks["policy"], Family(), "actor"
        self.networks = networks


def prepared(ref=None, frozen=()):
    return PreparedBatch(
        latents=torch.ones(2, 3), sigmas=torch.ones(2), embeds=None, ref_network=ref, frozen_networks=frozen
    )


def test_every_named_frozen_network_runs_once_without_grad_and_is_handed_by_name():
    loop = Loop({"policy": Scale(1.0), "old": Scale(2.0), "ref": Scale(3.0), "teacher": Scale(4.0)})
    out = loop._forward(prepared(ref="old", frozen=("ref", "old")))
    assert frozen_forward_order(prepared(ref="old", frozen=("ref", "old"))) == ["old", "ref"]
    assert out["new_pred"].requires_grad and torch.equal(out["new_pred"], torch.ones(2, 3))
    assert torch.equal(out["ref_pred"], torch.full((2, 3), 2.0))
    assert sorted(out["frozen_preds"]) == ["old", "ref"]
    assert torch.equal(out["frozen_preds"]["ref"], torch.full((2, 3), 3.0))
    assert not any(p.requires_grad for p in out["frozen_preds"].values())
    with pytest.raises(TypeError):
        out["frozen_preds"]["teacher"] = torch.zeros(1)  # read-only for the formula


def test_no_frozen_network_named_means_no_frozen_forward():
    out = Loop({"policy": Scale(1.0)})._forward(prepared())
    assert out["ref_pred"] is None and dict(out["frozen_preds"]) == {}


def test_a_network_the_role_does_not_hold_is_named_in_the_error():
    with pytest.raises(KeyError, match="teacher"):
        Loop({"policy": Scale(1.0)})._forward(prepared(frozen=("teacher",)))


def test_entries_declare_what_the_trunk_used_to_hard_code():
    nft = LOSS_HOOKS[("nft", "actor")]
    assert nft.frozen_networks == ("old",) and nft.shadows == ("old",) and nft.engine_weights == "old"
    assert LOSS_HOOKS[("dmd2", "critic")].frozen_networks == ("teacher",)
    assert LOSS_HOOKS[("dmd2", "critic")].shadows == ()
    args = SimpleNamespace(
        diffusion_nft_old_decay_rate=0.01, diffusion_nft_old_decay_max=0.5, diffusion_nft_old_decay_flat_steps=0
    )
    assert nft.after_train(SimpleNamespace(args=args), global_step=10) == {"old": pytest.approx(0.1)}
    assert LOSS_HOOKS[("policy_loss", "actor")].after_train(None, global_step=10) == {}


def test_bad_declarations_fail_when_the_entry_is_built():
    with pytest.raises(ValueError, match="frozen_networks"):
        LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula, frozen_networks=("critic",))
    with pytest.raises(ValueError, match="engine_weights"):
        LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula, engine_weights="old")


@pytest.mark.parametrize("name", ["actor.py", "train_loop.py"])
def test_the_trunk_names_no_loss_type(name):
    text = (Path(fsdp_utils.__file__).parent / name).read_text()
    assert "loss_type" not in text
    for loss_type in ("sft_loss", "policy_loss", '"nft"', "dmd2", "custom_loss"):
        assert loss_type not in text
