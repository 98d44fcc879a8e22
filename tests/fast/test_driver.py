"""The driver's own helpers (no Ray cluster started)."""

import os

import pytest

import train_diffusion
from miles.utils.arguments import parse_args


def test_a_local_cluster_has_room_for_every_actor_share():
    common = ["--hf-checkpoint", "unused", "--cpus-per-rank", "4", "--device", "cpu"]
    dmd2 = parse_args(["--loss-type", "dmd2", "--teacher-load", "unused", "--dp-size", "2", *common])
    # actor and critic groups (2 x 2 x 4) plus one engine's 0.5: Ray would otherwise wait for CPUs forever
    assert train_diffusion.local_ray_cpus(dmd2) == max(os.cpu_count() or 1, 17)
    rl = parse_args(["--loss-type", "policy_loss", "--dp-size", "1", "--rm-num-workers", "2", *common])
    assert train_diffusion.local_ray_cpus(rl) == max(os.cpu_count() or 1, 5)  # 4 + 0.5 + 2 x 0.25


def test_too_few_gpus_fail_at_once_naming_the_flags():
    base = ["--hf-checkpoint", "unused", "--device", "cuda", "--loss-type", "policy_loss"]
    one_rank = parse_args([*base, "--dp-size", "1"])
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* has 1: share them with --colocate"):
        train_diffusion.check_gpus_fit(one_rank, 1.0)
    shared = parse_args([*base, "--dp-size", "1", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    train_diffusion.check_gpus_fit(shared, 1.0)  # one rank per group: a fractional share is safe
    # two ranks at 0.5: Ray would pack both onto one GPU
    packed = parse_args([*base, "--dp-size", "2", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    with pytest.raises(ValueError, match=r"ranks of one group would share a GPU, which NCCL refuses.*--colocate"):
        train_diffusion.check_gpus_fit(packed, 4.0)
    colocated = parse_args([*base, "--dp-size", "2", "--colocate", "--rollout-num-engines", "2"])
    train_diffusion.check_gpus_fit(colocated, 2.0)
    with pytest.raises(ValueError, match=r"--colocate puts rank i .* --dp-size 2 needs 2 GPUs .* has 1"):
        train_diffusion.check_gpus_fit(colocated, 1.0)
    with pytest.raises(ValueError, match=r"lower --dp-size to at most 1"):
        train_diffusion.check_gpus_fit(parse_args([*base, "--dp-size", "2"]), 1.0)
    train_diffusion.check_gpus_fit(parse_args([*base, "--dp-size", "2"]), 4.0)
    train_diffusion.check_gpus_fit(parse_args([*base, "--dp-size", "2", "--device", "cpu"]), 0.0)
