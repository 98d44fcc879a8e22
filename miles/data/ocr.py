"""Text-rendering prompts: the target text sits between double quotes in the prompt (flow_grpo's OCR format), and the
built-in prompt set `builtin:ocr` (templates x words, disjoint words in the train and eval splits).

Scorer: `miles.rollout.rm_hub.ocr`. On-disk format: a JSONL of {"prompt": "a sign that says \\"OPEN\\""} rows, or a
plain text file with one such prompt per line (flow_grpo's dataset/ocr/*.txt), both read by `--prompt-data`.
"""

from __future__ import annotations

from typing import Any

BUILTIN_OCR = "builtin:ocr"
QUOTE = '"'

_TEMPLATES: tuple[str, ...] = (
    'a wooden sign that says "{}"',
    'a neon sign reading "{}" on a brick wall',
    'a poster with the word "{}" in bold letters',
    'a coffee mug printed with "{}"',
    'a chalkboard with "{}" written on it',
    'a storefront banner that reads "{}"',
    'a birthday cake with "{}" written in icing',
    'a t-shirt with the text "{}"',
)
# Short words and phrases of Latin letters and digits (what the recogniser reads best); the eval split's are its own.
_TRAIN_TEXTS: tuple[str, ...] = (
    "OPEN", "HELLO", "COFFEE", "SALE", "WELCOME", "EXIT", "BAKERY", "STOP", "HOTEL", "MUSIC", "PIZZA", "BOOKS",
    "LOVE", "GARDEN", "TAXI", "RELAX", "DREAM", "SUMMER", "CAFE 24", "GOOD LUCK", "HAPPY DAY", "NO PARKING",
    "Thank You", "Free Wifi", "Best Tea", "Hello World", "Sunrise", "Ocean", "Bistro", "Studio 54", "Open Late",
    "Fresh Bread",
)  # fmt: skip
_EVAL_TEXTS: tuple[str, ...] = (
    "CLOSED", "DINER", "MARKET", "PARIS", "ROBOT", "Good Night", "Fresh Fish", "Room 42", "FLOWERS", "Lemonade",
    "Welcome Home", "BIKE SHOP",
)  # fmt: skip
SPLIT_TEXTS: dict[str, tuple[str, ...]] = {"train": _TRAIN_TEXTS, "eval": _EVAL_TEXTS}


def quoted_text(prompt: str) -> str | None:
    """The text between the prompt's first two double quotes (flow_grpo's `prompt.split('"')[1]`), None without a
    closing quote or when it is only spaces."""
    parts = prompt.split(QUOTE)
    if len(parts) < 3 or not parts[1].replace(" ", ""):
        return None
    return parts[1]


def normalize_text(text: str) -> str:
    """flow_grpo's normalisation of both the target and the recognised text: spaces removed, lower case."""
    return text.replace(" ", "").lower()


def ocr_target(prompt: str) -> str:
    """The normalised target text of a prompt; a prompt with no quoted text is an error naming the format."""
    text = quoted_text(prompt)
    if text is None:
        raise ValueError(
            f"prompt {prompt!r} has no target text: the ocr reward reads the text between double quotes, e.g. "
            'a sign that says "OPEN"'
        )
    return normalize_text(text)


def ocr_prompts(split: str = "train") -> list[dict[str, Any]]:
    """Every (template, text) prompt of the split, template-major (the first N prompts cover many texts):
    [{"prompt", "metadata": {"text"}}], 256 train and 96 eval prompts."""
    if split not in SPLIT_TEXTS:
        raise ValueError(f"unknown builtin:ocr split {split!r}; valid: {sorted(SPLIT_TEXTS)}")
    return [
        {"prompt": template.format(text), "metadata": {"text": text}}
        for template in _TEMPLATES
        for text in SPLIT_TEXTS[split]
    ]


def unquoted_prompts(records: list[dict[str, Any]]) -> list[int]:
    """Positions (1-based) of the records whose prompt has no quoted target text."""
    return [i for i, record in enumerate(records, start=1) if quoted_text(record["prompt"]) is None]
