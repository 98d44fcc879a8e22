"""The driver's side of `--monitor-action` (docs/user-guide/rewards.md, "Guards"): after each rollout, the trips of
the drift monitors and of the proxy-gold divergence monitor, the guard's decision (`miles.rollout.guard`), and its
rollback on the run's groups: every role restores its checkpoint, the save folders' latest pointers move back to it,
and the engines get the restored weights."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from miles.algorithms import training_order
from miles.ray.checkpoint_folders import save_folders, write_latest_pointers
from miles.rollout.guard import GOLD_KEY, PROXY_GOLD, PROXY_KEY, Decision, Guard, ProxyGoldWatch, Trip

logger = logging.getLogger(__name__)

TRIPPED_KEY, ROLLBACKS_KEY, ROLLBACK_TO_KEY = "monitor/tripped", "monitor/rollbacks", "monitor/rollback_to"


class RunGuard:
    """The guard of one attempt of the run (`RunGroups`): `observe_eval` each eval, `after_rollout` each rollout;
    `stopped` holds the line of a stop it decided (the driver ends the run after the rollout)."""

    def __init__(self, args: argparse.Namespace, run_groups: Any, start_rollout_id: int) -> None:
        self.args, self.run_groups, self.guard = args, run_groups, Guard.from_args(args)
        flags = self.guard.flags
        self.proxy_gold = (
            ProxyGoldWatch(flags.monitor_gold_margin, flags.monitor_gold_window) if flags.gold_rm_type else None
        )
        self.pending: list[Trip] = []  # the proxy-gold trips of the evals since the last rollout
        self.warned: set[str] = set()  # under `warn`, the proxy-gold trip is warned about once per run
        self.stopped: str | None = None
        manager = run_groups.rollout_manager
        # weights version -> the last rollout trained into those weights; the engines' first sync holds the starting
        # ones (INITIAL, -1, on a fresh start)
        self.versions: dict[int, int] = {manager.weights_version: start_rollout_id - 1}
        if run_groups.saved is not None:  # resumed from its own save folders: that checkpoint is a rollback target
            self.guard.saved.append(run_groups.saved)

    def observe_eval(self, metrics: dict[str, float]) -> None:
        """An eval's record: the proxy-gold monitor's next point (`eval/rollouts_trained` rollouts trained)."""
        if self.proxy_gold is None or PROXY_KEY not in metrics:
            return
        trip = self.proxy_gold.observe(int(metrics["eval/rollouts_trained"]), metrics[PROXY_KEY], metrics[GOLD_KEY])
        if trip is not None:
            self.pending.append(trip)

    def after_rollout(self, rollout_id: int, record: dict[str, Any]) -> dict[str, float]:
        """The rollout's trips and the guard's action on them (its record was saved, synced and evaluated); the
        `monitor/*` metrics of the action (none under `warn`, whose rollout records stay as they were)."""
        if "perf/save_s" in record:
            self.guard.saved.append(rollout_id)
        self.versions[self.run_groups.rollout_manager.weights_version] = rollout_id
        trips, self.pending = [*self._drift_trips(rollout_id, record), *self.pending], []
        self._warn(trips)
        decision = self.guard.decide(trips)
        if decision is not None:
            self._act(decision, rollout_id)
        if self.guard.flags.monitor_action == "warn":
            return {}
        metrics: dict[str, float] = {TRIPPED_KEY: len(trips), ROLLBACKS_KEY: self.guard.rollbacks}
        if decision is not None and decision.restore is not None:
            metrics[ROLLBACK_TO_KEY] = decision.restore
        return metrics

    def _drift_trips(self, rollout_id: int, record: dict[str, Any]) -> list[Trip]:
        """The drift monitors' conditions that held at this rollout, each from the weights that generated its batch."""
        held = self.run_groups.rollout_manager.drift.pop_held(rollout_id)
        version = record.get("rollout/weights_version")
        evidence = self.versions.get(version, rollout_id - 1) if version is not None else rollout_id - 1
        return [Trip(monitor, detail, rollout_id, evidence) for monitor, detail in held]

    def _warn(self, trips: list[Trip]) -> None:
        """Under `warn`: the proxy-gold trip's line, once per run (the drift monitors warn for themselves)."""
        if self.guard.flags.monitor_action != "warn" or PROXY_GOLD in self.warned:
            return
        for trip in trips:
            if trip.monitor == PROXY_GOLD:
                self.warned.add(PROXY_GOLD)
                logger.warning(
                    "%s; the policy may be hacking the trained reward (warned once per run)", trip.describe()
                )

    def _act(self, decision: Decision, rollout_id: int) -> None:
        logger.warning("rollout %d: %s", rollout_id, decision.line)
        if decision.restore is not None:
            self.rollback(decision.restore, decision.lr_factor, rollout_id)
        if decision.stop:
            self.stopped = decision.line

    def rollback(self, target: int, lr_factor: float, rollout_id: int) -> None:
        """Every role back to its checkpoint of rollout `target` with its learning rate x `lr_factor`; the save
        folders' latest pointers at it (a resume starts there); the engines synced with the restored weights."""
        run_groups = self.run_groups
        run_groups.phases.to_train(rollout_id)  # with --colocate-sleep the ranks sleep after a weight sync
        for group in run_groups.groups.values():
            group.call("rollback", target, lr_factor)
        write_latest_pointers(save_folders(self.args, training_order(self.args)), target)
        run_groups.saved = target
        run_groups.update_weights(rollout_id)
        self.versions[run_groups.rollout_manager.weights_version] = target
        if self.proxy_gold is not None:
            self.proxy_gold.forget_after(target)
