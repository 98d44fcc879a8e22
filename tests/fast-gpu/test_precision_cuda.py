"""bf16 on CUDA: the trainer's first step matches the engines' log-probs as in fp32 when FSDP2 shards the blocks as
groups of their own (CPU offload, which does so at world size 1 too, and dp 2 where the GPUs allow)."""

import os

import pytest

pytestmark = pytest.mark.gpu
BRIGHTNESS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "rewards.py") + ":brightness"


def first_window(pipeline_dir, out, *extra):
    import train_diffusion
    from miles.arguments.parser import parse_args
    from miles.utils.tracking import read_metrics

    args = [
        "--hf-checkpoint",
        pipeline_dir,
        "--resolution",
        "32",
        "--prompt-data",
        "builtin:shapes",
        "--device",
        "cuda",
        "--loss-type",
        "policy_loss",
        "--custom-rm-path",
        BRIGHTNESS,
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--diffusion-num-steps",
        "4",
        "--diffusion-num-sde-steps",
        "2",
        "--diffusion-guidance-scale",
        "1.0",
        "--micro-batch-size",
        "2",
        "--diffusion-forward-dtype",
        "bf16",
        "--diffusion-recompute-old-log-prob",
        "--eval-interval",
        "0",
        "--image-grid-interval",
        "0",
        "--no-progress",
        "--log-level",
        "WARNING",
        "--output-dir",
        str(out),
        *extra,
    ]
    train_diffusion.run(parse_args(args))
    return next(m for m in read_metrics(os.path.join(out, "metrics.jsonl")) if m.get("role") == "actor")


def test_bf16_first_step_matches_the_engines_with_blocks_as_groups_on_cuda(ray_cluster, tiny_flux_dev_dir, tmp_path):
    gpus = ray_cluster.cluster_resources().get("GPU", 0)
    if gpus < 1:
        pytest.skip("the test's Ray cluster sees no GPU")
    one_gpu = ["--dp-size", "1", "--gpus-per-rank", "0.5", "--rollout-gpus-per-engine", "0.5"]
    runs = {
        "dp1": first_window(tiny_flux_dev_dir, tmp_path / "dp1", *one_gpu),
        "dp1-offload": first_window(tiny_flux_dev_dir, tmp_path / "offload", *one_gpu, "--fsdp-cpu-offload"),
    }
    if gpus >= 3:  # NCCL refuses two ranks on one GPU: a GPU per rank, and the engine's share of a third
        two = ["--dp-size", "2", "--gpus-per-rank", "1", "--rollout-gpus-per-engine", "0.5", "--fsdp-cpu-offload"]
        runs["dp2-offload"] = first_window(tiny_flux_dev_dir, tmp_path / "dp2", *two)
    for window in runs.values():  # the fp32 bound of tests/e2e/test_family_contract.py
        assert window["train/log_prob_abs_diff"] <= 1e-6, runs
        assert window["train/clipfrac"] == 0.0 and window["train/ratio_mean"] == 1.0, runs
    for name, window in runs.items():
        assert window["train/grad_norm"] == pytest.approx(runs["dp1"]["train/grad_norm"], rel=2**-7), (name, runs)
