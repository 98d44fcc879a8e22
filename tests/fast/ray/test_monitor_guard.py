"""The driver's guard on planted series, with stand-in groups: a drift condition or a diverging proxy stops the
run under `--monitor-action stop` with a line naming the monitor and its values; under `rollback` every role restores
the last checkpoint before the weights that tripped with its learning rate lowered, the latest pointers move back
to it and the engines get the restored weights; under `warn` the rollout records stay as they were; the driver's
loop ends after the rollout whose trip stopped the run."""

from __future__ import annotations

import os
import time

import train_diffusion
from miles.arguments.parser import default_args, parse_args
from miles.backends.fsdp_utils.checkpoint import META_FILE, read_latest
from miles.ray.groups import RunGroups
from miles.ray.monitor_guard import ROLLBACK_TO_KEY, ROLLBACKS_KEY, TRIPPED_KEY, RunGuard
from miles.rollout.monitors import DriftWatch, watches
from tests.fast.test_async_rollout import World


class Phases:
    def __init__(self) -> None:
        self.to_train_calls: list[int] = []

    def to_train(self, rollout_id: int) -> None:
        self.to_train_calls.append(rollout_id)


class Group:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call(self, method: str, *args) -> list:
        self.calls.append((method, *args))
        return [None]


class Manager:
    def __init__(self) -> None:
        self.weights_version = 1  # the sync at the start
        self.drift = DriftWatch(watches(image_drift=0.1, norm_drift=0.0, diversity_collapse=0.0))


class Groups:
    """What the guard touches of `RunGroups`: the groups, the manager, the phases, `saved` and the weight sync."""

    def __init__(self) -> None:
        self.groups = {"actor": Group()}
        self.rollout_manager, self.phases, self.saved = Manager(), Phases(), None

    def update_weights(self, rollout_id: int) -> float:
        self.rollout_manager.weights_version += 1
        return 0.0


def save(folder: str, rollout_id: int) -> None:
    """A finished save of the actor at `rollout_id` (as far as the latest pointer checks)."""
    role_dir = os.path.join(folder, f"iter_{rollout_id:07d}", "actor")
    os.makedirs(role_dir)
    open(os.path.join(role_dir, META_FILE), "w").close()


def run(guard: RunGuard, groups: Groups, folder: str, brightness: list[float], evals: dict | None = None) -> list:
    """Rollouts 0, 1, ... with the planted batch-mean brightness, each saved and synced as the driver does; an eval
    after rollout r when `evals` has r. Returns each rollout's guard metrics until the guard stops the run."""
    out = []
    for rollout_id, value in enumerate(brightness):
        record = {"rollout/weights_version": groups.rollout_manager.weights_version, "perf/save_s": 0.1}
        groups.rollout_manager.drift.check(rollout_id, {"monitor/x0_brightness_mean": value})
        save(folder, rollout_id)
        groups.update_weights(rollout_id)
        if evals and rollout_id in evals:
            proxy, gold = evals[rollout_id]
            guard.observe_eval(
                {"eval/rollouts_trained": rollout_id + 1, "eval/proxy_reward": proxy, "eval/gold_reward": gold}
            )
        out.append(guard.after_rollout(rollout_id, record))
        if guard.stopped:
            break
    return out


def args_for(folder: str, **overrides):
    return default_args(save=folder, save_interval=1, **overrides)


def test_stop_ends_after_the_rollout_whose_batch_drifted(tmp_path):
    groups = Groups()
    guard = RunGuard(args_for(str(tmp_path), monitor_action="stop"), groups, 0)
    metrics = run(guard, groups, str(tmp_path), [0.50, 0.55, 0.65, 0.70])
    assert metrics == [{TRIPPED_KEY: 0, ROLLBACKS_KEY: 0}] * 2 + [{TRIPPED_KEY: 1, ROLLBACKS_KEY: 0}]
    assert guard.stopped.startswith("--monitor-action stop: --monitor-image-drift at rollout 2: ")
    assert "monitor/x0_brightness_mean drifted to 0.65 from its first value 0.5" in guard.stopped
    assert groups.groups["actor"].calls == []  # nothing restored


def test_rollback_restores_the_checkpoint_before_the_weights_that_drifted(tmp_path):
    groups, folder = Groups(), str(tmp_path)
    guard = RunGuard(args_for(folder, monitor_action="rollback", monitor_rollback_lr_factor=0.5), groups, 0)
    metrics = run(guard, groups, folder, [0.50, 0.55, 0.60, 0.65, 0.55])
    # rollout 3's batch drifted (0.65): the engines sampled it with the weights trained through rollout 2 (iter 2):
    # the checkpoint before those is iter 1
    assert metrics[3] == {TRIPPED_KEY: 1, ROLLBACKS_KEY: 1, ROLLBACK_TO_KEY: 1}
    assert groups.groups["actor"].calls == [("rollback", 1, 0.5)]
    assert read_latest(folder) == 1 and groups.saved == 1 and groups.phases.to_train_calls == [3]
    assert guard.stopped is None and metrics[4] == {TRIPPED_KEY: 0, ROLLBACKS_KEY: 1}  # back under the threshold
    assert guard.guard.saved == [0, 1, 4]  # iters 2 and 3 hold undone training


def test_a_diverging_proxy_rolls_back_before_the_eval_that_showed_it(tmp_path):
    groups, folder = Groups(), str(tmp_path)
    guard = RunGuard(args_for(folder, monitor_action="rollback", gold_rm_type="shapes"), groups, 0)
    evals = {0: (0.1, 0.5), 1: (0.2, 0.6), 2: (0.3, 0.62), 3: (0.4, 0.5)}
    metrics = run(guard, groups, folder, [0.5] * 5, evals)
    assert [m[TRIPPED_KEY] for m in metrics] == [0, 0, 0, 1, 0]
    assert metrics[3][ROLLBACK_TO_KEY] == 2 and groups.groups["actor"].calls == [("rollback", 2, 0.5)]
    assert [entry[0] for entry in guard.proxy_gold.history] == [1, 2, 3]  # the eval of undone weights dropped


def test_warn_leaves_the_rollout_records_as_they_were(tmp_path, caplog):
    groups = Groups()
    guard = RunGuard(args_for(str(tmp_path), gold_rm_type="shapes"), groups, 0)
    evals = {0: (0.1, 0.5), 1: (0.2, 0.3), 2: (0.3, 0.2)}
    assert run(guard, groups, str(tmp_path), [0.5, 0.5, 0.9], evals) == [{}] * 3
    assert guard.stopped is None and groups.groups["actor"].calls == []
    warned = [r.getMessage() for r in caplog.records if "proxy-gold divergence" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("proxy-gold divergence at rollout 1: the proxy rose 0.1 -> 0.2")


def test_the_driver_loop_ends_after_the_rollout_the_guard_stopped():
    args = parse_args(
        ["--hf-checkpoint", "builtin:tiny-shapes", "--loss-type", "nft", "--num-rollout", "4", "--no-progress"]
        + ["--monitor-action", "stop"]
    )
    world = World(ahead=False)
    world.drift = DriftWatch([])
    world.drift.held[1] = [("--monitor-norm-drift", "monitor/x0_norm_mean drifted to 1.6 from its first value 1")]
    run_groups, summary = RunGroups(args, {"actor": world}, world), {"losses": []}
    guard = RunGuard(args, run_groups, 0)
    completed = train_diffusion.train_rollouts(args, run_groups, world, 0, summary, time.perf_counter(), None, guard)
    assert completed == 1 and [e[1] for e in world.events if e[0] == "train"] == [0, 1]
    assert summary["guard_stopped"] == guard.stopped
    assert "--monitor-norm-drift at rollout 1: monitor/x0_norm_mean drifted to 1.6" in guard.stopped
    assert [(r[TRIPPED_KEY], r[ROLLBACKS_KEY]) for r in summary["rollouts"]] == [(0, 0), (1, 0)]
