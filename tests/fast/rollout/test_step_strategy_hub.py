"""Step strategies: all-but-last default, seeded windows, custom hooks, and errors that name the flags."""

import pytest

from miles.arguments.parser import default_args
from miles.rollout.step_strategy_hub import flash_ratio, select_trained_steps
from miles.utils.misc import HookLoadError, function_registry


def make_args(**overrides):
    values = dict(
        diffusion_num_steps=10,
        diffusion_num_sde_steps=None,
        diffusion_sde_window_range=None,
        diffusion_step_strategy_path=None,
        rollout_seed=42,
    )
    values.update(overrides)
    return default_args(**values)


def test_default_trains_every_step_but_the_last():
    assert select_trained_steps(make_args(), 0) == list(range(9))
    assert select_trained_steps(make_args(diffusion_num_steps=2), 5) == [0]
    assert select_trained_steps(make_args(diffusion_num_steps=1), 0) == []


def test_the_flags_defaults_train_every_step_but_the_last():
    assert select_trained_steps(default_args(diffusion_num_steps=4), 3) == [0, 1, 2]


def test_window_is_contiguous_and_inside_the_default_range():
    starts = set()
    for rollout_id in range(200):
        steps = select_trained_steps(make_args(diffusion_num_sde_steps=3), rollout_id)
        assert steps == list(range(steps[0], steps[0] + 3))
        assert 0 <= steps[0] and steps[-1] <= 8
        starts.add(steps[0])
    assert starts == set(range(7))  # every start in [0, 9 - 3] is reachable


def test_window_respects_the_given_range():
    starts = set()
    for rollout_id in range(200):
        steps = select_trained_steps(make_args(diffusion_num_sde_steps=2, diffusion_sde_window_range="2,6"), rollout_id)
        assert len(steps) == 2 and steps[1] == steps[0] + 1
        assert 2 <= steps[0] and steps[-1] <= 5
        starts.add(steps[0])
    assert starts == {2, 3, 4}


def test_window_is_a_function_of_seed_and_rollout_id():
    args = make_args(diffusion_num_sde_steps=2)
    first = [select_trained_steps(args, r) for r in range(50)]
    assert first == [select_trained_steps(make_args(diffusion_num_sde_steps=2), r) for r in range(50)]
    assert len({tuple(s) for s in first}) > 1  # it moves between rollouts
    other_seed = [select_trained_steps(make_args(diffusion_num_sde_steps=2, rollout_seed=7), r) for r in range(50)]
    assert other_seed != first


def test_window_covering_the_whole_range_is_all_but_last():
    assert select_trained_steps(make_args(diffusion_num_sde_steps=9), 3) == list(range(9))
    assert select_trained_steps(make_args(diffusion_num_sde_steps=2, diffusion_sde_window_range=(4, 6)), 1) == [4, 5]


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(diffusion_num_sde_steps=10), "--diffusion-num-sde-steps 10"),
        (dict(diffusion_num_sde_steps=-1), "--diffusion-num-sde-steps -1"),
        (dict(diffusion_num_sde_steps=3, diffusion_sde_window_range="2,4"), "does not fit"),
        (dict(diffusion_num_sde_steps=2, diffusion_sde_window_range="0,10"), "--diffusion-sde-window-range 0,10"),
        (dict(diffusion_num_sde_steps=2, diffusion_sde_window_range="5,3"), "--diffusion-sde-window-range 5,3"),
        (dict(diffusion_num_sde_steps=2, diffusion_sde_window_range="a,b"), "--diffusion-sde-window-range"),
        (dict(diffusion_sde_window_range="0,5"), "needs --diffusion-num-sde-steps"),
        (dict(diffusion_num_steps=0), "--diffusion-num-steps"),
    ],
)
def test_bad_window_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        select_trained_steps(make_args(**overrides), 0)


def test_custom_strategy_from_a_file(tmp_path):
    hook = tmp_path / "strategy.py"
    hook.write_text(
        "def every_other(args, rollout_id, num_steps):\n    return list(range(rollout_id % 2, num_steps - 1, 2))\n"
    )
    args = make_args(diffusion_step_strategy_path=f"{hook}:every_other")
    assert select_trained_steps(args, 0) == [0, 2, 4, 6, 8]
    assert select_trained_steps(args, 1) == [1, 3, 5, 7]


def test_custom_strategy_receives_args_rollout_id_and_num_steps():
    seen = []

    def record(args, rollout_id, num_steps):
        seen.append((args.rollout_seed, rollout_id, num_steps))
        return []

    with function_registry.temporary("test.record_strategy", record) as name:
        assert select_trained_steps(make_args(diffusion_step_strategy_path=name), 7) == []
    assert seen == [(42, 7, 10)]


@pytest.mark.parametrize(
    "returned, message",
    [
        ([2, 1], "sorted, unique"),
        ([1, 1], "sorted, unique"),
        ([0, 9], r"\[0, 8\]"),
        ([-1], r"\[0, 8\]"),
        ([0.5], "list of ints"),
        ([True], "list of ints"),
        (3, "list of ints"),
    ],
)
def test_custom_strategy_output_is_validated(returned, message):
    with function_registry.temporary("test.bad_strategy", lambda args, rollout_id, num_steps: returned) as name:
        with pytest.raises(ValueError, match=f"--diffusion-step-strategy-path.*{message}"):
            select_trained_steps(make_args(diffusion_step_strategy_path=name), 0)


def test_custom_strategy_cannot_be_combined_with_a_window_range():
    with function_registry.temporary("test.any", lambda *a: [0]) as name:
        with pytest.raises(ValueError, match="--diffusion-step-strategy-path.*--diffusion-sde-window-range"):
            args = make_args(
                diffusion_step_strategy_path=name, diffusion_num_sde_steps=2, diffusion_sde_window_range="0,3"
            )
            select_trained_steps(args, 0)


def test_custom_strategy_replaces_the_default_window():
    with function_registry.temporary("test.any", lambda *a: [1]) as name:
        assert select_trained_steps(make_args(diffusion_step_strategy_path=name, diffusion_num_sde_steps=3), 0) == [1]


def test_zero_window_means_all_but_last():
    assert select_trained_steps(make_args(diffusion_num_sde_steps=0), 0) == list(
        range(make_args().diffusion_num_steps - 1)
    )


def test_missing_custom_strategy_file_is_a_load_error(tmp_path):
    with pytest.raises(HookLoadError, match="does not exist"):
        select_trained_steps(make_args(diffusion_step_strategy_path=f"{tmp_path}/nope.py:fn"), 0)


def mixgrpo_args(**overrides):
    values = dict(
        diffusion_num_steps=25,
        mixgrpo_window_size=4,
        mixgrpo_mode="progressive",
        mixgrpo_shift_interval=25,
        mixgrpo_stride=1,
        mixgrpo_flash=False,
        mixgrpo_flash_ratio=0.4,
    )
    values.update(overrides)
    return make_args(**values)


@pytest.mark.parametrize(
    ("k", "window"), [(0, [0, 1, 2, 3]), (24, [0, 1, 2, 3]), (25, [1, 2, 3, 4]), (299, range(11, 15))]
)
def test_mixgrpo_progressive_windows_at_given_rollouts(k, window):
    assert select_trained_steps(mixgrpo_args(), k) == list(window)


def test_mixgrpo_progressive_window_rolls_back_and_defaults_its_interval_by_flash():
    # max_t = 23: starts 0..23 (24 positions), clamped to 19 = max_t − w; position 24 is start 0 again
    assert select_trained_steps(mixgrpo_args(), 23 * 25) == [19, 20, 21, 22]
    assert select_trained_steps(mixgrpo_args(), 24 * 25) == [0, 1, 2, 3]
    assert select_trained_steps(mixgrpo_args(mixgrpo_stride=3), 2 * 25) == [6, 7, 8, 9]  # 3·(2 mod (23//3 + 1))
    assert select_trained_steps(mixgrpo_args(mixgrpo_stride=3), 8 * 25) == [0, 1, 2, 3]  # 8 positions: 0, 3 .. 21
    assert select_trained_steps(mixgrpo_args(mixgrpo_stride=0), 10_000) == [0, 1, 2, 3]  # Flash*: fixed at 0
    assert select_trained_steps(mixgrpo_args(mixgrpo_shift_interval=None), 25) == [1, 2, 3, 4]  # τ 25
    assert select_trained_steps(mixgrpo_args(mixgrpo_shift_interval=None, mixgrpo_flash=True), 20) == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["progressive", "random"])
@pytest.mark.parametrize(("num_steps", "window", "interval"), [(25, 4, 1), (10, 8, 3), (6, 1, 1)])
def test_mixgrpo_window_never_holds_the_last_two_steps(mode, num_steps, window, interval):
    args = mixgrpo_args(
        diffusion_num_steps=num_steps, mixgrpo_window_size=window, mixgrpo_mode=mode, mixgrpo_shift_interval=interval
    )
    seen = set()
    for k in range(3000):
        steps = select_trained_steps(args, k)
        assert steps == list(range(steps[0], steps[0] + window)) and steps[0] >= 0
        assert steps[-1] <= num_steps - 3  # neither N − 2 nor N − 1
        seen.add(steps[0])
    assert seen == set(range(num_steps - 2 - window + 1))  # every start in 0 .. max_t − w is reached


def test_mixgrpo_random_windows_are_reproducible_seeded_and_their_own_stream():
    args = mixgrpo_args(mixgrpo_mode="random", mixgrpo_shift_interval=None)
    starts = [select_trained_steps(args, k)[0] for k in range(200)]
    assert starts == [select_trained_steps(mixgrpo_args(mixgrpo_mode="random"), k)[0] for k in range(200)]
    other_seed = [select_trained_steps(mixgrpo_args(mixgrpo_mode="random", rollout_seed=7), k)[0] for k in range(200)]
    assert starts != other_seed
    window_strategy = [
        select_trained_steps(
            make_args(diffusion_num_steps=25, diffusion_num_sde_steps=4, diffusion_sde_window_range="0,23"), k
        )[0]
        for k in range(200)
    ]
    assert starts != window_strategy  # same range and seed, another stream
    assert len(set(starts[:25])) > 1  # drawn per rollout, not per τ


def test_mixgrpo_refuses_another_strategy_and_a_window_that_does_not_fit():
    with pytest.raises(ValueError, match="--diffusion-step-strategy-path"):
        select_trained_steps(mixgrpo_args(diffusion_step_strategy_path="m.f"), 0)
    with pytest.raises(ValueError, match="--mixgrpo-window-size 24 must be in"):
        select_trained_steps(mixgrpo_args(mixgrpo_window_size=24), 0)


def test_flash_ratio_only_with_the_window_and_flash():
    assert flash_ratio(mixgrpo_args(mixgrpo_flash=True)) == 0.4
    assert flash_ratio(mixgrpo_args()) is None
    assert flash_ratio(mixgrpo_args(mixgrpo_window_size=None, mixgrpo_flash=True)) is None
    assert flash_ratio(make_args()) is None
