"""--async-rollout: which loss types take a stale batch, and the driver's overlap with its staleness bound (the
bound's own tests: tests/fast/ray/test_generations.py)."""

from __future__ import annotations

import re
import threading
import time

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.ray.groups import RunGroups
from miles.rollout.rollout_hub import ROLLOUT_SPECS, check_async_rollout

TIMEOUT = 30


def args_for(*flags):
    return parse_args(["--hf-checkpoint", "builtin:tiny-shapes", *flags])


@pytest.mark.parametrize(
    "flags",
    [
        ("--loss-type", "policy_loss"),
        ("--loss-type", "nft"),
        ("--loss-type", "dmd2", "--teacher-load", "builtin:tiny-shapes"),
        ("--loss-type", "grpo_guard"),
        ("--loss-type", "flow_dppo"),
        ("--loss-type", "dpo"),
    ],
)
def test_loss_types_that_say_what_they_do_with_a_stale_batch_accept_it(flags):
    check_async_rollout(args_for("--async-rollout", *flags))
    assert ROLLOUT_SPECS[flags[1]].stale_batch


def test_the_help_names_every_built_in_loss_type_whose_rollout_side_takes_a_stale_batch_and_no_other():
    from miles.algorithms import BUILTIN_ALGORITHMS
    from miles.arguments.parser import build_parser

    (action,) = [a for a in build_parser()._actions if "--async-rollout" in a.option_strings]
    named = set(re.findall(r"[a-z][a-z0-9_]+", action.help.split("Accepted by ")[1].split(" (")[0]))
    builtin = {a.name for a in BUILTIN_ALGORITHMS}
    takes_stale = {n for n, spec in ROLLOUT_SPECS.items() if n in builtin and getattr(spec, "stale_batch", None)}
    assert named == takes_stale, (named, takes_stale)
    assert {"awm", "sft_loss", "custom_loss"}.isdisjoint(named)


@pytest.mark.parametrize("declared", [True, False])
def test_a_declaration_whose_async_rollout_disagrees_with_its_rollout_side_is_refused(monkeypatch, declared):
    from dataclasses import replace

    from miles.algorithms import ALGORITHMS
    from miles.rollout.rollout_hub import get_rollout_spec

    name = "nft" if not declared else "awm"  # nft's entry says what it does with a stale batch, awm's does not
    monkeypatch.setitem(ALGORITHMS, name, replace(ALGORITHMS[name], async_rollout=declared))
    with pytest.raises(ValueError, match=f"--loss-type {name}: its declaration says async_rollout={declared}"):
        get_rollout_spec(name)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--loss-type", "policy_loss", "--diffusion-recompute-old-log-prob"), "recompute-old-log-prob replaces"),
        (
            (
                "--loss-type",
                "custom_loss",
                "--custom-prepare-train-batch-path",
                "miles.backends.fsdp_utils.loss_hub.policy.prepare_policy_batch",
                "--custom-loss-function-path",
                "miles.backends.fsdp_utils.loss_hub.flow_grpo.policy_formula",
            ),
            "does not declare what it does with a batch generated one update behind",
        ),
        (("--loss-type", "sft_loss", "--train-only"), "sft_loss trains on dataset pairs here"),
        (
            (
                "--loss-type",
                "custom_loss",
                "--train-only",
                "--custom-prepare-train-batch-path",
                "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch",
                "--custom-loss-function-path",
                "miles.backends.fsdp_utils.loss_hub.sft.sft_formula",
            ),
            "custom_loss trains on dataset pairs here",
        ),
        (("--loss-type", "nft", "--debug-rollout-only"), "--debug-rollout-only has no training"),
        (("--loss-type", "awm", "--awm-kl-beta", "0"), "awm does not declare what it does with a batch generated"),
        (("--loss-type", "grpo_guard", "--diffusion-recompute-old-log-prob"), "recompute-old-log-prob replaces"),
    ],
)
def test_async_rollout_is_refused_where_a_stale_batch_would_be_wrong(flags, message):
    with pytest.raises(ValueError, match=message):
        check_async_rollout(args_for("--async-rollout", *flags))
    check_async_rollout(args_for(*flags))  # without the flag: nothing to refuse


class World:
    """A driver's peers in process: one engine whose calls run one at a time in order (as a Ray actor's do), a
    rollout manager, an actor group whose train waits until the next batch is being generated (when ahead)."""

    def __init__(self, ahead: bool) -> None:
        self.ahead, self.engine_lock, self.engine_version = ahead, threading.Lock(), 1
        self.weights_version, self.events = 1, []
        self.generating = {}  # rollout id -> set when its generation has started
        self.source = type("Source", (), {"epoch_of": staticmethod(lambda rollout_id: 0)})()
        self.last_metrics: dict = {}

    def show_engine_progress(self, display):
        self.display = display  # the driver's bar label; these engines report nothing

    def generate(self, rollout_id):
        self.generating.setdefault(rollout_id, threading.Event())
        with self.engine_lock:
            self.generating[rollout_id].set()
            self.events.append(("generate", rollout_id, self.engine_version))
            time.sleep(0.02)
            self.last_metrics = {"rollout/weights_version": self.engine_version}
        return [f"batch {rollout_id}"]

    def metrics(self, rollout_id):
        return {"rollout/epoch": 0, **self.last_metrics}

    def update_weights(self, group, before_load=None, *, rollout_id=None):
        if before_load is not None:
            before_load()
        self.weights_version += 1
        with self.engine_lock:
            self.engine_version = self.weights_version
            self.events.append(("sync", self.weights_version))
        return 0.0

    def train(self, rollout_id, data, peer):
        if self.ahead and rollout_id + 1 < 4:  # the next batch generates while this one trains
            assert self.generating.setdefault(rollout_id + 1, threading.Event()).wait(TIMEOUT)
        self.events.append(("train", rollout_id, data[0]))
        return data

    def pop_metrics(self):
        return [{"rollout_id": 0, "step": 1, "role": "actor", "train/loss": 0.5}]

    def log(self, record):
        pass


@pytest.mark.parametrize("ahead", [False, True])
def test_the_driver_generates_one_rollout_ahead_and_records_a_staleness_of_at_most_one(ahead):
    flags = ("--loss-type", "nft", "--num-rollout", "4", "--no-progress", *(("--async-rollout",) if ahead else ()))
    args, world = args_for(*flags), World(ahead)
    summary: dict = {"losses": []}
    train_diffusion.train_rollouts(
        args, RunGroups(args, {"actor": world}, world), world, 0, summary, time.perf_counter()
    )
    records = summary["rollouts"]
    trains = [e[1:] for e in world.events if e[0] == "train"]
    assert trains == [(k, f"batch {k}") for k in range(4)]  # every batch trains once, in order
    if not ahead:
        assert not any(k.startswith("rollout/staleness") for r in records for k in r)
        assert [r["rollout/weights_version"] for r in records] == [1, 2, 3, 4]
        return
    # batch k+1 samples with the weights before update k: one update behind from the second rollout on
    assert [r["rollout/staleness"] for r in records] == [0, 1, 1, 1]
    assert [r["rollout/weights_version"] for r in records] == [1, 1, 2, 3]
    assert [r["rollout/trainer_weights_version"] for r in records] == [1, 2, 3, 4]
    order = [e[:2] for e in world.events if e[0] in ("generate", "train")]
    assert order.index(("generate", 1)) < order.index(("train", 0))  # overlapped
