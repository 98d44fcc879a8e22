"""OCR reward: flow_grpo's rules (quoted target, spaces and case removed, 1 - edit distance / length clipped at 0, full
credit when the target is inside the read text) against hand-computed distances, and the real PP-OCRv4 model on text
rendered with PIL's own font: right >= 0.9, wrong and blank low, partial in between, batched = one by one."""

import asyncio
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from miles.arguments import reward_spec
from miles.arguments.parser import default_args
from miles.data.ocr import normalize_text, ocr_target, quoted_text
from miles.rollout.rm_hub import compute_rewards, reward_metrics
from miles.rollout.rm_hub import ocr as ocr_module
from miles.rollout.rm_hub.ocr import edit_distance, load_ocr_engine, ocr_text_score
from miles.utils.types import Sample

PROMPT = 'a wooden sign that says "{}"'


def render(text: str, size: int = 256, font_size: int = 40) -> np.ndarray:
    """Black text centred on white with PIL's bundled TrueType font (present in every Pillow >= 10.1 wheel)."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    draw.text(((size - draw.textlength(text, font=font)) / 2, (size - font_size) / 2), text, fill=(0, 0, 0), font=font)
    return np.asarray(image)


def levenshtein(a: str, b: str) -> int:
    """The textbook full-table recursion, written out independently of `edit_distance`."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return table[len(a)][len(b)]


# ---- rules (no model) -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "a,b,distance",
    [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("intention", "execution", 5), ("", "abc", 3), ("abc", "abc", 0)],
)
def test_edit_distance_matches_hand_computed_values(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a) == levenshtein(a, b)


@pytest.mark.parametrize(
    "prompt,target",
    [
        ('a sign that says "Hello World"', "helloworld"),  # spaces and case removed
        ('"OPEN 24 H" in neon', "open24h"),
        ('first "Cafe" then "Bar"', "cafe"),  # flow_grpo's split('"')[1]: the first quoted text
        ('a mug with "  Big   Tea "', "bigtea"),
    ],
)
def test_target_is_the_first_quoted_text_normalised(prompt, target):
    assert ocr_target(prompt) == target


@pytest.mark.parametrize(
    "prompt", ["a sign with no quotes", 'an unclosed "quote', 'empty "" quotes', 'blank "   " one']
)
def test_a_prompt_without_quoted_text_is_an_error_naming_the_format(prompt):
    assert quoted_text(prompt) is None
    with pytest.raises(ValueError, match="between double quotes"):
        ocr_target(prompt)


@pytest.mark.parametrize(
    "recognized,target,score",
    [
        ("helloworld", "helloworld", 1.0),
        ("bighelloworldsale", "helloworld", 1.0),  # found inside the read text: full credit
        ("helloworle", "helloworld", 1 - 1 / 10),  # one substitution
        ("hloworld", "helloworld", 1 - 2 / 10),  # two deletions
        ("coff", "coffee", 1 - 2 / 6),
        ("taxi", "coffee", 0.0),  # distance 6 = the length
        ("", "coffee", 0.0),  # nothing read: distance = length
        ("zzzzzzzzzzzzzzzz", "abc", 0.0),  # distance 16 clipped at the length 3, never below 0
        ("abc", "abcd", 1 - 1 / 4),
        ("kitten", "sitting", 1 - 3 / 7),
    ],
)
def test_score_is_one_minus_clipped_distance_over_length(recognized, target, score):
    assert ocr_text_score(recognized, target) == pytest.approx(score, abs=1e-12)
    if target not in recognized:
        assert score == pytest.approx(1 - min(levenshtein(recognized, target), len(target)) / len(target))


def test_normalisation_removes_spaces_and_case_only():
    assert normalize_text(" Hello  WoRLD 42! ") == "helloworld42!"


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import fails as if not installed
    monkeypatch.setattr(ocr_module, "_ENGINES", {})
    with pytest.raises(ImportError, match=r"pip install miles\[ocr\]"):
        load_ocr_engine(1)
    monkeypatch.setitem(reward_spec.REWARD_PACKAGES, "ocr", ("no_such_ocr_module", "pip install miles[ocr]"))
    with pytest.raises(ValueError, match=r"--rm-type 'ocr'.*no_such_ocr_module package: pip install miles\[ocr\]"):
        reward_spec.reward_spec_from_args(default_args(rm_type="ocr", hf_checkpoint=None, model_family="auto"))


# ---- the real model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return load_ocr_engine(1)


@pytest.fixture(scope="module")
def cases():
    """(image, prompt) of: the right text, the target inside a longer line, a partial word, a wrong word, blank."""
    return {
        "right": (render("Hello World"), PROMPT.format("Hello World")),
        "inside": (render("BEST COFFEE", font_size=36), PROMPT.format("coffee")),
        "partial": (render("COFF"), PROMPT.format("COFFEE")),
        "wrong": (render("TAXI"), PROMPT.format("COFFEE")),
        "blank": (np.full((256, 256, 3), 255, np.uint8), PROMPT.format("COFFEE")),
    }


@pytest.fixture(scope="module")
def one_by_one(cases, engine):
    """Each case scored alone through the registered reward, as the rollout calls it."""
    args = default_args(ocr_num_threads=1)
    scores = {}
    for name, (image, prompt) in cases.items():
        sample = Sample(index=0, prompt=prompt, image=image)
        scores[name] = (asyncio.run(ocr_module.ocr_rm(args, [sample]))[0], sample.extra["ocr"])
    return scores


def test_model_loads_once_per_process(engine):
    assert load_ocr_engine(1) is engine


def test_rendered_text_scores(one_by_one):
    right, inside, partial, wrong, blank = (one_by_one[k][0] for k in ("right", "inside", "partial", "wrong", "blank"))
    assert right >= 0.9 and inside >= 0.9, one_by_one
    assert wrong <= 0.3 and blank == 0.0, one_by_one
    assert 0.3 < partial < 0.9, one_by_one
    assert one_by_one["blank"][1]["recognized"] == ""
    info = one_by_one["partial"][1]  # the score is the rule applied to what the model read
    assert partial == pytest.approx(1 - min(levenshtein(info["recognized"], "coffee"), 6) / 6)


def test_batched_call_equals_one_by_one_and_logs_accuracy(cases, one_by_one):
    args = default_args(ocr_num_threads=1, custom_rm_path=None)
    samples = [Sample(index=i, prompt=prompt, image=image) for i, (image, prompt) in enumerate(cases.values())]
    totals, per_reward = asyncio.run(compute_rewards(args, samples, [("ocr", 2.0)]))
    assert per_reward["ocr"] == [one_by_one[name][0] for name in cases]
    assert totals == [2.0 * value for value in per_reward["ocr"]]
    correct = [one_by_one[name][1]["correct"] for name in cases]
    assert reward_metrics(totals, per_reward, samples)["rollout/ocr_correct_mean"] == sum(correct) / len(correct)


def test_a_reward_worker_scores_like_the_driver(ray_cluster, cases, one_by_one):
    from miles.ray.reward_workers import RewardWorkerPool

    names = ("right", "partial", "blank")
    samples = [Sample(index=i, prompt=cases[name][1], image=cases[name][0]) for i, name in enumerate(names)]
    pool = RewardWorkerPool(default_args(ocr_num_threads=1), [("ocr", 1.0)], num_workers=1, timeout_s=120)
    try:
        totals, per_reward = pool.score(samples)
    finally:
        pool.shutdown()
    assert per_reward["ocr"] == totals == [one_by_one[name][0] for name in names]
    assert [s.extra["ocr"] for s in samples] == [one_by_one[name][1] for name in names]  # copied back to the driver
