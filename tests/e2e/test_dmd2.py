"""DMD2 through the driver on 2 ranks: frozen teacher, critic and generator both trained at the update ratio, the
engine/trainer x̂₀ parity, and only boxes passing through the driver."""

import os
from collections import Counter

import pytest
import ray
import torch

import train_diffusion
from miles.arguments.parser import parse_args
from miles.models.base import get_train_pipeline_config
from miles.ray.train_group import RayTrainGroup
from miles.utils.box import Box
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
ROLLOUTS, RATIO, ACTOR_STEPS = 3, 2, 1


def dmd2_args(pipeline_dir, out, *extra):
    return parse_args(
        [
            "--loss-type",
            "dmd2",
            "--hf-checkpoint",
            pipeline_dir,
            "--teacher-load",
            pipeline_dir,
            "--prompt-data",
            "builtin:shapes",
            "--dp-size",
            "2",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "1",
            "--num-steps-per-rollout",
            str(ACTOR_STEPS),
            "--micro-batch-size",
            "1",
            "--dmd2-generator-steps",
            "2",
            "--dmd2-critic-updates-per-step",
            str(RATIO),
            "--lr",
            "1e-3",
            "--num-rollout",
            str(ROLLOUTS),
            "--image-grid-interval",
            "0",
            "--output-dir",
            str(out),
            "--no-progress",
            "--log-level",
            "WARNING",
            *extra,
        ]
    )


def test_dmd2_trains_critic_and_generator_against_a_frozen_teacher(
    ray_cluster, tiny_pipeline_dir, tmp_path, monkeypatch
):
    train_outputs: list = []
    fetched: list = []
    real_train, real_get = RayTrainGroup.train, ray.get

    def recording_train(self, rollout_id, data, peer=None):
        boxes = real_train(self, rollout_id, data, peer)
        train_outputs.append((self.role, boxes, peer))
        return boxes

    def recording_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(RayTrainGroup, "train", recording_train)
    monkeypatch.setattr(ray, "get", recording_get)
    states = {}

    def inspect(groups):
        states["teacher"] = groups["critic"].call("network_state_dict_every_rank", "teacher")
        states["critic"] = groups["critic"].call("full_state_dict_every_rank")
        states["actor"] = groups["actor"].call("full_state_dict_every_rank")

    train_diffusion.run(dmd2_args(tiny_pipeline_dir, tmp_path), before_shutdown=inspect)

    initial = get_train_pipeline_config(tiny_pipeline_dir).load_transformer().state_dict()
    for rank in range(2):  # (1) the teacher is bit-for-bit the checkpoint; (2) critic and generator moved
        assert states["teacher"][rank].keys() == initial.keys()
        assert all(torch.equal(states["teacher"][rank][k], initial[k]) for k in initial)
        for role in ("critic", "actor"):
            changed = max((states[role][rank][k] - initial[k]).abs().max().item() for k in initial)
            assert changed > 1e-4, (role, changed)
    metrics = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    windows = [m for m in metrics if "role" in m]
    counts = Counter((m["role"], m["rollout_id"]) for m in windows)
    for rollout_id in range(ROLLOUTS):  # (3) the two time-scale ratio per rollout
        assert counts[("critic", rollout_id)] == RATIO * ACTOR_STEPS
        assert counts[("actor", rollout_id)] == ACTOR_STEPS
    actor = [m for m in windows if m["role"] == "actor"]
    assert [m["step"] for m in actor] == list(range(1, ROLLOUTS * ACTOR_STEPS + 1))
    assert max(m["train/generator_x0_abs_diff"] for m in actor) < 1e-4  # engine and trainer agree on x̂₀
    assert all(m["train/dmd_grad_norm_mean"] > 0 for m in actor)
    # (4) the critic's outputs reach the actor as unopened boxes; the driver never fetches their payloads
    critic_calls = [boxes for role, boxes, _ in train_outputs if role == "critic"]
    actor_peers = [peer for role, _, peer in train_outputs if role == "actor"]
    assert len(critic_calls) == ROLLOUTS and actor_peers == critic_calls
    payloads = [box.inner for boxes in critic_calls for box in boxes]
    assert all(isinstance(box, Box) for boxes in critic_calls for box in boxes)
    assert all(isinstance(ref, ray.ObjectRef) for ref in payloads)
    fetched_ids = {ref.hex() for ref in fetched if isinstance(ref, ray.ObjectRef)}
    assert fetched_ids  # the recorder saw the driver's ray.get calls (the train tasks' small results)
    assert not fetched_ids & {ref.hex() for ref in payloads}


def test_dmd2_resumes_from_separate_actor_and_critic_folders_bit_for_bit(ray_cluster, tiny_pipeline_dir, tmp_path):
    from miles.backends.fsdp_utils.checkpoint import LATEST_FILE, read_latest

    actor_dir, critic_dir = str(tmp_path / "actor_ckpt"), str(tmp_path / "critic_ckpt")
    folders = ("--save", actor_dir, "--critic-save", critic_dir, "--save-interval", "1")

    def run(out, *extra):
        train_diffusion.run(
            dmd2_args(tiny_pipeline_dir, str(out), "--num-rollout", "2", "--eval-interval", "0",
                      "--rollout-batch-size", "2", *folders, *extra)
        )  # fmt: skip

    run(tmp_path / "straight")  # saves after rollouts 0 and 1
    assert read_latest(actor_dir) == 1 and read_latest(critic_dir) == 1  # each folder has its own pointer
    assert os.listdir(os.path.join(actor_dir, "iter_0000000")) == ["actor"]
    assert os.listdir(os.path.join(critic_dir, "iter_0000000")) == ["critic"]
    for folder in (actor_dir, critic_dir):  # as if the run had stopped after rollout 0's save
        with open(os.path.join(folder, LATEST_FILE), "w") as f:
            f.write("0\n")
    run(tmp_path / "resumed", "--load", actor_dir)  # --critic-load defaults to --critic-save
    a = [m for m in read_metrics(os.path.join(tmp_path, "straight", "metrics.jsonl")) if m.get("rollout_id") == 1]
    b = [m for m in read_metrics(os.path.join(tmp_path, "resumed", "metrics.jsonl")) if m.get("rollout_id") == 1]
    a, b = [m for m in a if "role" in m], [m for m in b if "role" in m]
    assert [(m["role"], m["step"]) for m in b] == [("critic", 3), ("critic", 4), ("actor", 2)]
    assert [(m["role"], m["step"]) for m in a] == [(m["role"], m["step"]) for m in b]
    for x, y in zip(a, b):  # the resumed rollout 1 is the uninterrupted one, bit for bit, for both roles
        train = sorted(k for k in x if k.startswith("train/"))
        assert train and [x[k] for k in train] == [y[k] for k in train], (x, y)
