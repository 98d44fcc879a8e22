"""The shapes-world tokenizers of the tiny pipelines, built in code: unknown words split by characters, never unk;
CLIP pads to 77 with its end-of-text token, T5 with its pad token."""

from __future__ import annotations

import pytest

from miles.models.tiny import build_clip_tokenizer, build_t5_tokenizer


@pytest.mark.parametrize("build", [build_clip_tokenizer, build_t5_tokenizer])
def test_unknown_words_tokenize_by_characters_without_unk(build):
    tokenizer = build()
    for word in ("zebra", "xylophone", "42!"):
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) > 1 and tokenizer.unk_token_id not in ids, (word, ids)
        assert tokenizer.decode(ids).replace(" ", "") == word  # CLIP splits digits and punctuation apart


def test_clip_tokenizer_has_no_unknown_bytes_and_pads_to_77():
    tokenizer = build_clip_tokenizer()
    out = tokenizer(["Ünïcode ✓ text", "a"], padding="max_length", max_length=77)
    assert [len(ids) for ids in out.input_ids] == [77, 77]
    assert tokenizer.model_max_length == 77
    # the endoftext token doubles as unk and pad: the first one must be the real end of the text
    first_eos = out.input_ids[0].index(tokenizer.eos_token_id)
    assert first_eos == sum(out.attention_mask[0]) - 1


def test_t5_tokenizer_pads_with_pad_and_ends_with_eos():
    tokenizer = build_t5_tokenizer()
    ids = tokenizer("two red circles", padding="max_length", max_length=8).input_ids
    assert ids[:4] == [*tokenizer("two red circles", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert ids[4:] == [tokenizer.pad_token_id] * 4
    assert tokenizer.model_max_length == 32
