"""--colocate-sleep: when the driver decides that engines and trainer ranks share GPUs, and the order in which they
sleep and wake around a rollout (the engines never hold the device while the ranks train, nor the ranks while the
engines generate)."""

from __future__ import annotations

import logging
import time

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.ray.colocation import PhaseMemory, shared_gpus
from miles.ray.groups import RunGroups


def args_for(*flags):
    return parse_args(["--hf-checkpoint", "builtin:tiny-shapes", "--loss-type", "nft", "--no-progress", *flags])


class Peer:
    """A trainer group or an engine group: records its sleeps and wakes in the shared event list."""

    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events
        self.actors = self.engines = [object()]

    def sleep(self, discard_weights: bool | None = None, rollout_id: int | None = None):
        event = (self.name, "sleep") if discard_weights is None else (self.name, "sleep", discard_weights)
        self.events.append(event if rollout_id is None else (*event, f"rollout {rollout_id}"))
        return [{"copied_bytes": 1 << 20, "discarded_bytes": 0}]

    def wake(self, rollout_id: int | None = None):
        self.events.append((self.name, "wake") if rollout_id is None else (self.name, "wake", f"rollout {rollout_id}"))
        return [{"copied_bytes": 1 << 20, "discarded_bytes": 0}]


def where(*gpus: str, node: str = "n1") -> list[dict]:
    """Placement entries (`record_placement`) of actors on `node`, one per GPU id given ("" for a CPU actor)."""
    return [{"node_id": node, "ip": "10.0.0.1", "gpus": [gpu] if gpu else []} for gpu in gpus]


def test_shared_gpus_are_the_node_gpu_pairs_holding_an_engine_and_a_rank():
    engines = where("0", "1")
    assert shared_gpus({"engines": engines, "actor": where("0", "1")}) == {"n1/0", "n1/1"}
    assert shared_gpus({"engines": engines, "actor": where("2", "3")}) == set()  # separate GPUs of one node
    assert shared_gpus({"engines": engines, "critic": where("0", node="n2")}) == set()  # GPU 0 of another node
    assert shared_gpus({"engines": engines, "actor": where("2"), "critic": where("1")}) == {"n1/1"}
    assert shared_gpus({"engines": where(""), "actor": where("")}) == set()  # CPU actors have no GPU ids


def test_auto_is_off_on_cpu_whatever_the_placement():
    events: list = []
    placement = {"engines": where("0"), "actor": where("0")}
    args = args_for("--device", "cpu")
    phases = PhaseMemory(args, {"actor": Peer("actor", events)}, Peer("engines", events), placement)
    phases.start(), phases.to_train(), phases.to_generate()
    assert not phases.enabled and events == []


@pytest.mark.parametrize(
    ("rank_gpus", "flags", "enabled"),
    [
        (("0", "1"), (), True),  # engine 0 shares GPU 0 with rank 0
        (("1", "2"), (), False),  # separate GPUs
        (("0", "1"), ("--async-rollout",), False),  # overlapping phases keep both in memory
    ],
)
def test_auto_is_on_where_an_engine_and_a_rank_share_a_gpu(caplog, rank_gpus, flags, enabled):
    placement = {"actor": where(*rank_gpus), "engines": where("0")}
    args = args_for("--device", "cuda", *flags)
    with caplog.at_level(logging.INFO, logger="miles.ray.colocation"):
        assert PhaseMemory(args, {"actor": Peer("actor", [])}, Peer("engines", []), placement).enabled is enabled
    if flags:
        assert "--async-rollout runs generation and training at once" in caplog.text


class World(Peer):
    """The driver's peers in process, recording every call in order: rollout manager, one trainer group, writer."""

    def __init__(self, events: list) -> None:
        super().__init__("actor", events)
        self.weights_version = 0
        self.source = type("Source", (), {"epoch_of": staticmethod(lambda rollout_id: 0)})()

    def show_engine_progress(self, display):
        self.display = display  # the driver's bar label; these engines report nothing

    def fill_prompt_cache(self, eval_prompts, start_rollout_id=0):
        return None  # no prompt cache in these runs

    def generate(self, rollout_id):
        self.events.append(("generate", rollout_id))
        return [f"batch {rollout_id}"]

    def metrics(self, rollout_id):
        return {"rollout/epoch": 0}

    def train(self, rollout_id, data, peer):
        self.events.append(("train", rollout_id))
        return data

    def update_weights(self, group, before_load=None, *, rollout_id=None, version=None):
        self.events.append(("export",))
        if before_load is not None:
            before_load()
        self.events.append(("load",))
        return 0.0

    def pop_metrics(self):
        return []

    def log(self, record):
        self.events.append(("log", sorted(k for k in record if k.startswith("perf/colocate"))))


def test_each_rollout_hands_the_device_to_the_trainer_ranks_then_back_to_the_engines():
    events: list = []
    world, engines = World(events), Peer("engines", events)
    args = args_for("--colocate-sleep", "on", "--num-rollout", "2", "--eval-interval", "0")
    phases = PhaseMemory(args, {"actor": world}, engines)
    phases.start()
    run_groups = RunGroups(args, {"actor": world}, world, phases=phases)
    train_diffusion.train_rollouts(args, run_groups, world, 0, {"losses": []}, time.perf_counter())
    rollout = lambda k: [  # noqa: E731
        ("generate", k),
        ("engines", "sleep", True, f"rollout {k}"),  # the trained weights are dropped: the sync replaces them
        ("actor", "wake"),
        ("train", k),
        ("export",),  # the weights are in host memory (the object store) before the ranks sleep
        ("actor", "sleep"),
        ("engines", "wake", f"rollout {k}"),  # an engine that fails names the rollout
        ("load",),
        ("log", ["perf/colocate_swap_s"]),
    ]
    assert events == [("actor", "sleep"), *rollout(0), *rollout(1)]


@pytest.mark.background("tests/fast/ray/colocated_placement.py", "placement")
def test_colocate_puts_rank_i_of_every_group_and_its_engines_on_gpu_i(background_job):
    """Ray packs fractional GPU bundles onto one GPU; --colocate's whole-GPU bundles keep one rank of each group per
    GPU (a cluster with 2 declared GPUs in a background job: the test session's cluster has none)."""
    import json

    placement = json.loads((background_job / "placement.json").read_text())
    gpu = {role: [ids[0] for ids in placement[role]] for role in ("actor", "critic", "engines")}
    assert sorted(gpu["actor"]) == [0, 1]  # distinct GPUs for the ranks of a group
    assert gpu["critic"] == gpu["actor"]  # rank i of every group on the same GPU
    assert gpu["engines"] == [gpu["actor"][i % 2] for i in range(3)]
    assert placement["share"] == 0.25  # bundle 0: actor rank, critic rank, engines 0 and 2


@pytest.mark.parametrize(
    ("device", "colocate", "after"), [("cuda", True, True), ("cuda", False, False), ("cpu", True, False)]
)
def test_colocated_engines_on_gpus_load_once_the_ranks_hold_their_shards(monkeypatch, device, colocate, after):
    """On shared GPUs an engine's whole model must not load beside the ranks' loading; elsewhere both load at once."""
    import miles.ray.groups as groups_module
    import miles.ray.rollout_manager
    import miles.ray.train_group

    events: list = []

    class Group:
        def __init__(self, args, role, colocation=None, pool=None):
            self.role = role

        def start_init(self):
            events.append(f"{self.role} loads its shards")

        def finish_init(self):
            events.append(f"{self.role} ready")
            return 0

    class Manager:
        engines = None

        def __init__(self, args, *, wait, colocation, pool):
            assert wait is False
            events.append("engines load")

        def wait_ready(self):
            events.append("engines ready")

        def fill_prompt_cache(self, eval_prompts, start_rollout_id=0):
            return None  # no prompt cache here

        def update_weights(self, group, before_load, version):
            events.append("sync")

    monkeypatch.setattr(miles.ray.train_group, "RayTrainGroup", Group)
    monkeypatch.setattr(miles.ray.rollout_manager, "RolloutManager", Manager)
    monkeypatch.setattr(groups_module, "colocation_for", lambda flags: None)
    monkeypatch.setattr(groups_module.RunGroups, "record_placement", lambda self: {})
    monkeypatch.setattr(groups_module, "uses_gpu", lambda flags: flags.device == "cuda")
    args = args_for("--device", device, "--eval-interval", "0", *(["--colocate"] if colocate else []))
    assert groups_module.engines_after_trainers(groups_module.RunFlags.from_args(args)) is after
    run_groups = groups_module.RunGroups.launch(args, pool=None)
    assert run_groups.start() == 0
    if after:
        assert events == ["actor loads its shards", "actor ready", "engines load", "engines ready", "sync"]
    else:
        assert events == ["engines load", "actor loads its shards", "engines ready", "actor ready", "sync"]


def test_colocated_start_up_syncs_with_the_trainer_ranks_asleep(monkeypatch):
    """The first sync as every later one (`to_generate`): export, the ranks sleep, then the engines load."""
    import miles.ray.groups as groups_module

    events: list = []
    world, engines = World(events), Peer("engines", events)

    class Group(Peer):
        def start_init(self):
            events.append(("actor", "init"))

        def finish_init(self):
            return 0

    world.engines, world.source = engines, None
    monkeypatch.setattr(groups_module.RunGroups, "record_placement", lambda self: {})
    monkeypatch.setattr(groups_module, "check_roles_agree", lambda *a: None)
    args = args_for("--colocate-sleep", "on", "--eval-interval", "0")
    run_groups = RunGroups(args, {"actor": Group("actor", events)}, world)
    run_groups.set_phase_threads = lambda: None
    world.wait_ready = lambda: None
    assert run_groups.start() == 0
    assert events == [("actor", "init"), ("export",), ("actor", "sleep"), ("load",)]
