"""The driver's cluster sizing and start-up decisions (no Ray cluster started)."""

import os

import pytest

from miles.arguments.parser import parse_args
from miles.ray.cluster import actor_shares, check_gpus_fit, local_ray_cpus
from miles.ray.groups import roles_to_start


def test_a_local_cluster_has_room_for_every_actor_share():
    common = ["--hf-checkpoint", "unused", "--cpus-per-rank", "4", "--device", "cpu"]
    dmd2 = parse_args(["--loss-type", "dmd2", "--teacher-load", "unused", "--dp-size", "2", *common])
    # actor and critic groups (2 x 2 x 4) plus one engine's 0.5: Ray would otherwise wait for CPUs forever
    assert local_ray_cpus(dmd2) == max(os.cpu_count() or 1, 17)
    rl = parse_args(["--loss-type", "policy_loss", "--dp-size", "1", "--rm-num-workers", "2", *common])
    assert local_ray_cpus(rl) == max(os.cpu_count() or 1, 5)  # 4 + 0.5 + 2 x 0.25


def test_sequence_parallel_ranks_are_counted_in_the_cluster_size():
    common = ["--hf-checkpoint", "unused", "--loss-type", "policy_loss", "--dp-size", "2", "--sp-size", "2"]
    cpu = parse_args([*common, "--cpus-per-rank", "4", "--device", "cpu", "--rm-num-workers", "2"])
    assert actor_shares(cpu, 4.0, 0.5) == (16.0, 0.5)  # 2 dp x 2 sp ranks of 4 CPUs; the engine stays whole
    assert local_ray_cpus(cpu) == max(os.cpu_count() or 1, 17)  # 16 + 0.5 + 2 x 0.25
    gpu = parse_args([*common, "--device", "cuda"])
    check_gpus_fit(gpu, 5.0)  # 4 ranks + 1 engine
    with pytest.raises(ValueError, match=r"--dp-size 2 x --sp-size 2 x --gpus-per-rank 1.*lower --dp-size x --sp-size"):
        check_gpus_fit(gpu, 3.0)


def test_too_few_gpus_fail_at_once_naming_the_flags():
    base = ["--hf-checkpoint", "unused", "--device", "cuda", "--loss-type", "policy_loss"]
    one_rank = parse_args([*base, "--dp-size", "1"])
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* has 1: share them with --colocate"):
        check_gpus_fit(one_rank, 1.0)
    shared = parse_args([*base, "--dp-size", "1", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    check_gpus_fit(shared, 1.0)  # one rank per group: a fractional share is safe
    # two ranks at 0.5: Ray would pack both onto one GPU
    packed = parse_args([*base, "--dp-size", "2", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    with pytest.raises(ValueError, match=r"ranks of one group would share a GPU, which NCCL refuses.*--colocate"):
        check_gpus_fit(packed, 4.0)
    colocated = parse_args([*base, "--dp-size", "2", "--colocate", "--rollout-num-engines", "2"])
    check_gpus_fit(colocated, 2.0)
    with pytest.raises(ValueError, match=r"--colocate puts rank i .* --dp-size 2 needs 2 GPUs .* has 1"):
        check_gpus_fit(colocated, 1.0)
    with pytest.raises(ValueError, match=r"lower --dp-size x --sp-size to at most 1"):
        check_gpus_fit(parse_args([*base, "--dp-size", "2"]), 1.0)
    check_gpus_fit(parse_args([*base, "--dp-size", "2"]), 4.0)
    check_gpus_fit(parse_args([*base, "--dp-size", "2", "--device", "cpu"]), 0.0)


def test_an_algorithm_without_engines_sizes_no_engine_nor_reward_worker():
    common = ["--hf-checkpoint", "unused", "--cpus-per-rank", "4", "--device", "cpu", "--dp-size", "2"]
    sft = parse_args(["--loss-type", "sft_loss", "--train-only", "--rm-num-workers", "2", *common])
    assert actor_shares(sft, 4.0, 0.5) == (8.0, 0.0)
    assert local_ray_cpus(sft) == max(os.cpu_count() or 1, 8)  # 2 x 4, no 0.5 engine, no 2 x 0.25 workers
    nft = parse_args(["--loss-type", "nft", "--rm-num-workers", "2", *common])
    assert local_ray_cpus(nft) == max(os.cpu_count() or 1, 9)  # 8 + 0.5 + 2 x 0.25


def test_the_groups_started_are_the_declared_roles_unless_nothing_trains(tmp_path):
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", "unused", "--hf-checkpoint", "unused"]
    assert roles_to_start(parse_args(dmd2)) == ["critic", "actor"]  # training order: the critic feeds the actor
    assert roles_to_start(parse_args([*dmd2, "--debug-rollout-only"])) == []
    assert roles_to_start(parse_args([*dmd2, "--eval-only"])) == []  # the pipeline as loaded
    assert roles_to_start(parse_args([*dmd2, "--eval-only", "--load", str(tmp_path)])) == ["critic", "actor"]


def test_the_first_rollouts_compiling_is_the_engines_then_the_trainers(caplog):
    import train_diffusion

    record = {"perf/engine_compile_s": 15.0}
    windows = [{"role": "actor", "perf/compile_s": 90.0}, {"role": "actor", "perf/compile_s": 91.0}, {"role": "x"}]
    with caplog.at_level("INFO", logger="miles.driver"):
        assert train_diffusion.first_compile_seconds(record, windows) == 106.0
    assert "compiled 106.0s in the first rollout (engines 15.0s, then the trainer 91.0s)" in caplog.text
    assert train_diffusion.first_compile_seconds({}, []) == 0.0  # nothing compiled (aot_eager, a cached graph)
