"""Guards that act (docs/user-guide/rewards.md, "Guards"): the proxy-gold divergence monitor, the trips of the
monitors, and what `--monitor-action` does about them (warn, stop, or roll back to a checkpoint). Pure decisions:
the driver (`miles.ray.monitor_guard`) carries them out."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from miles.arguments.records import FlagRecord

PROXY_KEY, GOLD_KEY = "eval/proxy_reward", "eval/gold_reward"  # the eval's two scores (miles.rollout.eval_rewards)
PROXY_GOLD = "proxy-gold divergence"
INITIAL = -1  # the rollout "trained" by the weights the run started with: no checkpoint precedes them


@dataclass(frozen=True)
class GuardFlags(FlagRecord):
    """The flags of the guard (`add_monitor_arguments`)."""

    monitor_action: str  # warn | stop | rollback
    monitor_rollback_lr_factor: float
    monitor_after_rollback: str  # continue | stop
    monitor_max_rollbacks: int
    gold_rm_type: str | None
    monitor_gold_margin: float
    monitor_gold_window: int


@dataclass(frozen=True)
class Trip:
    """A monitor's condition held: `monitor` names it (its flag), `detail` gives the values; `rollout_id` is the
    rollout whose record showed it and `evidence` the last rollout trained into the weights that produced it
    (`INITIAL`: the starting weights), so a rollback restores a checkpoint from before it."""

    monitor: str
    detail: str
    rollout_id: int
    evidence: int

    def describe(self) -> str:
        return f"{self.monitor} at rollout {self.rollout_id}: {self.detail}"


@dataclass
class ProxyGoldWatch:
    """The proxy-gold divergence monitor over the evals: it trips when, against the eval of the highest gold among
    the previous `window` evals, the proxy rose (by any amount) while the gold fell by more than `margin`."""

    margin: float
    window: int
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (rollouts trained, proxy, gold)

    def observe(self, trained: int, proxy: float, gold: float) -> Trip | None:
        """Add the eval after `trained` rollouts (0: the baseline) and return the trip it shows, if any."""
        earlier = self.history[-self.window :]
        self.history.append((trained, proxy, gold))
        if not earlier:
            return None
        ref_trained, ref_proxy, ref_gold = max(earlier, key=lambda entry: entry[2])
        if proxy > ref_proxy and ref_gold - gold > self.margin:
            detail = (
                f"the proxy rose {ref_proxy:.4g} -> {proxy:.4g} while the gold fell {ref_gold:.4g} -> {gold:.4g} "
                f"(by {ref_gold - gold:.4g} > --monitor-gold-margin {self.margin:g}) since the eval after "
                f"{ref_trained} rollouts"
            )
            return Trip(PROXY_GOLD, detail, trained - 1, trained - 1)
        return None

    def forget_after(self, rollout_id: int) -> None:
        """Drop the evals of weights trained past `rollout_id` (a rollback restored that rollout's checkpoint)."""
        self.history = [entry for entry in self.history if entry[0] <= rollout_id + 1]


def rollback_target(saved: list[int], evidence: int) -> int | None:
    """The latest saved rollout before `evidence` (the weights that tripped came after it); None when none is."""
    return max((rollout for rollout in saved if rollout < evidence), default=None)


@dataclass(frozen=True)
class Decision:
    """What the guard does after a rollout: `restore` a checkpoint (rollout id, or None), then `stop` the run or go
    on at `lr_factor` times the learning rate; `line` says it in the log."""

    restore: int | None
    stop: bool
    lr_factor: float
    line: str


@dataclass
class Guard:
    """The decisions of `--monitor-action` over the run: trips counted, checkpoints saved (the rollback targets),
    rollbacks done."""

    flags: GuardFlags
    saved: list[int] = field(default_factory=list)
    rollbacks: int = 0
    trips: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Guard:
        return cls(GuardFlags.from_args(args))

    def decide(self, trips: list[Trip]) -> Decision | None:
        """The action on this rollout's trips (None: nothing to do, or `warn`, whose lines the monitors log)."""
        if not trips:
            return None
        self.trips += len(trips)
        flags, what = self.flags, "; ".join(trip.describe() for trip in trips)
        if flags.monitor_action == "warn":
            return None
        if flags.monitor_action == "stop":
            return Decision(None, True, 1.0, f"--monitor-action stop: {what}; stopping the run (checkpoints kept)")
        target = rollback_target(self.saved, min(trip.evidence for trip in trips))
        if target is None:
            before = min(trip.evidence for trip in trips)
            why = "no checkpoint was saved before the weights that tripped" + (
                "" if before == INITIAL else f" (trained through rollout {before})"
            )
            return Decision(None, True, 1.0, f"--monitor-action rollback: {what}; {why}: stopping the run instead")
        return self._rollback(target, what)

    def _rollback(self, target: int, what: str) -> Decision:
        flags = self.flags
        self.rollbacks += 1
        self.saved = [rollout for rollout in self.saved if rollout <= target]  # later saves hold undone training
        spent = self.rollbacks > flags.monitor_max_rollbacks
        if flags.monitor_after_rollback == "stop" or spent:
            why = (
                "--monitor-after-rollback stop"
                if not spent
                else f"--monitor-max-rollbacks {flags.monitor_max_rollbacks} spent"
            )
            line = (
                f"--monitor-action rollback: {what}; restored the checkpoint of rollout {target} and stopping ({why})"
            )
            return Decision(target, True, 1.0, line)
        factor = flags.monitor_rollback_lr_factor
        line = (
            f"--monitor-action rollback {self.rollbacks} of --monitor-max-rollbacks {flags.monitor_max_rollbacks}: "
            f"{what}; restored the checkpoint of rollout {target}, going on with the learning rate x {factor:g}"
        )
        return Decision(target, False, factor, line)
