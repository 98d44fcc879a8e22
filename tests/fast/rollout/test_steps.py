"""The rollout's pure steps: groups, filters' bookkeeping, advantages of removed samples, ordering, refills."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.models.conditioning import Conditioning
from miles.rollout import steps
from miles.utils.types import Sample


def samples_of(groups: int, per_group: int) -> list[Sample]:
    return [Sample(index=i, prompt=f"p{i // per_group}", group_index=i // per_group) for i in range(groups * per_group)]


@dataclasses.dataclass
class Result:
    final_latents: torch.Tensor
    sigmas: torch.Tensor
    images: np.ndarray
    negative_prompt_embeds: torch.Tensor
    trained_steps: list
    conditioning: Conditioning

    @property
    def batch_size(self):
        return self.final_latents.shape[0]


def test_select_rows_indexes_per_sample_fields_and_keeps_shared_ones():
    b = 4
    result = Result(
        final_latents=torch.arange(b * 2.0).reshape(b, 2),
        sigmas=torch.linspace(1, 0, b),  # as long as the batch, but shared: never indexed
        images=np.arange(b * 3).reshape(b, 3),
        negative_prompt_embeds=torch.zeros(1, 5),
        trained_steps=[0, 1],
        conditioning=Conditioning({"seq": torch.arange(b * 6.0).reshape(b, 3, 2), "mask": torch.ones(b, 3).bool()}),
    )
    picked = steps.select_rows(result, [3, 1])
    assert torch.equal(picked.conditioning["seq"], result.conditioning["seq"][[3, 1]])
    assert picked.conditioning["mask"].dtype == torch.bool and picked.conditioning.batch_size == 2
    assert torch.equal(picked.final_latents, result.final_latents[[3, 1]])
    assert np.array_equal(picked.images, result.images[[3, 1]])
    assert torch.equal(picked.sigmas, result.sigmas) and picked.negative_prompt_embeds is result.negative_prompt_embeds


def test_renumber_gives_consecutive_indices_and_groups_in_batch_order():
    kept = samples_of(4, 2)[2:4] + samples_of(4, 2)[6:8]
    steps.renumber(kept)
    assert [s.index for s in kept] == [0, 1, 2, 3] and [s.group_index for s in kept] == [0, 0, 1, 1]
    assert [len(g) for g in steps.split_groups(kept)] == [2, 2]


def test_removed_samples_get_zero_advantage_and_the_others_keep_theirs():
    args = SimpleNamespace(
        n_samples_per_prompt=2,
        globalize_reward_std=False,
        disable_grpo_std_normalization=False,
        per_reward_group_norm=False,
    )
    samples = samples_of(2, 2)
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.6])
    plain = steps.compute_advantages(args, samples, rewards)
    samples[1].remove_sample = True
    masked = steps.compute_advantages(args, samples, rewards)
    assert masked[1] == 0 and torch.equal(masked[[0, 2, 3]], plain[[0, 2, 3]]) and plain[1] != 0


def test_per_reward_group_norm_reads_each_samples_reward_terms():
    args = default_args(
        n_samples_per_prompt=2,
        globalize_reward_std=False,
        disable_grpo_std_normalization=False,
        per_reward_group_norm=True,
        rm_type="shapes:1.0,jpeg_compressibility:0.5",
        custom_rm_path=None,
        hf_checkpoint=None,
        model_family="auto",
    )
    samples = samples_of(2, 2)
    shapes, jpeg = [0.0, 1.0, 0.5, 0.5], [-3.0, -1.0, -2.0, -6.0]
    for sample, a, b in zip(samples, shapes, jpeg):
        sample.extra[steps.REWARD_TERMS] = {"shapes": a, "jpeg_compressibility": b}
    totals = torch.tensor([a + 0.5 * b for a, b in zip(shapes, jpeg)])
    out = steps.compute_advantages(args, samples, totals)
    # groups of two: GRPO is -+ d / (d + eps) with d half the gap; the second group's shapes values are equal (0)
    one = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(
        out,
        torch.tensor(
            [-one - 0.5 * 1 / (1 + 1e-4), one + 0.5 / (1 + 1e-4), 0.5 * 2 / (2 + 1e-4), -0.5 * 2 / (2 + 1e-4)]
        ),
    )
    del samples[3].extra[steps.REWARD_TERMS]
    with pytest.raises(ValueError, match=r"--per-reward-group-norm needs each sample's value.*samples \[3\]"):
        steps.compute_advantages(args, samples, totals)


def test_post_processed_advantages_must_be_one_per_sample():
    args = SimpleNamespace(n_samples_per_prompt=2)
    samples = samples_of(1, 2)
    out = steps.compute_advantages(args, samples, torch.ones(2), lambda a, s, r: r * 3)
    assert out.tolist() == [3.0, 3.0]
    try:
        steps.compute_advantages(args, samples, torch.ones(2), lambda a, s, r: r[:1])
    except ValueError as exc:
        assert "one per sample" in str(exc)
    else:
        raise AssertionError("a short advantage vector was accepted")


def test_order_moves_whole_samples_with_their_pairs():
    pairs = {"sample": torch.arange(4).repeat_interleave(3), "step": torch.arange(3).repeat(4)}
    ordered = steps.order_pairs(pairs, 4, 3, seed=1, rollout_id=2)
    assert sorted(ordered["sample"].tolist()) == sorted(pairs["sample"].tolist())
    blocks = ordered["sample"].reshape(4, 3)
    assert (blocks == blocks[:, :1]).all() and (ordered["step"].reshape(4, 3) == torch.arange(3)).all()


def test_refill_draws_differ_by_round_and_repeat_for_the_same_ids():
    first = steps.refill_record_indices(100, 5, seed=3, rollout_id=7, round_index=1)
    assert first == steps.refill_record_indices(100, 5, seed=3, rollout_id=7, round_index=1)
    assert first != steps.refill_record_indices(100, 5, seed=3, rollout_id=7, round_index=2)
    assert len(set(first)) == 5
    assert len(steps.refill_record_indices(2, 5, seed=3, rollout_id=7, round_index=1)) == 5  # fewer records


def test_make_samples_continues_indices_seeds_and_groups():
    args = SimpleNamespace(n_samples_per_prompt=2, rollout_seed=0)
    records = [{"prompt": "a"}, {"prompt": "b", "metadata": {"k": 1}}]
    first = steps.make_samples(args, records, [0, 1], 4)
    more = steps.make_samples(args, records, [1], 4, first_index=4, first_group=2)
    assert [s.index for s in first + more] == list(range(6))
    assert [s.group_index for s in more] == [2, 2] and more[0].metadata == {"k": 1}
    assert len({s.seed for s in first + more}) == 6


@pytest.mark.parametrize(
    ("flags", "batch_std"),
    [
        (("--loss-type", "awm", "--awm-kl-beta", "0"), True),  # the declaration's default: the authors' advantage
        (("--loss-type", "awm", "--awm-kl-beta", "0", "--no-globalize-reward-std"), False),
        (("--loss-type", "policy_loss"), False),
        (("--loss-type", "policy_loss", "--globalize-reward-std"), True),
        (("--loss-type", "nft", "--no-globalize-reward-std"), False),
    ],
)
def test_the_advantage_divides_by_the_batch_std_where_the_run_says_so(flags, batch_std):
    from miles.arguments.parser import parse_args

    args = parse_args(["--n-samples-per-prompt", "2", "--rollout-batch-size", "2", *flags])
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.6])
    # group means 0.5 and 0.4; group stds 0.5 and 0.2; the batch's population std, by hand: mean 0.45,
    # squared deviations 0.3025, 0.2025, 0.0625, 0.0225 -> sqrt(0.59 / 4)
    std = torch.tensor([0.59 / 4] * 4).sqrt() if batch_std else torch.tensor([0.5, 0.5, 0.2, 0.2])
    expected = torch.tensor([0.5, -0.5, -0.2, 0.2]) / (std + 1e-4)
    torch.testing.assert_close(steps.compute_advantages(args, samples_of(2, 2), rewards), expected)


def test_sample_seeds_differ_by_rollout_and_index():
    seeds = {steps.sample_seed(42, rollout, index) for rollout in range(3) for index in range(8)}
    assert len(seeds) == 24
    assert steps.sample_seed(42, 1, 5) == steps.sample_seed(42, 1, 5) != steps.sample_seed(43, 1, 5)


def test_a_rollout_whose_groups_all_scored_alike_is_named_once_until_one_trains(caplog):
    watch = steps.ZeroAdvantageWatch(True, group_size=2)
    flat = torch.tensor([1.0, 1.0, 0.5, 0.5])  # two groups, each scored alike
    mixed = torch.tensor([1.0, 0.0, 0.5, 0.5])
    with caplog.at_level("WARNING", logger="miles.rollout.steps"):
        assert watch.check(3, flat, torch.zeros(4)) == {"rollout/zero_advantage_groups": 1.0}
        assert watch.check(4, flat, torch.zeros(4)) == {"rollout/zero_advantage_groups": 1.0}  # said once
        advantages = steps.compute_grpo_advantages(mixed, 2)
        assert watch.check(5, mixed, advantages) == {"rollout/zero_advantage_groups": 0.5}
        assert watch.check(6, flat, torch.zeros(4))["rollout/zero_advantage_groups"] == 1.0  # said again
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and warnings[0].startswith(
        "rollout 3 trains nothing from its rewards: every prompt group's samples scored alike (rewards 0.5, 1.0), "
        "so every advantage is 0."
    )
    assert warnings[1].startswith("rollout 6 trains nothing")
    assert steps.ZeroAdvantageWatch(False, 2).check(0, flat, torch.zeros(4)) == {}  # refl, dmd2, custom_loss: none
