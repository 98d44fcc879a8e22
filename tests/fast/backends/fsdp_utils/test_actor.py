"""The trainer actor's life cycle on one rank, without Ray or a model folder: its data-parallel place, the networks
its hooks may name (the reference by --ref-mode, the declared shadows, a checkpoint network when its flag is given),
the shadow state a checkpoint holds, a start with nothing to resume, the refusal to write non-finite weights, the
weight sync used before its plan, and what it exports."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.algorithms.base import OLD_POLICY, TEACHER
from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.backends.fsdp_utils.optim import OptimizerFlags, build_lr_scheduler, build_optimizer
from miles.utils.offload import HostSwap


class Shadow:
    """A stand-in for `ShadowWeights`: its state and its view as a network."""

    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self):
        return {"w": torch.full((2,), self.value)}

    def network(self, model):
        return ("shadow of", model, self.value)


def actor(world_size=1, rank=0, role="actor", **args):
    trainer = FSDPTrainRayActor(world_size, rank, role)
    trainer.args = SimpleNamespace(**{"sp_size": 1, "ref_mode": "none", "fsdp_cpu_offload": False, **args})
    trainer.model, trainer.ema, trainer.shadows, trainer.frozen = nn.Linear(3, 2), None, {}, ()
    trainer.device, trainer.swap = torch.device("cpu"), HostSwap(torch.device("cpu"))
    return trainer


def test_a_rank_trains_its_data_parallel_groups_pairs():
    assert (actor(4, 3, sp_size=2).dp_rank, actor(4, 3, sp_size=2).dp_size) == (1, 2)
    assert (actor(4, 3).dp_rank, actor(4, 3).dp_size) == (3, 4)
    assert actor(fsdp_cpu_offload=True)._home() == torch.device("cpu")


def test_the_networks_are_the_policy_the_reference_the_shadows_and_a_given_checkpoint(monkeypatch):
    plain = actor()
    assert plain._build_networks() == {"policy": plain.model} and plain.loaded == {}
    full = actor(ref_mode="ema", teacher_load="/teacher")
    full.ema, full.shadows, full.frozen = Shadow(1.0), {"old": Shadow(2.0)}, (OLD_POLICY, TEACHER)
    monkeypatch.setattr(full, "_load_frozen", lambda path: ("loaded", path))
    networks = full._build_networks()
    assert networks["ref"] == ("shadow of", full.model, 1.0) and networks["old"] == ("shadow of", full.model, 2.0)
    assert networks["teacher"] == full.loaded["teacher"] == ("loaded", "/teacher")
    unset = actor(teacher_load=None)
    unset.frozen = (TEACHER,)
    assert "teacher" not in unset._build_networks()  # --teacher-load not given: the role's hooks do without it


def test_a_checkpoint_holds_the_ema_and_each_shadow_under_its_key():
    trainer = actor()
    assert trainer._sharded_state() == {}
    trainer.ema, trainer.shadows = Shadow(1.0), {"old": Shadow(2.0), "anchor": Shadow(3.0)}
    state = trainer._sharded_state()
    assert set(state) == {"ema", "nft_old", "shadow_anchor"}  # `old` keeps the name older checkpoints use
    assert torch.equal(state["shadow_anchor"]["w"], torch.full((2,), 3.0))


def test_without_a_checkpoint_to_resume_the_run_starts_at_rollout_0(tmp_path, caplog):
    trainer = actor()
    trainer.settings = {"load": None}
    assert trainer._load() == 0
    trainer.settings = {"load": str(tmp_path)}
    with caplog.at_level(logging.INFO, logger="miles.backends.fsdp_utils.actor"):
        assert trainer._load() == 0
    assert f"no checkpoint in {tmp_path} yet: starting from rollout 0" in caplog.text


def test_non_finite_weights_or_shadows_are_never_written(world_of_one):
    trainer = actor(role="critic")
    trainer.check_finite_weights("save rollout 3 to /c")
    trainer.shadows = {"old": Shadow(float("inf"))}
    with pytest.raises(RuntimeError, match="critic: the weights hold NaN or inf values; refusing to save rollout 3"):
        trainer.check_finite_weights("save rollout 3 to /c")
    trainer.shadows = {}
    with torch.no_grad():
        trainer.model.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="refusing to write --save-hf /out"):
        trainer.check_finite_weights("write --save-hf /out")


def test_the_weight_sync_needs_its_plan_and_the_export_is_the_ranks_own():
    trainer = actor(world_size=2, rank=1, role="critic", ema_rollout_policy="ema")
    with pytest.raises(RuntimeError, match="critic: the weight sync is used before prepare_weight_sync made its plan"):
        trainer.open_weight_sync(None)
    trainer.family, trainer.forward_dtype, trainer.lora_config = "family", torch.bfloat16, None
    trainer.hooks = SimpleNamespace(engine_weights="old")
    export = trainer.export
    assert (export.model, export.rank, export.forward_dtype, export.engine_weights) == (
        trainer.model,
        1,
        torch.bfloat16,
        "old",
    )
    assert export.ema_rollout_policy == "ema" and export.shadows is trainer.shadows


def test_a_rollback_restores_the_saved_state_and_lowers_the_learning_rate(world_of_one, tmp_path):
    """`rollback` (--monitor-action rollback): the weights, the optimizer's moments and the schedule of the saved
    rollout come back, its step count goes on, and the learning rate is the factor times the schedule's."""
    trainer = actor(loss_type="policy_loss", lora_rank=8, use_lora=False, skip_checkpoint_checksums=False)
    flags = OptimizerFlags.from_args(default_args(lr_warmup_steps=4))
    trainer.optimizer = build_optimizer(trainer.model.parameters(), flags, 1e-2)
    trainer.lr_scheduler = build_lr_scheduler(trainer.optimizer, flags, 1e-2, total_steps=10)
    trainer.settings, trainer.global_step = {"save": str(tmp_path)}, 0

    def step() -> None:
        trainer.model(torch.ones(4, 3)).square().sum().backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        trainer.lr_scheduler.step()
        trainer.global_step += 1

    step()
    trainer.save(0)
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = trainer.optimizer.state[trainer.model.weight]["exp_avg"].clone()
    rate = trainer.optimizer.param_groups[0]["lr"]  # step 1 of the warm-up: 2/4 of the peak
    for _ in range(2):
        step()
    trainer.rollback(0, 0.5)
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(trainer.optimizer.state[trainer.model.weight]["exp_avg"], moments)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * rate) and trainer.global_step == 3
    trainer.lr_scheduler.step()  # the schedule goes on from the saved step at half its peak
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-2 * 3 / 4)
