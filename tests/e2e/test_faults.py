"""Fault injection through the driver: a trainer rank killed mid-run, two runs on one save folder, a damaged
checkpoint on resume. Each failure names what failed and leaves nothing running."""

from __future__ import annotations

import os

import pytest
import ray

import train_diffusion
from miles.backends.fsdp_utils.checkpoint import checkpoint_dir
from miles.ray.train_group import RayTrainGroup
from miles.utils.failures import ActorDied
from miles.utils.locks import FolderLock, FolderLockedError
from tests.e2e.test_sft import sft_args
from tests.fast.backends.fsdp_utils.checkpoint_fault_workers import flip_bytes

pytestmark = pytest.mark.e2e
COMMON = ("--prompt-data", "builtin:shapes", "--builtin-dataset-size", "64", "--num-rollout", "3")


def test_a_killed_trainer_rank_stops_the_run_naming_role_rank_and_rollout(
    ray_cluster, tiny_pipeline_dir, tmp_path, monkeypatch
):
    real_train, seen = RayTrainGroup.train, {}

    def kill_rank_1_at_rollout_1(self, rollout_id, data, peer=None):
        if rollout_id == 1:
            seen["actors"], seen["placement_group"] = list(self.actors), self.placement_group
            ray.kill(self.actors[1])  # a trainer process dies mid-run (OOM killer, node loss...)
        return real_train(self, rollout_id, data, peer)

    monkeypatch.setattr(RayTrainGroup, "train", kill_rank_1_at_rollout_1)
    out = tmp_path / "run"
    with pytest.raises(ActorDied, match=r"^actor rank 1 died during train of rollout 1: "):
        train_diffusion.run(sft_args(tiny_pipeline_dir, out, *COMMON))
    # the cleanup ran to the end: rank 0 (blocked in a collective with the dead rank) was killed, the placement
    # group removed, metrics.jsonl closed with rollout 0 in it
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(seen["actors"][0].pop_metrics.remote(), timeout=60)
    assert ray.util.placement_group_table(seen["placement_group"])["state"] == "REMOVED"
    assert (out / "metrics.jsonl").read_text().count('"rollout_id": 0') > 0


def test_a_second_run_on_the_same_save_folder_refuses_naming_the_holder(tiny_pipeline_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = FolderLock(str(ckpt), "--save")  # what a running `train_diffusion.py --save ckpt` holds
    args = sft_args(tiny_pipeline_dir, tmp_path / "second", *COMMON, "--save", str(ckpt))
    with pytest.raises(FolderLockedError, match=rf"--save {ckpt} is in use by another run \(pid {os.getpid()} "):
        train_diffusion.run(args)
    assert sorted(os.listdir(ckpt)) == [".miles.lock"]  # the refused run wrote nothing there
    first.release()


def test_a_damaged_checkpoint_fails_the_resume_on_every_rank_naming_the_file(ray_cluster, tiny_pipeline_dir, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = sft_args(tiny_pipeline_dir, tmp_path / "run", *COMMON, "--save", ckpt)
    first.num_rollout = 1
    train_diffusion.run(first)
    shard = os.path.join(checkpoint_dir(ckpt, 0, "actor"), "dcp", "__1_0.distcp")
    flip_bytes(shard)
    resume = sft_args(tiny_pipeline_dir, tmp_path / "run", *COMMON, "--save", ckpt, "--load", ckpt)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        train_diffusion.run(resume)
    message = str(info.value)
    assert "loading the actor checkpoint" in message and "failed on rank 1" in message
    assert f"{shard} is damaged: its CRC32" in message
    assert "raised by actor rank" in "\n".join(info.value.__notes__) and "during init (load)" in info.value.__notes__[0]
