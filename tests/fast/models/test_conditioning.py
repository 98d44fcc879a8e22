"""Conditioning: generic batch operations over any names, dtypes and ranks, checked row by row with plain loops."""

from __future__ import annotations

import pickle

import pytest
import torch

from miles.models.conditioning import Conditioning, has_conditioning


def _flux_like(batch: int) -> Conditioning:
    """Names and dtypes of other families: a sequence, a pooled vector, integer ids and a boolean mask."""
    g = torch.Generator().manual_seed(batch)
    return Conditioning(
        {
            "prompt_embeds": torch.randn(batch, 5, 3, generator=g),
            "pooled": torch.randn(batch, 4, generator=g),
            "text_ids": torch.arange(batch * 5 * 3).view(batch, 5, 3),
            "mask": torch.rand(batch, 5, generator=g) > 0.5,
        }
    )


def _rows(cond: Conditioning) -> list[dict[str, torch.Tensor]]:
    return [{name: cond[name][i] for name in cond} for i in range(cond.batch_size)]


def _assert_rows_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for name in g:
            assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), name


def test_rows_cat_repeat_and_expand_match_plain_loops():
    cond = _flux_like(3)
    rows = _rows(cond)
    assert cond.batch_size == 3 and list(cond) == ["prompt_embeds", "pooled", "text_ids", "mask"]
    _assert_rows_equal(_rows(cond.rows(1)), [rows[1]])
    _assert_rows_equal(_rows(cond.rows(-1)), [rows[2]])
    _assert_rows_equal(_rows(cond.rows(torch.tensor([2, 0]))), [rows[2], rows[0]])
    _assert_rows_equal(_rows(Conditioning.cat([cond.rows(slice(0, 2)), cond.rows(2)])), rows)
    _assert_rows_equal(_rows(cond.repeat_interleave(2)), [r for r in rows for _ in range(2)])
    _assert_rows_equal(_rows(cond.rows(1).expand(4)), [rows[1]] * 4)
    assert cond.expand(3) is cond


def test_to_casts_floating_tensors_only():
    half = _flux_like(2).to(dtype=torch.bfloat16)
    assert half["prompt_embeds"].dtype == half["pooled"].dtype == torch.bfloat16
    assert half["text_ids"].dtype == torch.int64 and half["mask"].dtype == torch.bool


def test_train_pair_columns_round_trip_with_and_without_prefix():
    cond, negative = _flux_like(3), _flux_like(1).expand(3)
    columns = {"x0": torch.zeros(3, 4, 2, 2), **cond.to_columns(), **negative.to_columns(prefix="negative_")}
    assert set(columns) == {
        "x0",
        *(f"cond/{n}" for n in cond),
        *(f"negative_cond/{n}" for n in cond),
    }
    _assert_rows_equal(_rows(Conditioning.from_columns(columns)), _rows(cond))
    _assert_rows_equal(_rows(Conditioning.from_columns(columns, prefix="negative_")), _rows(negative))
    assert has_conditioning(columns, "negative_") and not has_conditioning({"x0": columns["x0"]}, "negative_")
    with pytest.raises(KeyError, match="no negative_cond/"):
        Conditioning.from_columns({"x0": columns["x0"]}, prefix="negative_")


def test_pickles_and_refuses_bad_batches():
    cond = _flux_like(2)
    _assert_rows_equal(_rows(pickle.loads(pickle.dumps(cond))), _rows(cond))
    with pytest.raises(ValueError, match="disagree on the batch size"):
        Conditioning({"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="expand a batch of 1"):
        cond.expand(4)
    with pytest.raises(ValueError, match="names differ"):
        Conditioning.cat([cond, Conditioning({"prompt_embeds": torch.zeros(1, 5, 3)})])
    with pytest.raises(KeyError, match="no 'pooled_prompt_embeds'"):
        _ = cond["pooled_prompt_embeds"]


def test_cat_zero_pads_variable_length_sequences_to_the_longest():
    short = Conditioning(
        {"embeds": torch.ones(2, 3, 4), "mask": torch.ones(2, 3, dtype=torch.long), "p": torch.ones(2, 5)}
    )
    long = Conditioning(
        {"embeds": torch.full((1, 6, 4), 2.0), "mask": torch.ones(1, 6, dtype=torch.long), "p": torch.ones(1, 5)}
    )
    cat = Conditioning.cat([short, long])
    assert cat["embeds"].shape == (3, 6, 4) and cat["mask"].shape == (3, 6) and cat["p"].shape == (3, 5)
    assert cat["mask"].dtype == torch.long and cat["mask"].tolist() == [[1, 1, 1, 0, 0, 0]] * 2 + [[1] * 6]
    assert torch.equal(cat["embeds"][:2, :3], short["embeds"]) and not cat["embeds"][:2, 3:].any()
    assert torch.equal(cat["embeds"][2:], long["embeds"])
    with pytest.raises(ValueError, match="'embeds'.*only dimension 1"):
        Conditioning.cat([short, Conditioning({**long, "embeds": torch.zeros(1, 6, 5)})])
