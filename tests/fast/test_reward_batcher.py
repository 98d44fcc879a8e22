"""The reward server's request batcher: requests queued behind a batch being scored merge into one call, up to the
max batch size without splitting a request, each getting its own slice; a failing merged batch is re-scored request
by request, so only the failing request sees the error."""

import asyncio
import concurrent.futures
import threading

import pytest

from miles.reward_batcher import RequestBatcher


class Scorer:
    """Ten times each item; records each call's items; the first call waits for `release` (a batch being scored)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = threading.Event()

    def __call__(self, items):
        if not self.calls:
            assert self.release.wait(timeout=10)
        self.calls.append(list(items))
        if any(item < 0 for item in items):
            raise ValueError(f"negative item in {items}")
        return [10 * item for item in items]


async def behind_a_busy_batch(batcher, scorer, requests):
    """Submit [0] (it is taken and blocks the scorer), then `requests` while it is scored; release; all results."""
    first = asyncio.ensure_future(batcher.submit([0]))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(batcher.submit(items)) for items in requests]
    await asyncio.sleep(0.05)
    scorer.release.set()
    return await asyncio.gather(first, *queued, return_exceptions=True)


def run(max_batch_size, requests, wait_s=0.0):
    scorer = Scorer()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        batcher = RequestBatcher(scorer, max_batch_size=max_batch_size, wait_s=wait_s, executor=executor)
        results = asyncio.run(behind_a_busy_batch(batcher, scorer, requests))
    return results, scorer.calls, batcher.stats


def test_requests_queued_behind_a_batch_merge_into_one_call_each_getting_its_slice():
    requests = [[1, 2], [3], [4, 5, 6], [7]]
    results, calls, stats = run(64, requests)
    assert calls == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert results == [[0], [10, 20], [30], [40, 50, 60], [70]]
    assert (stats.batches, stats.requests, stats.samples, stats.largest_batch_requests) == (2, 5, 8, 4)


def test_a_batch_takes_whole_requests_up_to_the_max_and_a_larger_request_goes_alone():
    requests = [[1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    results, calls, stats = run(5, requests)
    assert calls == [[0], [1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    assert results[1:] == [[10 * i for i in items] for items in requests]
    assert stats.largest_batch_samples == 7
    _, calls, _ = run(1, [[1], [2], [3]])  # 1: every request alone, in arrival order
    assert calls == [[0], [1], [2], [3]]


def test_an_error_reaches_only_the_request_that_caused_it():
    results, calls, stats = run(64, [[1], [-2, 3], [4]])
    assert results[1] == [10] and results[3] == [40]
    assert isinstance(results[2], ValueError) and "negative item in [-2, 3]" in str(results[2])
    assert calls == [[0], [1, -2, 3, 4], [1], [-2, 3], [4]]  # the merged call, then each request alone
    assert stats.split_after_error == 1 and stats.requests == 4


def test_an_idle_batcher_waits_the_window_for_requests_sent_together():
    scorer = Scorer()
    scorer.release.set()

    async def send():
        tasks = []
        for items in ([1], [2, 3], [4]):
            tasks.append(asyncio.ensure_future(batcher.submit(items)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        batcher = RequestBatcher(scorer, max_batch_size=64, wait_s=0.5, executor=executor)
        assert asyncio.run(send()) == [[10], [20, 30], [40]]
    assert scorer.calls == [[1, 2, 3, 4]]


def test_flags_out_of_range_are_named():
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        with pytest.raises(ValueError, match="--server-max-batch-size must be >= 1"):
            RequestBatcher(Scorer(), max_batch_size=0, wait_s=0.0, executor=executor)
        with pytest.raises(ValueError, match="--server-batch-wait-ms must be >= 0"):
            RequestBatcher(Scorer(), max_batch_size=4, wait_s=-0.001, executor=executor)
