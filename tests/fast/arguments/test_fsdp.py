"""The sharding and precision rules of `validate_fsdp_args`, through `parse_args`."""

import pytest

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE, parse_error

POLICY = BASE + ["--loss-type", "policy_loss"]


@pytest.mark.parametrize("dest", ["--diffusion-forward-dtype", "--fsdp-reduce-dtype"])
def test_fp16_is_refused_with_the_reason(dest, capsys):
    err = parse_error(POLICY + [dest, "fp16", "--diffusion-recompute-old-log-prob"], capsys)
    assert f"{dest} fp16 is not supported" in err and "gradient scaler" in err


def test_bf16_policy_loss_requires_the_recompute(capsys):
    err = parse_error(POLICY + ["--diffusion-forward-dtype", "bf16"], capsys)
    assert "requires --diffusion-recompute-old-log-prob" in err
    args = parse_args(POLICY + ["--diffusion-forward-dtype", "bf16", "--diffusion-recompute-old-log-prob"])
    assert args.diffusion_forward_dtype == "bf16"


def test_bf16_without_a_log_prob_ratio_needs_no_recompute():
    args = parse_args(BASE + ["--loss-type", "nft", "--diffusion-forward-dtype", "bf16"])
    assert args.diffusion_forward_dtype == "bf16"


def test_bf16_master_weights_need_a_bf16_forward(capsys):
    err = parse_error(BASE + ["--loss-type", "nft", "--fsdp-master-dtype", "bf16"], capsys)
    assert "--fsdp-master-dtype bf16 with --diffusion-forward-dtype fp32" in err
    args = parse_args(BASE + ["--loss-type", "nft", "--fsdp-master-dtype", "bf16", "--diffusion-forward-dtype", "bf16"])
    assert args.fsdp_master_dtype == "bf16"


def test_cpu_offload_needs_cuda(capsys):
    assert "--fsdp-cpu-offload" in parse_error(BASE + ["--fsdp-cpu-offload", "--device", "cpu"], capsys)


def test_shard_size_must_divide_dp_size(capsys):
    err = parse_error(BASE + ["--dp-size", "4", "--fsdp-shard-size", "3"], capsys)
    assert "--fsdp-shard-size 3 must divide the trainer's ranks, --dp-size x --sp-size = 4" in err
    assert "--fsdp-shard-size" in parse_error(BASE + ["--dp-size", "4", "--fsdp-shard-size", "0"], capsys)


def test_shard_size_dividing_dp_size_is_accepted():
    assert parse_args(BASE + ["--dp-size", "4", "--fsdp-shard-size", "2"]).fsdp_shard_size == 2


def test_shard_size_divides_the_ranks_of_data_and_sequence_parallelism_together(capsys):
    assert parse_args(BASE + ["--dp-size", "1", "--sp-size", "4", "--fsdp-shard-size", "2"]).fsdp_shard_size == 2
    err = parse_error(BASE + ["--dp-size", "2", "--sp-size", "3", "--fsdp-shard-size", "4"], capsys)
    assert "--dp-size x --sp-size = 6" in err


def test_sp_size_must_be_at_least_one_and_is_refused_with_colocate(capsys):
    assert parse_args(BASE).sp_size == 1
    assert "--sp-size" in parse_error(BASE + ["--sp-size", "0"], capsys)
    err = parse_error(BASE + ["--sp-size", "2", "--colocate"], capsys)
    assert "--sp-size 2 with --colocate" in err


def test_auto_device_and_dtype_follow_the_cluster_gpus():
    from miles.arguments.fsdp import resolve_device_defaults

    args = parse_args(POLICY + ["--ray-address", "10.0.0.1:6379"])  # a cluster: left to the driver
    assert (args.device, args.diffusion_forward_dtype, args.diffusion_recompute_old_log_prob) == ("auto", "auto", False)
    resolve_device_defaults(args, cluster_gpus=8)
    assert (args.device, args.diffusion_forward_dtype, args.diffusion_recompute_old_log_prob) == ("cuda", "bf16", True)
    nft = parse_args(BASE + ["--loss-type", "nft", "--ray-address", "10.0.0.1:6379"])
    resolve_device_defaults(nft, cluster_gpus=8)
    assert (nft.diffusion_forward_dtype, nft.diffusion_recompute_old_log_prob) == ("bf16", False)  # no ratio
    cpu = parse_args(POLICY + ["--ray-address", "10.0.0.1:6379"])
    resolve_device_defaults(cpu, cluster_gpus=0)
    assert (cpu.device, cpu.diffusion_forward_dtype, cpu.diffusion_recompute_old_log_prob) == ("cpu", "fp32", False)
    chosen = parse_args(POLICY + ["--ray-address", "x:1", "--diffusion-forward-dtype", "fp32", "--device", "cuda"])
    resolve_device_defaults(chosen, cluster_gpus=8)
    assert (chosen.device, chosen.diffusion_forward_dtype) == ("cuda", "fp32")  # what the user set stays


def test_a_local_run_resolves_auto_at_parse_time_from_this_machine():
    args = parse_args(POLICY)
    assert args.device in ("cpu", "cuda") and args.diffusion_forward_dtype == (
        "bf16" if args.device == "cuda" else "fp32"
    )


def test_cluster_rules_that_wait_for_the_device_run_after_it_is_known():
    from miles.arguments.fsdp import resolve_cluster_device

    args = parse_args(BASE + ["--loss-type", "nft", "--ray-address", "x:1", "--fsdp-master-dtype", "bf16"])
    with pytest.raises(ValueError, match="--fsdp-master-dtype bf16 with --diffusion-forward-dtype fp32"):
        resolve_cluster_device(args, cluster_gpus=0)  # no GPUs: fp32 forward, which bf16 masters cannot serve
    ok = parse_args(BASE + ["--loss-type", "nft", "--ray-address", "x:1", "--fsdp-master-dtype", "bf16"])
    resolve_cluster_device(ok, cluster_gpus=4)
    assert ok.diffusion_forward_dtype == "bf16"


def test_compile_full_is_refused_at_dp_above_one_and_with_checkpointing(capsys):
    full = BASE + ["--compile", "full", "--dp-size", "1"]
    err = parse_error(BASE + ["--compile", "full", "--dp-size", "2"], capsys)
    assert (
        "--compile full needs one trainer rank (got --dp-size x --sp-size = 2)" in err and "use --compile blocks" in err
    )
    assert "--compile full with --gradient-checkpointing" in parse_error(full + ["--gradient-checkpointing"], capsys)
    assert parse_args(full).compile == "full"
    assert parse_args(BASE + ["--compile", "blocks", "--dp-size", "2", "--gradient-checkpointing"]).compile == "blocks"
    assert parse_args(BASE).compile == "off"
    assert "--compile blocks with --sp-size 2" in parse_error(BASE + ["--compile", "blocks", "--sp-size", "2"], capsys)
