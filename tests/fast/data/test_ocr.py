"""OCR prompt data: builtin:ocr (quoted targets, distinct prompts, eval words unseen in training), .txt prompt files,
the start-up check that every prompt of an ocr run has quoted text. Which held-out eval a prompt file selects:
tests/fast/ray/test_evaluator.py."""

import pytest

from miles.arguments.parser import default_args
from miles.data.ocr import BUILTIN_OCR, SPLIT_TEXTS, ocr_prompts, ocr_target
from miles.rollout.data_source import PromptDataError, load_records, read_text_prompts
from miles.rollout.input_files import InputFileError, check_ocr_prompts


def data_args(**overrides):
    values = dict(
        prompt_data=BUILTIN_OCR,
        input_key="prompt",
        metadata_key="metadata",
        image_key="image",
        rollout_batch_size=4,
        allow_repeated_prompts=False,
        rollout_seed=0,
        builtin_dataset_size=8,
        loss_type="policy_loss",
        train_only=False,
        rm_type="ocr",
        custom_rm_path=None,
        hf_checkpoint=None,
        model_family="auto",
        eval_prompt_data=BUILTIN_OCR,
        eval_num_prompts=500,
        eval_seed=0,
    )
    return default_args(**{**values, **overrides})


def test_builtin_prompts_quote_their_text_and_eval_words_are_held_out():
    train, held_out = ocr_prompts("train"), ocr_prompts("eval")
    assert len(train) == len({r["prompt"] for r in train}) == 8 * len(SPLIT_TEXTS["train"])
    assert len(held_out) == len({r["prompt"] for r in held_out}) == 8 * len(SPLIT_TEXTS["eval"])
    for record in train + held_out:
        assert ocr_target(record["prompt"]) == record["metadata"]["text"].replace(" ", "").lower()
    assert not {r["metadata"]["text"] for r in train} & {r["metadata"]["text"] for r in held_out}
    first = held_out[: len(SPLIT_TEXTS["eval"])]  # template-major: the first prompts cover every eval word
    assert [r["metadata"]["text"] for r in first] == list(SPLIT_TEXTS["eval"])
    assert load_records(data_args(), with_images=False, resolution=32) == train
    with pytest.raises(ValueError, match="unknown builtin:ocr split"):
        ocr_prompts("test")


def test_text_prompt_file_reads_one_prompt_a_line(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text('a sign that says "OPEN"\n\n  a mug with "TEA"  \n')
    assert read_text_prompts(str(path)) == [
        {"prompt": 'a sign that says "OPEN"', "metadata": {}},
        {"prompt": 'a mug with "TEA"', "metadata": {}},
    ]
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(PromptDataError, match="blank.txt: no prompts"):
        read_text_prompts(str(tmp_path / "blank.txt"))


def test_an_ocr_run_refuses_a_prompt_without_quoted_text(tmp_path):
    records = [{"prompt": 'a sign that says "OPEN"', "metadata": {}}, {"prompt": "a red circle", "metadata": {}}]
    with pytest.raises(InputFileError, match=r"record 2 \(1 of 2 unquoted\): 'a red circle' has no target text"):
        check_ocr_prompts(data_args(prompt_data="p.txt"), records)
    check_ocr_prompts(data_args(rm_type="shapes"), records)  # other rewards do not read quotes
