"""The sharding and precision rules of `validate_fsdp_args`, through `parse_args`."""

import pytest

from miles.utils.arguments import parse_args
from tests.fast.utils.test_arguments import BASE, parse_error

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
    assert "--fsdp-shard-size 3 must divide --dp-size 4" in err
    assert "--fsdp-shard-size" in parse_error(BASE + ["--dp-size", "4", "--fsdp-shard-size", "0"], capsys)


def test_shard_size_dividing_dp_size_is_accepted():
    assert parse_args(BASE + ["--dp-size", "4", "--fsdp-shard-size", "2"]).fsdp_shard_size == 2
