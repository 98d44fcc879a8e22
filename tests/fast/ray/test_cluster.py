"""The driver's cluster sizing and start-up decisions (no Ray cluster started)."""

import argparse
import os
import socket

import pytest

from miles.algorithms import DEFAULT_LOSS_TYPE
from miles.arguments.parser import default_args, parse_args
from miles.ray.cluster import (
    ClusterFlags,
    actor_gpus,
    actor_shares,
    check_gpus_fit,
    check_reachable,
    local_ray_cpus,
)
from miles.ray.groups import RunFlags, roles_to_start


def cluster(argv: list[str]) -> ClusterFlags:
    return ClusterFlags.from_args(parse_args(argv))


def test_the_cluster_record_holds_the_sizing_flags_as_parsed():
    defaults = ClusterFlags.from_args(default_args())
    assert (defaults.loss_type, defaults.device, defaults.ray_address) == (DEFAULT_LOSS_TYPE, "auto", None)
    assert (defaults.dp_size, defaults.sp_size, defaults.world_size, defaults.colocate) == (2, 1, 2, False)
    flags = cluster(
        [
            "--hf-checkpoint", "unused", "--loss-type", "policy_loss", "--device", "cuda", "--dp-size", "4",
            "--sp-size", "2", "--gpus-per-rank", "0.5", "--rollout-num-engines", "4", "--rollout-gpus-per-engine",
            "0.25", "--ray-address", "10.0.0.1:6379", "--rm-num-workers", "3", "--cpus-per-rank", "2",
        ]
    )  # fmt: skip
    assert (flags.loss_type, flags.device, flags.ray_address, flags.world_size) == (
        "policy_loss",
        "cuda",
        "10.0.0.1:6379",
        8,
    )
    assert (flags.gpus_per_rank, flags.rollout_num_engines, flags.rollout_gpus_per_engine) == (0.5, 4, 0.25)
    assert (flags.rm_num_workers, flags.cpus_per_rank, flags.colocate) == (3, 2.0, False)
    assert actor_gpus(flags) == 8 * 0.5 + 4 * 0.25  # one actor group of 4 x 2 ranks, four engines
    without_sp = argparse.Namespace(**{k: v for k, v in vars(default_args()).items() if k != "sp_size"})
    with pytest.raises(AttributeError, match="no flag sp_size"):
        ClusterFlags.from_args(without_sp)


def test_a_local_cluster_has_room_for_every_actor_share():
    common = ["--hf-checkpoint", "unused", "--cpus-per-rank", "4", "--device", "cpu"]
    dmd2 = cluster(["--loss-type", "dmd2", "--teacher-load", "unused", "--dp-size", "2", *common])
    # actor and critic groups (2 x 2 x 4) plus one engine's 0.5: Ray would otherwise wait for CPUs forever
    assert local_ray_cpus(dmd2) == max(os.cpu_count() or 1, 17)
    rl = cluster(["--loss-type", "policy_loss", "--dp-size", "1", "--rm-num-workers", "2", *common])
    assert local_ray_cpus(rl) == max(os.cpu_count() or 1, 5)  # 4 + 0.5 + 2 x 0.25


def test_sequence_parallel_ranks_are_counted_in_the_cluster_size():
    common = ["--hf-checkpoint", "unused", "--loss-type", "policy_loss", "--dp-size", "2", "--sp-size", "2"]
    cpu = cluster([*common, "--cpus-per-rank", "4", "--device", "cpu", "--rm-num-workers", "2"])
    assert actor_shares(cpu, 4.0, 0.5) == (16.0, 0.5)  # 2 dp x 2 sp ranks of 4 CPUs; the engine stays whole
    assert local_ray_cpus(cpu) == max(os.cpu_count() or 1, 17)  # 16 + 0.5 + 2 x 0.25
    gpu = cluster([*common, "--device", "cuda"])
    check_gpus_fit(gpu, 5.0)  # 4 ranks + 1 engine
    with pytest.raises(ValueError, match=r"--dp-size 2 x --sp-size 2 x --gpus-per-rank 1.*lower --dp-size x --sp-size"):
        check_gpus_fit(gpu, 3.0)


def test_too_few_gpus_fail_at_once_naming_the_flags():
    base = ["--hf-checkpoint", "unused", "--device", "cuda", "--loss-type", "policy_loss"]
    one_rank = cluster([*base, "--dp-size", "1"])
    with pytest.raises(ValueError, match=r"needs 2 GPUs .* has 1: share them with --colocate"):
        check_gpus_fit(one_rank, 1.0)
    shared = cluster([*base, "--dp-size", "1", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    check_gpus_fit(shared, 1.0)  # one rank per group: a fractional share is safe
    # two ranks at 0.5: Ray would pack both onto one GPU
    packed = cluster([*base, "--dp-size", "2", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"])
    with pytest.raises(ValueError, match=r"ranks of one group would share a GPU, which NCCL refuses.*--colocate"):
        check_gpus_fit(packed, 4.0)
    colocated = cluster([*base, "--dp-size", "2", "--colocate", "--rollout-num-engines", "2"])
    check_gpus_fit(colocated, 2.0)
    with pytest.raises(ValueError, match=r"--colocate puts rank i .* --dp-size 2 needs 2 GPUs .* has 1"):
        check_gpus_fit(colocated, 1.0)
    with pytest.raises(ValueError, match=r"lower --dp-size x --sp-size to at most 1"):
        check_gpus_fit(cluster([*base, "--dp-size", "2"]), 1.0)
    check_gpus_fit(cluster([*base, "--dp-size", "2"]), 4.0)
    check_gpus_fit(cluster([*base, "--dp-size", "2", "--device", "cpu"]), 0.0)


def test_an_algorithm_without_engines_sizes_no_engine_nor_reward_worker():
    common = ["--hf-checkpoint", "unused", "--cpus-per-rank", "4", "--device", "cpu", "--dp-size", "2"]
    sft = cluster(["--loss-type", "sft_loss", "--train-only", "--rm-num-workers", "2", *common])
    assert actor_shares(sft, 4.0, 0.5) == (8.0, 0.0)
    assert local_ray_cpus(sft) == max(os.cpu_count() or 1, 8)  # 2 x 4, no 0.5 engine, no 2 x 0.25 workers
    nft = cluster(["--loss-type", "nft", "--rm-num-workers", "2", *common])
    assert local_ray_cpus(nft) == max(os.cpu_count() or 1, 9)  # 8 + 0.5 + 2 x 0.25


def test_the_groups_started_are_the_declared_roles_unless_nothing_trains(tmp_path):
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", "unused", "--hf-checkpoint", "unused"]

    def roles(*extra: str) -> list[str]:
        return roles_to_start(RunFlags.from_args(parse_args([*dmd2, *extra])))

    assert roles() == ["critic", "actor"]  # training order: the critic feeds the actor
    assert roles("--debug-rollout-only") == []
    assert roles("--eval-only") == []  # the pipeline as loaded
    assert roles("--eval-only", "--load", str(tmp_path)) == ["critic", "actor"]


def test_joining_an_address_where_nothing_listens_fails_at_once_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as server:  # a listening port: joined as given
        port = server.getsockname()[1]
        check_reachable(f"127.0.0.1:{port}")
        check_reachable(f"ray://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"^--ray-address 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} "
                       r"\(Connection refused\); start the cluster there first"):  # fmt: skip
        check_reachable(f"127.0.0.1:{port}")
    for address in ("auto", "local", "no-port"):  # Ray's own lookup, its own error
        check_reachable(address)
