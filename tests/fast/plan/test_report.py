"""What a plan says per GPU (miles/plan/report.py), on hand-made process plans: a process at rest and at its peak
(CPU offload keeps its state on the host), a GPU's phases with one process at its peak and the others at rest (or
asleep), the host memory pinned per node of 8 GPUs, and a role's entry in plan.json."""

from __future__ import annotations

from miles.plan.process import ProcessPlan
from miles.plan.report import Component, gpu_peaks, host_pinned_per_node, role_entry


def trainer(peak_train: int = 100, **sizes: int) -> ProcessPlan:
    return ProcessPlan("actor", 0, {"start-up": 40, "train": peak_train}, after={"train": 30}, **sizes)


ENGINE = ProcessPlan("engine", 0, {"start-up": 20, "generate": 50}, after={"start-up": 10})


def test_a_process_is_resident_after_its_phase_and_peaks_where_it_ran():
    actor = Component("actor rank 0", "actor", trainer())
    assert (actor.resident(), actor.peak("train"), actor.peak("generate")) == (30, 100, 30)  # not active: at rest
    engine = Component("engine 0", "engine", ENGINE, extra_bytes=5)  # its bucket receive buffer, beside it all
    assert (engine.resident(), engine.peak("generate"), engine.peak("train")) == (15, 55, 15)


def test_cpu_offload_keeps_the_parameters_gradients_and_optimizer_state_off_the_device():
    plan = trainer(params_bytes=10, grads_bytes=5, optimizer_bytes=20)
    offloaded = Component("actor rank 0", "actor", plan, offload=True)
    assert (offloaded.resident(), offloaded.peak("train")) == (0, 65)  # max(0, 30 - 35), 100 - 35


def test_a_gpus_phases_add_the_process_at_its_peak_to_the_others_at_rest_or_asleep():
    gpu = [Component("actor rank 0", "actor", trainer()), Component("engine 0", "engine", ENGINE)]
    # start-up: both resident (30 + 10) plus the largest climb above rest (the actor's 40 - 30 vs the engine's 20 - 10)
    assert gpu_peaks(gpu, sleeps=False) == {"start-up": 50, "train": 110, "generate": 80}
    assert gpu_peaks(gpu, sleeps=True) == {"start-up": 50, "train": 100, "generate": 50}
    with_sync = Component("actor rank 0", "actor", ProcessPlan("actor", 0, {"train": 60, "weight sync": 70}))
    assert gpu_peaks([with_sync, gpu[1]], sleeps=False)["weight sync"] == 10 + 70


def test_host_memory_pinned_is_the_largest_nodes_sum_over_its_8_gpus():
    offloaded = Component("actor", "actor", trainer(params_bytes=1, grads_bytes=2, optimizer_bytes=3), offload=True)
    gpus = [[offloaded]] * 9  # 8 on the first node, 1 on the second
    assert host_pinned_per_node(gpus, sleeps=False) == 8 * 6
    sleeping = Component("actor", "actor", trainer(host_bytes=7))
    assert host_pinned_per_node([[sleeping, Component("engine 0", "engine", ENGINE)]], sleeps=True) == 7 + 10
    assert host_pinned_per_node([[sleeping]], sleeps=False) == 0 and host_pinned_per_node([], sleeps=True) == 0


def test_a_roles_entry_names_its_peak_phase_and_what_it_is_made_of():
    plan = trainer(params_bytes=10, grads_bytes=5, optimizer_bytes=20, other_state_bytes=10, sync_buffer_bytes=8)
    entry = role_entry(plan, offload=True, extra_bytes=2)
    assert (entry["peak_bytes"], entry["phase"]) == (100 - 35 + 2, "train")
    assert entry["activations_bytes"] == 100 - 45 - 8 and entry["host_offload_bytes"] == 35
    assert entry["sync_buffer_bytes"] == 10 and entry["simulated_ranks"] == []
