"""Per-phase torch thread counts (colocated phases on CPU)."""

from __future__ import annotations

import torch

from miles.utils.threads import node_cores, phase_thread_counts, torch_threads


def test_torch_threads_sets_the_count_inside_and_restores_it_after_an_error():
    base = torch.get_num_threads()
    other = 1 if base != 1 else 2
    try:
        with torch_threads(other):
            assert torch.get_num_threads() == other
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == base
    with torch_threads(None):
        assert torch.get_num_threads() == base


def test_actors_sharing_a_node_split_its_cores_per_phase():
    engines, groups = phase_thread_counts([("a", 8)], [[("a", 8), ("a", 8)], [("a", 8), ("a", 8)]])
    assert engines == [8]  # the engine generates alone on the node
    assert groups == [[4, 4], [4, 4]]  # a group's ranks train together; groups one after another


def test_two_engines_on_a_node_split_it_and_counts_never_drop_below_one():
    engines, groups = phase_thread_counts([("a", 2), ("a", 2)], [[("a", 2), ("a", 2), ("a", 2)]])
    assert engines == [1, 1]
    assert groups == [[1, 1, 1]]


def test_actors_on_nodes_without_the_other_phase_keep_their_base_count():
    engines, groups = phase_thread_counts([("a", 4), ("b", 16)], [[("a", 4), ("c", 8)]])
    assert engines == [4, None]  # b holds no trainer rank: its engine never waits for one
    assert groups == [[4, None]]


def test_node_cores_is_what_this_process_may_run_on():
    assert 1 <= node_cores() <= (torch.multiprocessing.cpu_count() or 1)


def test_a_gpu_rank_gets_the_node_cores_split_among_its_gpus(monkeypatch):
    import ray

    from miles.utils import threads

    class Context:
        def get_node_id(self):
            return "node-b"

    nodes = [{"NodeID": "node-a", "Resources": {"CPU": 4}}, {"NodeID": "node-b", "Resources": {"CPU": 96, "GPU": 8}}]
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(threads, "node_cores", lambda: 96)
    assert threads.gpu_rank_threads() == 12
    monkeypatch.setattr(threads, "node_cores", lambda: 4)
    nodes[1]["Resources"]["GPU"] = 8
    assert threads.gpu_rank_threads() == 1  # never below one
    # called without Ray (scripts/gpu_check.sh --no-setup): the GPUs this process sees
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(threads.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(threads, "node_cores", lambda: 16)
    assert threads.gpu_rank_threads() == 8
