"""Golden metric series: short fixed-seed runs of every loss type at dp size 2 reproduce a committed fixture bit for bit.

A refactor that must not change numbers proves itself here. When a change of numbers is intended (a new random
stream, a new metric), re-record with `python tests/e2e/test_golden.py --record` and say in the commit which keys
changed and why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
FIXTURE = Path(__file__).with_name("golden_metric_series.json")
HOOKS = "miles.backends.fsdp_utils.loss_hub.flow_grpo"
COMMON = [
    "--hf-checkpoint",
    "builtin:tiny-shapes",
    "--prompt-data",
    "builtin:shapes",
    "--dp-size",
    "2",
    "--num-rollout",
    "2",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--diffusion-num-steps",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-interval",
    "0",
    "--image-grid-interval",
    "0",
    "--rollout-seed",
    "3",
    "--seed",
    "5",
    "--no-progress",
    "--log-level",
    "WARNING",
]
RUNS: dict[str, list[str]] = {
    "sft_loss": [
        "--loss-type",
        "sft_loss",
        "--train-only",
        "--rollout-batch-size",
        "8",
        "--num-steps-per-rollout",
        "2",
        "--lr",
        "1e-3",
    ],
    "policy_loss": [
        "--loss-type",
        "policy_loss",
        "--num-steps-per-rollout",
        "2",
        "--diffusion-num-sde-steps",
        "2",
        "--lr",
        "1e-4",
        "--diffusion-recompute-old-log-prob",
    ],
    "nft": [
        "--loss-type",
        "nft",
        "--num-steps-per-rollout",
        "2",
        "--lr",
        "1e-4",
        "--use-ema",
        "--ref-mode",
        "ema",
        "--diffusion-nft-kl-beta",
        "0.1",
    ],
    "dmd2": [
        "--loss-type",
        "dmd2",
        "--teacher-load",
        "builtin:tiny-shapes",
        "--dmd2-generator-steps",
        "2",
        "--dmd2-critic-updates-per-step",
        "2",
        "--num-steps-per-rollout",
        "1",
        "--lr",
        "1e-4",
        "--diffusion-guidance-scale",
        "1.0",
    ],
    "custom_loss": [
        "--loss-type",
        "custom_loss",
        "--custom-prepare-train-batch-path",
        f"{HOOKS}.prepare_policy_batch",
        "--custom-loss-function-path",
        f"{HOOKS}.policy_formula",
        "--num-steps-per-rollout",
        "1",
        "--diffusion-num-sde-steps",
        "2",
        "--lr",
        "1e-4",
    ],
}


# nft with each batch generated while the previous one trains (one update stale): the async path's own series
RUNS["nft_async"] = [*RUNS["nft"], "--async-rollout"]


def series(metrics_path: str) -> list[dict]:
    """Every record of a run without its timings (perf/*), which differ from run to run."""
    from miles.utils.tracking import read_metrics

    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in read_metrics(metrics_path)]


def run_series(loss_type: str, out: str, *extra: str) -> list[dict]:
    import train_diffusion
    from miles.utils.arguments import parse_args

    train_diffusion.run(parse_args([*COMMON, *RUNS[loss_type], "--output-dir", out, *extra]))
    return series(os.path.join(out, "metrics.jsonl"))


# Runs that must not change a bit either: the engines and trainer ranks taking turns on the device's memory
# (--colocate-sleep; on CPU the same sleeps and wakes run): nft holds EMA and old-policy shadows, dmd2 a frozen
# teacher and a second trained group, placed with the engine in one shared placement group (--colocate).
VARIANTS = {"nft": ("--colocate-sleep", "on"), "dmd2": ("--colocate", "--colocate-sleep", "on")}
CASES = [(loss, ()) for loss in sorted(RUNS)] + [(loss, flags) for loss, flags in VARIANTS.items()]


@pytest.mark.parametrize("loss_type,extra", CASES, ids=[" ".join((loss, *flags)) for loss, flags in CASES])
def test_metric_series_match_the_recorded_fixture(ray_cluster, tmp_path, loss_type, extra):
    expected = json.loads(FIXTURE.read_text())[loss_type]
    got = run_series(loss_type, str(tmp_path), *extra)
    if extra:  # the variant really ran: every rollout record times its sleeps and wakes
        from miles.utils.tracking import read_metrics

        rollouts = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "perf/generate_total_s" in m]
        assert len(rollouts) == 2 and all(m["perf/colocate_swap_s"] > 0 for m in rollouts)
    assert len(got) == len(expected), f"{loss_type}: {len(got)} records, fixture has {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{loss_type} record {i} differs: " + ", ".join(
            f"{k}: {g.get(k)!r} != {e.get(k)!r}" for k in sorted(set(g) | set(e)) if g.get(k) != e.get(k)
        )


def record(names: list[str]) -> None:
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for name in names or sorted(RUNS):
            with tempfile.TemporaryDirectory() as out:
                fixture[name] = run_series(name, out)
            FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
            print(f"recorded {name}: {len(fixture[name])} records", file=sys.stderr)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/e2e/test_golden.py --record [LOSS_TYPE ...]")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    record(sys.argv[2:])
