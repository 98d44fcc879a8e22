"""The first-window guard fed numbers: within the dtype's bound it passes, outside it fails naming both numbers,
or only warns with --allow-rollout-mismatch; a declaration naming a metric the window lacks is an error."""

import logging

import pytest

from miles.algorithms import FirstWindowMetrics, get_algorithm
from miles.backends.fsdp_utils.first_window_guard import LOG_PROB_BOUNDS, RolloutMismatchError, check_first_window

KEYS = FirstWindowMetrics()


def check(record, dtype="fp32", allow=False, keys=KEYS):
    return check_first_window(record, keys, dtype, allow_mismatch=allow, role="actor", rollout_id=4)


def test_a_first_window_within_the_dtypes_bound_passes():
    assert check({"train/ratio_mean": 1.0, "train/log_prob_abs_diff": 8.9e-8}) is None  # the golden nft-free run
    assert check({"train/ratio_mean": 1.0, "train/log_prob_abs_diff": 2.5e-4}, "bf16") is None  # measured at bf16
    assert LOG_PROB_BOUNDS["fp32"] < 2.5e-4 < LOG_PROB_BOUNDS["bf16"]


@pytest.mark.parametrize(
    ("ratio", "diff", "dtype"),
    [(1.0, 3e-4, "fp32"), (1.0 + 2e-4, 1e-7, "fp32"), (1.0, 0.05, "bf16"), (0.97, 1e-3, "bf16")],
)
def test_a_mismatch_fails_naming_both_numbers(ratio, diff, dtype):
    record = {"train/ratio_mean": ratio, "train/log_prob_abs_diff": diff}
    with pytest.raises(RolloutMismatchError) as info:
        check(record, dtype)
    message = str(info.value)
    assert f"train/ratio_mean = {ratio!r}" in message and f"train/log_prob_abs_diff = {diff!r}" in message
    assert "actor rollout 4" in message and f"--diffusion-forward-dtype {dtype}" in message
    assert f"at most {LOG_PROB_BOUNDS[dtype]:g}" in message and "--allow-rollout-mismatch" in message


def test_allow_rollout_mismatch_only_warns(caplog):
    record = {"train/ratio_mean": 1.0, "train/log_prob_abs_diff": 0.5}
    with caplog.at_level(logging.WARNING, logger="miles.backends.fsdp_utils.first_window_guard"):
        problem = check(record, allow=True)
    assert problem is not None and "train/log_prob_abs_diff = 0.5" in problem
    assert "continuing: --allow-rollout-mismatch" in caplog.text


def test_a_ratio_only_declaration_checks_the_ratio_and_a_missing_metric_is_an_error():
    awm = get_algorithm("awm").first_window_metrics
    assert awm.log_prob_abs_diff is None
    assert check({awm.ratio: 1.0}, keys=awm) is None
    with pytest.raises(RolloutMismatchError, match=r"train/awm_ratio_mean = 1.5;"):
        check({awm.ratio: 1.5}, keys=awm)
    with pytest.raises(KeyError, match=r"\['train/log_prob_abs_diff'\].*first_window_metrics"):
        check({"train/ratio_mean": 1.0})


def test_every_ratio_algorithm_but_plugins_declares_the_guard_and_no_other_can():
    for name in ("policy_loss", "grpo_guard", "flow_dppo", "awm"):
        assert get_algorithm(name).first_window_metrics is not None, name
    for name in ("nft", "sft_loss", "dmd2"):
        assert get_algorithm(name).first_window_metrics is None, name
    from miles.algorithms import Algorithm

    with pytest.raises(ValueError, match="first_window_metrics needs log_prob_ratio"):
        Algorithm(name="x", first_window_metrics=KEYS)
