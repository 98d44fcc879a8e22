"""RewardWorkerPool: Ray workers score contiguous chunks and agree with in-process scoring, in order."""

import argparse
import asyncio

import pytest

from miles.data.shapes import shapes_items
from miles.ray.reward_workers import RewardWorkerPool
from miles.rollout.rm_hub import RewardError, compute_rewards
from miles.utils.misc import split_contiguous
from miles.utils.types import Sample

SPEC = [("shapes", 1.0), ("jpeg_compressibility", 0.1), ("custom", 0.5)]
CUSTOM_RM = """
async def rm(args, samples):
    return [float("nan") if s.prompt == "bad" else float(s.index) for s in samples]
"""


def shape_samples(num):
    items = shapes_items(num, seed=5)
    return [
        Sample(index=i, prompt=it["prompt"], metadata=it["metadata"], image=it["image"]) for i, it in enumerate(items)
    ]


@pytest.fixture(scope="module")
def rm_args(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom_rm") / "rm.py"
    path.write_text(CUSTOM_RM)
    return argparse.Namespace(custom_rm_path=f"{path}:rm")


@pytest.fixture(scope="module")
def pool(ray_cluster, rm_args):
    pool = RewardWorkerPool(rm_args, SPEC, num_workers=2, timeout_s=120)
    yield pool
    pool.shutdown()


@pytest.mark.parametrize("total,parts", [(7, 2), (6, 3), (2, 4), (0, 2), (5, 1)])
def test_split_contiguous_covers_the_batch_in_order(total, parts):
    bounds = split_contiguous(total, parts)
    assert len(bounds) == parts
    assert [i for a, b in bounds for i in range(a, b)] == list(range(total))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_two_workers_equal_in_process(pool, rm_args):
    remote_samples, local_samples = shape_samples(5), shape_samples(5)
    totals, per_reward = pool.score(remote_samples)
    expected_totals, expected_per_reward = asyncio.run(compute_rewards(rm_args, local_samples, SPEC))
    assert totals == pytest.approx(expected_totals, abs=1e-9)
    assert list(per_reward) == [name for name, _ in SPEC]
    for name in per_reward:
        assert per_reward[name] == pytest.approx(expected_per_reward[name], abs=1e-9)
    assert per_reward["custom"] == [0.0, 1.0, 2.0, 3.0, 4.0]  # order preserved across the two chunks
    for remote, local in zip(remote_samples, local_samples):
        assert remote.extra["shapes"] == local.extra["shapes"]


def test_fewer_samples_than_workers(pool):
    totals, per_reward = pool.score(shape_samples(1))
    assert len(totals) == 1 and per_reward["custom"] == [0.0]


def test_worker_error_reaches_the_driver(pool):
    samples = shape_samples(4)
    samples[3].prompt = "bad"
    with pytest.raises(RewardError, match=r"reward 'custom' returned nan for sample index=3 prompt='bad'"):
        pool.score(samples)


def test_zero_workers_score_in_process_also_inside_an_event_loop(rm_args):
    pool = RewardWorkerPool(rm_args, SPEC, num_workers=0)
    expected = asyncio.run(compute_rewards(rm_args, shape_samples(3), SPEC))
    assert pool.score(shape_samples(3)) == expected

    async def from_loop():
        return pool.score(shape_samples(3))

    assert asyncio.run(from_loop()) == expected


def test_negative_worker_count_names_the_flag(rm_args):
    with pytest.raises(ValueError, match="--rm-num-workers"):
        RewardWorkerPool(rm_args, SPEC, num_workers=-1)


def test_a_dead_worker_is_named_with_the_rollout(ray_cluster, rm_args):
    import ray

    from miles.utils.failures import ActorDied

    dying = RewardWorkerPool(rm_args, SPEC, num_workers=2, timeout_s=120)
    try:
        ray.kill(dying.workers[1])
        with pytest.raises(ActorDied, match=r"^reward worker 1 died during score of rollout 4: "):
            dying.score(shape_samples(4), rollout_id=4)
    finally:
        dying.shutdown()
