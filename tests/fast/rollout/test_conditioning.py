"""The negative (CFG) conditioning as train-pair columns: one row copied to every pair, or one row per sample
repeated over its sample-major pairs; copies, never views of one row; rows that do not divide the pairs refused."""

from __future__ import annotations

import pytest
import torch

from miles.models.conditioning import Conditioning
from miles.rollout.conditioning import negative_columns


def test_one_negative_row_is_copied_to_every_pair_and_reads_back_with_its_prefix():
    negative = Conditioning({"prompt_embeds": torch.arange(6.0).view(1, 2, 3), "mask": torch.ones(1, 2)})
    columns = negative_columns(negative, 4)
    back = Conditioning.from_columns(columns, prefix="negative_")
    assert back.batch_size == 4 and set(back) == {"prompt_embeds", "mask"}
    assert all(torch.equal(back["prompt_embeds"][i], negative["prompt_embeds"][0]) for i in range(4))
    columns["negative_cond/prompt_embeds"][0].zero_()  # a hook writing one pair's row
    assert columns["negative_cond/prompt_embeds"][1].sum() == 15  # the others keep theirs
    with pytest.raises(KeyError):
        Conditioning.from_columns(columns)  # not the positive conditioning's columns


def test_one_row_per_sample_repeats_over_its_sample_major_pairs():
    negative = Conditioning({"image_embeds": torch.tensor([[1.0], [2.0]])})  # two samples, three pairs each
    columns = negative_columns(negative, 6)
    assert columns["negative_cond/image_embeds"].flatten().tolist() == [1, 1, 1, 2, 2, 2]
    assert negative_columns(negative, 2)["negative_cond/image_embeds"].flatten().tolist() == [1, 2]
    with pytest.raises(ValueError, match="2 negative rows do not divide 5 sample-major pairs"):
        negative_columns(negative, 5)
