"""Activation checkpointing and hybrid sharding composed with FSDP2, against plain FSDP2 on the same ranks; a
checkpoint carried across mesh shapes."""

from __future__ import annotations

import pytest
import torch

from miles.utils.weight_checksum import checksum_terms
from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs
from tests.fast.backends.fsdp_utils.fsdp_workers import build_model, run_ranks
from tests.fast.backends.fsdp_utils.sharding_workers import checkpointed_gradients


@pytest.fixture(scope="module")
def checkpointing_reports(tiny_pipeline_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("checkpointing")
    (out / "pipeline.txt").write_text(tiny_pipeline_dir)
    return run_ranks(checkpointed_gradients, 2, str(out), timeout=120.0)


def test_gradient_checkpointing_gives_the_same_gradients_at_dp_size_2(checkpointing_reports):
    for report in checkpointing_reports:
        plain, checkpointed = report[False], report[True]
        assert plain["attn_calls"] == 1 and checkpointed["attn_calls"] == 2  # the block really recomputed
        assert plain["grads"].keys() == checkpointed["grads"].keys()
        assert sum(bool(g.abs().sum() > 0) for g in plain["grads"].values()) > len(plain["grads"]) // 2
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(checkpointed["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


HYBRID_JOB = "hybrid-ws4"  # `hybrid_and_plain` on 4 ranks, a background job (rank_jobs.py, tests/background.py)
ON_HYBRID = pytest.mark.background(rank_jobs.SCRIPT, HYBRID_JOB)


@pytest.fixture(scope="module")
def hybrid_reports() -> list[dict]:
    assert rank_jobs.JOBS[HYBRID_JOB][1:3] == ("hybrid_and_plain", 4)
    return rank_jobs.reports(job_folder(rank_jobs.SCRIPT, HYBRID_JOB), HYBRID_JOB)


@ON_HYBRID
def test_hybrid_sharding_2x2_matches_plain_fsdp2_at_dp_size_4(hybrid_reports):
    for report in hybrid_reports:
        assert (report["plain"]["mesh_dims"], report["hybrid"]["mesh_dims"]) == (1, 2)
        assert report["plain"]["norms"] == pytest.approx(report["hybrid"]["norms"], rel=1e-6)
        for name, value in report["plain"]["params"].items():
            torch.testing.assert_close(report["hybrid"]["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
        first = hybrid_reports[0]["hybrid"]["params"]
        assert all(torch.equal(report["hybrid"]["params"][n], v) for n, v in first.items())  # replicas agree


@ON_HYBRID
def test_hybrid_micro_batches_all_reduce_across_replicas_once_per_optimizer_step(hybrid_reports):
    for report in hybrid_reports:
        default, accumulated = report["accumulation"]["every_backward"], report["accumulation"]["accumulated"]
        groups = 4  # three blocks and the root: one all-reduce each per backward by default
        assert (default["all_reduces"], accumulated["all_reduces"]) == (2 * groups, groups)
        assert sum(bool(g.abs().sum() > 0) for g in default["grads"].values()) == len(default["grads"])
        for name, grad in default["grads"].items():
            torch.testing.assert_close(accumulated["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@ON_HYBRID
def test_the_frozen_weight_digest_counts_one_copy_whatever_the_shard_size(hybrid_reports):
    """2 replicas x 2 shards and plain FSDP2 over 4 give the digest of the unsharded model (not twice its sums)."""
    model = build_model(0)
    frozen = [p.detach() for m in (model.blocks[0], model.head) for p in m.parameters()]
    words = int(sum(checksum_terms([p])[0] for p in frozen))
    expected = {"tensors": len(frozen), "elements": sum(p.numel() for p in frozen), "words": words}
    for report in hybrid_reports:
        assert report["frozen_digest"] == {"plain": expected, "hybrid": expected}


@ON_HYBRID
def test_checkpoint_saved_at_2x2_resumes_under_plain_fsdp2(hybrid_reports):
    for report in hybrid_reports:
        for name, value in report["hybrid"]["params"].items():
            assert torch.equal(report["resumed_params"][name], value), name
        for name, value in report["hybrid_third_step"].items():  # optimizer and schedule came along too
            torch.testing.assert_close(report["resumed_third_step"][name], value, rtol=1e-6, atol=1e-7, msg=name)


COMPILE_JOB = "compile-ws2"  # `compiled_gradients` on 2 ranks, a background job: 4 min cold, 64 s warm cache
# Compiled vs eager blocks under FSDP2 at dp 2 (inductor reorders fp32 sums), measured on this machine 2026-12-04:
# velocity 8.5e-6 apart; each gradient within 3.5e-6 of its own largest entry (to_q / to_k biases; |g| up to 68)
COMPILED_VELOCITY_TOLERANCE = 5e-5
COMPILED_GRAD_TOLERANCE = 2e-5  # of the tensor's largest |gradient|


@pytest.fixture(scope="module")
def compile_reports() -> list[dict]:
    assert rank_jobs.JOBS[COMPILE_JOB][1:3] == ("compiled_gradients", 2)
    return rank_jobs.reports(job_folder(rank_jobs.SCRIPT, COMPILE_JOB), COMPILE_JOB)


@pytest.mark.background(rank_jobs.SCRIPT, COMPILE_JOB)
def test_compiled_blocks_under_fsdp2_and_checkpointing_match_eager_at_dp_size_2(compile_reports):
    for report in compile_reports:
        eager = report["eager"]
        assert sum(bool(g.abs().sum() > 0) for g in eager["grads"].values()) > len(eager["grads"]) // 2
        for name in ("blocks", "ac"):
            compiled = report[name]
            assert compiled["names"] == eager["names"] and compiled["keys"] == eager["keys"]  # no `_orig_mod.`
            diff = (compiled["velocity"] - eager["velocity"]).abs().max().item()
            assert diff <= COMPILED_VELOCITY_TOLERANCE, (name, diff)
            for key, grad in eager["grads"].items():
                bound = COMPILED_GRAD_TOLERANCE * grad.abs().max().item()
                assert (compiled["grads"][key] - grad).abs().max().item() <= bound, (name, key)
            # the second call, with 3 rows per rank instead of 4, reused the compiled code
            assert compiled["after_second"] == compiled["after_first"], name
        assert eager["after_second"]["compile_s"] == 0 < report["blocks"]["after_first"]["compile_s"]
