"""`--compile blocks` through the driver: trainer and engines both compiled, so the first step's ratio is exactly 1 and
the train/rollout log-prob difference at fp32 rounding; no recompile from one rollout to the next."""

import os

import pytest

import train_diffusion
from miles.utils.tracking import read_metrics
from tests.e2e.test_policy_loss import LOG_PROB_TOLERANCE, policy_args

pytestmark = pytest.mark.e2e


def compiled_run(pipeline_dir, out, *extra):
    args = policy_args(
        pipeline_dir,
        out,
        "--compile",
        "blocks",
        "--dp-size",
        "1",
        "--diffusion-guidance-scale",
        "4.5",
        "--num-steps-per-rollout",
        "1",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--micro-batch-size",
        "3",  # windows of 4 pairs: micro-batches of 3 and 1 (a specialised batch-1 graph)
        "--image-grid-interval",
        "0",
        *extra,
    )
    train_diffusion.run(args)
    return read_metrics(os.path.join(out, "metrics.jsonl"))


@pytest.mark.standard  # 2.4 min cold on 2 loaded cores (91 s compiling the trainer, 15 s the engine)
def test_compiled_run_has_ratio_one_and_no_recompile_between_rollouts(ray_cluster, tiny_pipeline_dir, tmp_path):
    records = compiled_run(tiny_pipeline_dir, tmp_path)
    windows = [r for r in records if r.get("role") == "actor"]
    rollouts = [r for r in records if "perf/generate_total_s" in r]
    assert windows[0]["train/log_prob_abs_diff"] <= LOG_PROB_TOLERANCE["fp32"]
    assert abs(windows[0]["train/ratio_mean"] - 1.0) <= 1e-6
    assert windows[0]["train/clipfrac"] == 0.0
    # both sides compiled something, and rollout 1 compiled nothing new on either side
    assert windows[0]["perf/compile_s"] > 0 and rollouts[0]["perf/engine_compile_s"] > 0
    assert windows[1]["perf/compile_recompiles"] == windows[0]["perf/compile_recompiles"]
    assert rollouts[1]["perf/engine_compile_recompiles"] == rollouts[0]["perf/engine_compile_recompiles"]
    assert windows[1]["perf/compile_s"] == windows[0]["perf/compile_s"]
    # the start-up's compiling, done in the first rollout's phases, recorded there only
    first = rollouts[0]["perf/engine_compile_s"] + windows[0]["perf/compile_s"]
    assert rollouts[0]["perf/startup_compile_s"] == pytest.approx(first)
    assert "perf/startup_compile_s" not in rollouts[1]
