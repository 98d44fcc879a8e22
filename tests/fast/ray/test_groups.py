"""The driver's loop after a stop signal (real SIGTERMs to this process, in-process peers): a signal during a
generation drops that batch, one during training lets the rollout finish; the stop's save skips what this run saved."""

from __future__ import annotations

import os
import signal
import time

import train_diffusion
from miles.algorithms import DEFAULT_LOSS_TYPE
from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.checkpoint import META_FILE, checkpoint_dir, read_latest, write_latest
from miles.ray.groups import RunFlags, RunGroups, resumes_from_save_folders
from miles.utils.stop_signals import StopSignals
from tests.fast.test_async_rollout import World, args_for


class SignalledWorld(World):
    """World whose generate or train of one rollout sends this process a SIGTERM half-way through."""

    def __init__(self, phase: str, rollout_id: int) -> None:
        super().__init__(ahead=False)
        self.at = (phase, rollout_id)

    def generate(self, rollout_id):
        if self.at == ("generate", rollout_id):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().generate(rollout_id)

    def train(self, rollout_id, data, peer):
        if self.at == ("train", rollout_id):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train(rollout_id, data, peer)


def run_loop(world: SignalledWorld) -> tuple[int, StopSignals, dict]:
    args = args_for("--loss-type", "nft", "--num-rollout", "4", "--no-progress")
    summary: dict = {"losses": []}
    with StopSignals() as stop:
        completed = train_diffusion.train_rollouts(
            args, RunGroups(args, {"actor": world}, world), world, 0, summary, time.perf_counter(), stop
        )
    return completed, stop, summary


def test_a_signal_during_a_generation_drops_its_batch_and_stops_after_the_rollout_before():
    world = SignalledWorld("generate", 2)
    completed, stop, summary = run_loop(world)
    assert completed == 1 and stop.signal_name == "SIGTERM"
    assert [e[1] for e in world.events if e[0] == "train"] == [0, 1]  # batch 2 was generated, never trained
    assert [e[1] for e in world.events if e[0] == "generate"] == [0, 1, 2]
    assert stop.abandoned == "rollout 2 generated, not trained"
    assert [r["rollout_id"] for r in summary["rollouts"]] == [0, 1]


def test_a_signal_during_training_lets_the_rollout_finish_then_stops():
    world = SignalledWorld("train", 1)
    completed, stop, summary = run_loop(world)
    assert completed == 1 and stop.abandoned is None
    assert [e[1] for e in world.events if e[0] == "train"] == [0, 1]
    assert [e for e in world.events if e[0] == "sync"] == [("sync", 2), ("sync", 3)]  # rollout 1's sync too
    assert [r["rollout_id"] for r in summary["rollouts"]] == [0, 1]


class SavingGroup:
    """A trainer group whose save writes what `write_latest` checks: the role folder with its meta.json."""

    def __init__(self, save_dir: str) -> None:
        self.save_dir, self.saved = save_dir, []

    def save(self, rollout_id, extra):
        path = checkpoint_dir(self.save_dir, rollout_id, "actor")
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, META_FILE), "w").close()
        self.saved.append(rollout_id)


def test_the_stop_saves_the_last_completed_rollout_unless_this_run_saved_it(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    group = SavingGroup(save_dir)
    group.save(3, None)
    write_latest(save_dir, 3)  # another run's save of rollout 3 in this folder: not this run's state
    group.saved.clear()
    args = args_for("--loss-type", "nft", "--save", save_dir)
    manager = type("Manager", (), {"source": type("Source", (), {"state_dict": lambda self, n: {"next": n}})()})()
    run_groups = RunGroups(args, {"actor": group}, manager)
    assert run_groups.save_on_stop(3) == [os.path.join(save_dir, "iter_0000003")]
    assert group.saved == [3] and read_latest(save_dir) == 3  # saved again, from this run's ranks
    run_groups.save(4)  # a --save-interval save
    assert run_groups.save_on_stop(4) == [os.path.join(save_dir, "iter_0000004")]
    assert group.saved == [3, 4] and read_latest(save_dir) == 4  # not saved twice
    assert run_groups.save_on_stop(-1) == []  # nothing completed: nothing to save


def test_a_run_resumed_from_its_own_save_folder_holds_its_start_as_saved(tmp_path):
    ckpt, elsewhere = str(tmp_path / "ckpt"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(ckpt)
    assert resumes_from_save_folders(args_for("--loss-type", "nft", "--save", ckpt, "--load", ckpt), ["actor"])
    other = args_for("--loss-type", "nft", "--save", ckpt, "--load", str(elsewhere))
    assert not resumes_from_save_folders(other, ["actor"])
    assert not resumes_from_save_folders(args_for("--loss-type", "nft", "--load", ckpt), ["actor"])


def test_the_run_record_holds_the_groups_flags_as_parsed(tmp_path):
    defaults = RunFlags.from_args(default_args())
    assert (defaults.loss_type, defaults.load, defaults.colocate, defaults.dp_size, defaults.sp_size) == (
        DEFAULT_LOSS_TYPE, None, False, 2, 1
    )  # fmt: skip
    assert (defaults.cpu_phase_threads, defaults.fsdp_shard_size, defaults.fsdp_strict_shard_groups) == (
        "auto",
        None,
        False,
    )
    args = args_for(
        "--loss-type", "nft", "--load", str(tmp_path), "--eval-only", "--async-rollout", "--cpu-phase-threads", "off",
        "--rollout-num-engines", "2", "--rollout-cpus-per-engine", "0.25", "--output-dir", str(tmp_path / "out"),
    )  # fmt: skip
    flags = RunFlags.from_args(args)
    assert (flags.loss_type, flags.load, flags.eval_only, flags.async_rollout) == ("nft", str(tmp_path), True, True)
    assert (flags.cpu_phase_threads, flags.rollout_num_engines, flags.rollout_cpus_per_engine) == ("off", 2, 0.25)
    assert flags.output_dir == str(tmp_path / "out") and flags.device == args.device
    assert RunGroups(args, {}, None).flags == flags  # the groups read this record
