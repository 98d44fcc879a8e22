import pytest

from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule


def test_ids_count_across_windows_and_ranges_tile_the_pairs():
    schedule = build_microbatch_schedule(num_pairs=12, num_windows=3, micro_batch_size=3)
    ids = [mb.microbatch_id for window in schedule for mb in window]
    assert ids == list(range(len(ids)))
    assert [[(mb.start, mb.end) for mb in w] for w in schedule] == [
        [(0, 3), (3, 4)],
        [(4, 7), (7, 8)],
        [(8, 11), (11, 12)],
    ]


def test_uneven_windows_are_an_error():
    with pytest.raises(ValueError, match="--num-steps-per-rollout"):
        build_microbatch_schedule(num_pairs=10, num_windows=3, micro_batch_size=2)
