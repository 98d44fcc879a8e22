"""What the planner knows of a fake mask's elements (miles/plan/masks.py): `nonzero` of a mask of unknown values is
every element (the planner's tokens are all attended), of its complement none, of a mask made as zeros none; so a
split by a mask and its complement keeps each row once, as on real tensors."""

from __future__ import annotations

import torch

from miles.plan.fake import PlanTensorMode


def rows(x: torch.Tensor, mask: torch.Tensor) -> int:
    return int(x[mask].shape[0])


def test_a_split_by_a_mask_and_its_complement_keeps_every_row_once():
    """diffusers' HunyuanVideo 1.5 transformer orders its tokens as x[mask], x[~mask]: 1985 tokens, not 3970."""
    tokens = torch.ones(1000, dtype=torch.long)  # a tokenizer's mask, made before the fake mode: read by value
    with PlanTensorMode() as mode:
        x = mode.from_tensor(torch.empty(1000, 8))
        image = mode.from_tensor(torch.empty(729, 8))
        text_mask = tokens.bool()
        unknown = x.sum(-1) > 0  # values no one knows: presumed all set
        image_mask = torch.zeros(729, dtype=torch.bool)  # a text-to-video run's: no image token attended
        assert (rows(x, text_mask), rows(x, ~text_mask)) == (1000, 0)
        assert (rows(x, unknown), rows(x, ~unknown)) == (1000, 0)
        assert (rows(image, image_mask), rows(image, ~image_mask)) == (0, 729)
        joined = torch.cat([x[text_mask], image[image_mask], x[~text_mask], image[~image_mask]])
        assert joined.shape[0] == 1729


def test_views_casts_and_combinations_keep_what_is_known():
    with PlanTensorMode():
        zeros, ones = torch.zeros(4, 6, dtype=torch.bool), torch.ones(4, 6)
        x = torch.empty(4, 6, 3)
        assert rows(x, zeros.view(4, 6)) == 0 and rows(x, ones.bool().clone()) == 24
        assert rows(x[:2], zeros[:2]) == 0 and rows(x, zeros.t().t()) == 0
        assert rows(x, zeros | ones.bool()) == 24 and rows(x, zeros & ones.bool()) == 0
        assert rows(x, ~(zeros & ones.bool())) == 24
        assert rows(x, torch.full((4, 6), False)) == 0 and rows(x, torch.full((4, 6), True)) == 24
        mixed = torch.cat([zeros, ones.bool()])  # known in parts only: presumed all set, its complement none
        assert rows(torch.empty(8, 6, 3), mixed) == 48 and rows(torch.empty(8, 6, 3), ~mixed) == 0
        padded = torch.nn.functional.pad(zeros, (0, 2), value=False)  # zeros padded with zeros: still none
        assert rows(torch.empty(4, 8, 3), padded) == 0


def test_an_in_place_write_updates_or_forgets_what_is_known():
    with PlanTensorMode():
        x = torch.empty(5, 2)
        mask = torch.zeros(5, dtype=torch.bool)
        mask.fill_(True)
        assert rows(x, mask) == 5 and rows(x, ~mask) == 0
        mask.zero_()
        assert rows(x, mask) == 0
        mask[:2] = True  # a write of some values: unknown again, presumed all set
        assert rows(x, mask) == 5 and rows(x, ~mask) == 0
