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


@pytest.fixture(scope="module")
def killed_run(ray_cluster, tiny_pipeline_dir, tmp_path_factory):
    """An sft run that saves every rollout and loses trainer rank 1 at the start of rollout 1's train."""
    tmp = tmp_path_factory.mktemp("killed")
    real_train, seen = RayTrainGroup.train, {}

    def kill_rank_1_at_rollout_1(self, rollout_id, data, peer=None):
        if rollout_id == 1:
            seen["actors"], seen["placement_group"] = list(self.actors), self.placement_group
            ray.kill(self.actors[1])  # a trainer process dies mid-run (OOM killer, node loss...)
        return real_train(self, rollout_id, data, peer)

    ckpt = str(tmp / "ckpt")
    args = sft_args(tiny_pipeline_dir, tmp / "run", *COMMON, "--save", ckpt, "--save-interval", "1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RayTrainGroup, "train", kill_rank_1_at_rollout_1)
        with pytest.raises(ActorDied) as info:
            train_diffusion.run(args)
    return {"error": info.value, "ckpt": ckpt, "out": tmp / "run", **seen}


def test_a_killed_trainer_rank_stops_the_run_naming_role_rank_and_rollout(killed_run):
    assert str(killed_run["error"]).startswith("actor rank 1 died during train of rollout 1: ")
    # the cleanup ran to the end: rank 0 (blocked in a collective with the dead rank) was killed, the placement
    # group removed, metrics.jsonl closed with rollout 0 in it, the save folder released
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(killed_run["actors"][0].pop_metrics.remote(), timeout=60)
    assert ray.util.placement_group_table(killed_run["placement_group"])["state"] == "REMOVED"
    assert (killed_run["out"] / "metrics.jsonl").read_text().count('"rollout_id": 0') > 0
    FolderLock(killed_run["ckpt"], "--save").release()


def test_a_second_run_on_the_same_save_folder_refuses_naming_the_holder(tiny_pipeline_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = FolderLock(str(ckpt), "--save")  # what a running `train_diffusion.py --save ckpt` holds
    args = sft_args(tiny_pipeline_dir, tmp_path / "second", *COMMON, "--save", str(ckpt))
    with pytest.raises(FolderLockedError, match=rf"--save {ckpt} is in use by another run \(pid {os.getpid()} "):
        train_diffusion.run(args)
    assert sorted(os.listdir(ckpt)) == [".miles.lock"]  # the refused run wrote nothing there
    first.release()


def test_a_damaged_checkpoint_fails_the_resume_on_every_rank_naming_the_file(killed_run, tiny_pipeline_dir):
    ckpt = killed_run["ckpt"]  # rollout 0, saved before the rank died
    shard = os.path.join(checkpoint_dir(ckpt, 0, "actor"), "dcp", "__1_0.distcp")
    flip_bytes(shard)
    resume = sft_args(tiny_pipeline_dir, killed_run["out"], *COMMON, "--save", ckpt, "--load", ckpt)
    before = {pg: state["state"] for pg, state in ray.util.placement_group_table().items()}
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        train_diffusion.run(resume)
    after = {pg: state["state"] for pg, state in ray.util.placement_group_table().items()}
    # the failed group was ended: its placement group (new, or an idle pooled one it took) is removed, none is left
    ended = {pg for pg, state in after.items() if state == "REMOVED" and before.get(pg, "CREATED") != "REMOVED"}
    assert ended and not [pg for pg, state in after.items() if pg not in before and state != "REMOVED"], after
    message = str(info.value)
    assert "loading the actor checkpoint" in message and "failed on rank 1" in message
    assert f"{shard} is damaged: its CRC32" in message
    assert "raised by actor rank" in info.value.__notes__[0] and "during init (load)" in info.value.__notes__[0]
