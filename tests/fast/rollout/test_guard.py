"""The guard's decisions on planted series: the proxy-gold divergence monitor trips when the proxy rises while the
gold falls by more than the margin below the best recent eval, and not otherwise; `--monitor-action` warns, stops,
or rolls back to the last checkpoint before the weights that tripped (then continues at a lower learning rate, or
stops once the rollbacks are spent)."""

from __future__ import annotations

import pytest

from miles.arguments.parser import default_args
from miles.rollout.guard import INITIAL, PROXY_GOLD, Guard, GuardFlags, ProxyGoldWatch, Trip, rollback_target


def flags(**overrides) -> GuardFlags:
    return GuardFlags.from_args(default_args(**overrides))


def observe(watch: ProxyGoldWatch, series: list[tuple[float, float]]) -> list[Trip | None]:
    """The watch's answers to evals after 0, 1, 2, ... rollouts of the planted (proxy, gold) series."""
    return [watch.observe(trained, proxy, gold) for trained, (proxy, gold) in enumerate(series)]


def test_a_diverging_proxy_trips_at_the_first_eval_past_the_margin():
    # the gold peaks after 2 rollouts (0.60) and falls; the proxy rises throughout: 0.60 - 0.57 = 0.03 is within the
    # margin, 0.60 - 0.52 = 0.08 is past it
    series = [(0.1, 0.50), (0.2, 0.55), (0.3, 0.60), (0.4, 0.57), (0.5, 0.52)]
    trips = observe(ProxyGoldWatch(margin=0.05, window=3), series)
    assert trips[:4] == [None] * 4
    trip = trips[4]
    assert (trip.monitor, trip.rollout_id, trip.evidence) == (PROXY_GOLD, 3, 3)  # the eval after 4 rollouts
    assert "0.3 -> 0.5" in trip.detail and "0.6 -> 0.52" in trip.detail and "--monitor-gold-margin 0.05" in trip.detail
    assert "since the eval after 2 rollouts" in trip.detail


@pytest.mark.parametrize(
    ("series", "why"),
    [
        ([(0.2, 0.6), (0.1, 0.5), (0.05, 0.4)], "the proxy fell with the gold: a worse policy, not hacking"),
        ([(0.1, 0.6), (0.2, 0.58), (0.3, 0.56)], "the gold fell 0.04, within the margin"),
        ([(0.1, 0.6), (0.2, 0.7), (0.3, 0.8)], "both rose"),
        ([(0.1, 0.6), (0.05, 0.5), (0.08, 0.4)], "the gold fell but the proxy stayed below the best gold's eval"),
    ],
)
def test_no_trip_without_divergence(series, why):
    assert observe(ProxyGoldWatch(margin=0.05, window=3), series) == [None] * len(series), why


def test_the_window_bounds_the_evals_compared_with():
    series = [(0.1, 0.9), (0.2, 0.5), (0.3, 0.5), (0.4, 0.5)]  # the gold's peak is 3 evals before the last
    assert observe(ProxyGoldWatch(margin=0.05, window=2), series)[3] is None
    assert observe(ProxyGoldWatch(margin=0.05, window=3), series)[3] is not None


def test_a_rollback_forgets_the_evals_of_undone_training():
    watch = ProxyGoldWatch(margin=0.05, window=3)
    observe(watch, [(0.1, 0.5), (0.2, 0.6), (0.3, 0.5), (0.4, 0.4)])
    watch.forget_after(0)  # the checkpoint of rollout 0: the weights the eval after 1 rollout scored
    assert [entry[0] for entry in watch.history] == [0, 1]


def test_the_rollback_target_is_the_last_checkpoint_before_the_evidence():
    assert rollback_target([0, 2, 4, 6], evidence=5) == 4
    assert rollback_target([0, 2, 4, 6], evidence=4) == 2  # iter 4 holds the weights that tripped
    assert rollback_target([3], evidence=3) is None
    assert rollback_target([], evidence=INITIAL) is None


DIVERGED = Trip(PROXY_GOLD, "the proxy rose 0.3 -> 0.5 while the gold fell 0.6 -> 0.52", rollout_id=5, evidence=5)


def test_warn_decides_nothing_and_stop_names_the_monitor_and_its_values():
    warn = Guard(flags())
    assert warn.decide([DIVERGED]) is None and warn.trips == 1
    assert Guard(flags(monitor_action="stop")).decide([]) is None
    decision = Guard(flags(monitor_action="stop")).decide([DIVERGED])
    assert decision.stop and decision.restore is None
    assert "--monitor-action stop: proxy-gold divergence at rollout 5: the proxy rose 0.3 -> 0.5" in decision.line


def test_rollback_restores_the_last_checkpoint_before_the_trip_and_lowers_the_learning_rate():
    guard = Guard(flags(monitor_action="rollback", monitor_rollback_lr_factor=0.25), saved=[1, 3, 5])
    decision = guard.decide([DIVERGED])
    assert (decision.restore, decision.stop, decision.lr_factor) == (3, False, 0.25)
    assert "restored the checkpoint of rollout 3, going on with the learning rate x 0.25" in decision.line
    assert guard.saved == [1, 3] and guard.rollbacks == 1  # iter 5 holds the undone training: never a target


def test_rollback_without_an_earlier_checkpoint_stops_and_says_why():
    decision = Guard(flags(monitor_action="rollback"), saved=[5]).decide([DIVERGED])
    assert decision.stop and decision.restore is None
    assert "no checkpoint was saved before the weights that tripped (trained through rollout 5)" in decision.line
    first = Trip("--monitor-image-drift", "monitor/x0_brightness_mean drifted", rollout_id=0, evidence=INITIAL)
    assert "tripped: stopping the run instead" in Guard(flags(monitor_action="rollback")).decide([first]).line


def test_rollbacks_stop_once_spent_or_when_asked_to():
    guard = Guard(flags(monitor_action="rollback", monitor_max_rollbacks=1), saved=[0, 1, 2, 3, 4])
    assert guard.decide([DIVERGED]).stop is False
    later = Trip(PROXY_GOLD, "again", rollout_id=8, evidence=8)
    spent = guard.decide([later])
    assert (spent.restore, spent.stop) == (4, True) and "--monitor-max-rollbacks 1 spent" in spent.line
    asked = Guard(flags(monitor_action="rollback", monitor_after_rollback="stop"), saved=[2]).decide([DIVERGED])
    assert (asked.restore, asked.stop) == (2, True) and "--monitor-after-rollback stop" in asked.line


def test_several_trips_roll_back_before_the_earliest_evidence():
    drift = Trip("--monitor-norm-drift", "monitor/x0_norm_mean drifted", rollout_id=5, evidence=3)
    decision = Guard(flags(monitor_action="rollback"), saved=[1, 2, 3, 4]).decide([DIVERGED, drift])
    assert decision.restore == 2
    assert (
        "proxy-gold divergence at rollout 5" in decision.line and "--monitor-norm-drift at rollout 5" in decision.line
    )
