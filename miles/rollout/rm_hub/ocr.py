"""OCR reward (`--rm-type ocr`): PP-OCRv4 detection + recognition (RapidOCR's ONNX models, shipped in the
`rapidocr-onnxruntime` wheel, run by onnxruntime on CPU) reads the image; the score is flow_grpo's: 1 - edit distance /
target length against the prompt's quoted text, clipped at 0, and 1 when the target is found inside what was read.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from miles.data.ocr import normalize_text, ocr_target
from miles.rollout.rm_hub.jpeg import sample_pil_image
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

OCR_EXTRA_KEY = "ocr"
INSTALL_HINT = "pip install miles[ocr] (or pip install rapidocr-onnxruntime)"
_ENGINES: dict[int, Any] = {}


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit-cost insertions, deletions, substitutions), one DP row at a time."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_text_score(recognized: str, target: str) -> float:
    """flow_grpo's score of normalised texts: 1 if `target` occurs in `recognized`, else 1 - min(d, len) / len with
    d the edit distance and len the target's length (so a long misreading costs at most the whole target)."""
    if not target:
        raise ValueError("the OCR target text is empty")
    distance = 0 if target in recognized else min(edit_distance(recognized, target), len(target))
    return 1.0 - distance / len(target)


@dataclass(frozen=True)
class OcrScore:
    """What was read (normalised: the lines top to bottom joined, spaces removed, lower case), the target, the reward,
    and `correct` (the target found in the image: reward 1)."""

    recognized: str
    target: str
    reward: float
    correct: bool


def load_ocr_engine(num_threads: int = 1) -> Any:
    """RapidOCR set up as flow_grpo's PaddleOCR: the angle classifier off (use_angle_cls=False), no confidence floor
    (flow_grpo keeps every line with confidence > 0) and PaddleOCR's detector sizing (the longer side capped at 960,
    never upscaled; RapidOCR's own default upscales the shorter side to 736, 3-10x slower on generated images).
    `num_threads` per onnxruntime session (0: onnxruntime's default, which oversubscribes cores shared by
    several reward workers). Loaded once per process and thread count."""
    if num_threads in _ENGINES:
        return _ENGINES[num_threads]
    try:
        from rapidocr_onnxruntime import RapidOCR  # local: onnxruntime and cv2 load only for OCR runs
    except ImportError as exc:
        raise ImportError(f"--rm-type ocr needs the OCR extra: {INSTALL_HINT} ({exc})") from exc
    threads = num_threads if num_threads > 0 else -1
    engine = RapidOCR(
        use_cls=False,
        text_score=0.0,
        det_limit_type="max",
        det_limit_side_len=960,
        intra_op_num_threads=threads,
        inter_op_num_threads=threads,
    )
    logger.info("loaded the OCR reward model (RapidOCR PP-OCRv4 det + rec, %s threads)", num_threads or "default")
    _ENGINES[num_threads] = engine
    return engine


def recognize(engine: Any, image: np.ndarray) -> str:
    """The lines read in an HxWx3 RGB uint8 image, top to bottom and left to right, joined and normalised."""
    # RapidOCR reads arrays as OpenCV BGR (the channel order its models were trained on), so RGB is flipped.
    result, _ = engine(np.ascontiguousarray(image[:, :, ::-1]), use_cls=False)
    return normalize_text("".join(line[1] for line in result or [] if line[2] > 0))


def ocr_scores(engine: Any, images: list[np.ndarray], prompts: list[str]) -> list[OcrScore]:
    """One `OcrScore` per (image, prompt); every prompt's target is parsed before any image is read."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
    targets = [ocr_target(prompt) for prompt in prompts]
    scores = []
    for image, target in zip(images, targets):
        recognized = recognize(engine, image)
        reward = ocr_text_score(recognized, target)
        scores.append(OcrScore(recognized, target, reward, reward == 1.0))
    return scores


async def ocr_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """The OCR reward of each sample's image against its prompt's quoted text; each `OcrScore` is also stored in
    `sample.extra["ocr"]` (the rollout logs `rollout/ocr_correct_mean`)."""
    engine = load_ocr_engine(args.ocr_num_threads)
    images = [np.asarray(sample_pil_image(s).convert("RGB")) for s in samples]
    scores = ocr_scores(engine, images, [s.prompt for s in samples])
    for sample, score in zip(samples, scores):
        sample.extra[OCR_EXTRA_KEY] = asdict(score)
    return [score.reward for score in scores]
