import pytest
import torch

from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule, weighted_denominator, window_weight_totals


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


def test_window_weight_totals_sum_each_windows_weights_and_count_its_pairs():
    schedule = build_microbatch_schedule(num_pairs=8, num_windows=2, micro_batch_size=3)
    totals = window_weight_totals(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), schedule)
    assert totals.dtype == torch.float64 and totals.tolist() == [[3.0, 4.0], [0.0, 4.0]]


def test_weighted_denominators_make_the_dp_mean_the_mean_over_the_pairs_that_train():
    # two ranks, one window of 4 pairs each; rank 0 keeps 3 pairs, rank 1 keeps 1 (0/1 weights)
    schedule = build_microbatch_schedule(num_pairs=4, num_windows=1, micro_batch_size=2)
    weights = [torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 0.0])]
    losses = [torch.tensor([0.3, 9.0, 0.5, 0.7]), torch.tensor([9.0, 9.0, 1.1, 9.0])]
    totals = sum(window_weight_totals(w, schedule) for w in weights)  # the trunk's all-reduce
    (weight_sum, pair_count), window = totals[0].tolist(), schedule[0]
    denominator = weighted_denominator(window, weight_sum, pair_count)
    assert denominator == 4 * 4 / 8
    dp_mean = sum((w * loss).sum() / denominator for w, loss in zip(weights, losses)) / 2  # FSDP averages ranks
    assert dp_mean.item() == pytest.approx((0.3 + 0.5 + 0.7 + 1.1) / 4, rel=1e-7)


def test_weighted_denominator_is_the_pair_count_for_all_ones_and_for_all_zeros():
    schedule = build_microbatch_schedule(num_pairs=6, num_windows=1, micro_batch_size=4)
    assert weighted_denominator(schedule[0], 12.0, 12.0) == 6  # every pair trains: bit for bit the old divisor
    assert weighted_denominator(schedule[0], 0.0, 12.0) == 6  # nothing trains: the loss is 0, any divisor will do
