"""`vlm_judge`: a vision-language model served behind an OpenAI-compatible chat-completions API (vLLM, sglang) rates
each sample; docs/user-guide/reward-server.md shows the serve command.

Each sample is one request to `--rm-url` + `/chat/completions`: the `--vlm-judge-prompt-file` template with `{prompt}`
replaced by the sample's prompt, then the image (a video: `--vlm-judge-frames` evenly spaced frames) as base64 PNG
`image_url` parts; `--rm-model`, temperature 0, at most `--vlm-judge-max-tokens` tokens. The answer's score
(`parse_judge_score`) divided by `--vlm-judge-max-score` is the reward, in [0, 1]. An answer without a score is an
error (`--vlm-judge-unparsable error`) or scores `--vlm-judge-default-score` (`default`); either way
`rollout/vlm_judge_unparsable_frac` counts them, and under `default` a scored batch (a rollout) with any is logged with
its first answer, and one with more than `--vlm-judge-max-unparsable-frac` of them fails (`unparsable_problem`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.arguments.records import FlagRecord
from miles.rollout.rm_hub.remote import RemoteFlags, RemoteRewardError, http_client, png_b64, post_json
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

VLM_JUDGE_EXTRA_KEY = "vlm_judge"  # sample.extra: {"unparsable": 0.0 or 1.0, "answer": the judge's text}
DEFAULT_PROMPT_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "assets", "vlm_judge_prompt.txt"
)
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_AFTER_SCORE = re.compile(rf"score\W{{0,6}}?(?:is\W{{0,3}})?({_NUMBER})", re.IGNORECASE)
_ONLY_NUMBER = re.compile(rf"\W*({_NUMBER})\W*")


@dataclass(frozen=True)
class JudgeFlags(FlagRecord):
    """The flags the VLM judge reads (`miles.arguments.rewards`: the remote rewards' group); its requests' own
    (--rm-timeout, --rm-retries, ...) are `RemoteFlags`."""

    rm_url: list[str] | None  # the rules make it exactly one URL under --rm-type vlm_judge
    rm_model: str | None
    rm_max_concurrency: int
    vlm_judge_prompt_file: str | None
    vlm_judge_max_score: float
    vlm_judge_unparsable: str  # "error" or "default"
    vlm_judge_max_unparsable_frac: float
    vlm_judge_default_score: float
    vlm_judge_frames: int
    vlm_judge_max_tokens: int


def parse_judge_score(answer: str, max_score: float) -> float | None:
    """The judge's score as a reward in [0, 1], or None when the answer has none. The rule: the number that follows
    the LAST word "score" (any case; up to six non-word characters such as `:`, `=`, `**` or an "is" between them),
    else the answer when it is a lone number; that number must lie in [0, max_score] and is divided by it."""
    matches = _AFTER_SCORE.findall(answer)
    if matches:
        text = matches[-1]
    else:
        lone = _ONLY_NUMBER.fullmatch(answer.strip())
        if lone is None:
            return None
        text = lone.group(1)
    value = float(text)
    if not 0.0 <= value <= max_score:
        return None
    return value / max_score


@functools.lru_cache(maxsize=8)
def read_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"--vlm-judge-prompt-file {path}: cannot read it ({exc.strerror})") from None


def key_frames(frames: Any, count: int) -> list[np.ndarray]:
    """`count` evenly spaced frames (first and last included) of (F, H, W, 3) frames; all of them when F <= count."""
    frames = np.asarray(frames)
    picks = np.unique(np.round(np.linspace(0, len(frames) - 1, min(count, len(frames)))).astype(int))
    return [frames[i] for i in picks]


def judge_messages(flags: JudgeFlags, sample: Sample) -> list[dict[str, Any]]:
    """The chat messages of one sample: the filled-in template, then its image or key frames."""
    template = read_template(flags.vlm_judge_prompt_file or DEFAULT_PROMPT_FILE)
    content: list[dict[str, Any]] = [{"type": "text", "text": template.replace("{prompt}", sample.prompt)}]
    if sample.frames is not None:
        media = key_frames(sample.frames, flags.vlm_judge_frames)
    elif sample.image is not None:
        media = [sample.image]
    else:
        raise RemoteRewardError(f"vlm_judge: sample index={sample.index} has neither an image nor frames")
    for image in media:
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(image)}})
    return [{"role": "user", "content": content}]


def answer_text(reply: Any) -> str:
    """choices[0].message.content of a chat-completions answer; anything else is malformed (ValueError)."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise ValueError("no 'choices' list")
    message = reply["choices"][0].get("message") if isinstance(reply["choices"][0], dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise ValueError("choices[0].message.content is not a string")
    return content


async def vlm_judge(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """One chat-completions request per sample, at most --rm-max-concurrency at a time (module docstring)."""
    flags, requests = JudgeFlags.from_args(args), RemoteFlags.from_args(args)
    if not flags.rm_url:
        raise ValueError("--rm-type vlm_judge needs --rm-url, the judge's OpenAI-compatible base URL")
    url = flags.rm_url[0].rstrip("/") + "/chat/completions"
    gate = asyncio.Semaphore(flags.rm_max_concurrency)
    max_score = flags.vlm_judge_max_score

    async def judge(client: Any, sample: Sample) -> float:
        body = {
            "model": flags.rm_model,
            "messages": await asyncio.to_thread(judge_messages, flags, sample),
            "temperature": 0.0,
            "max_tokens": flags.vlm_judge_max_tokens,
        }
        async with gate:
            answer = await post_json(client, url, body, requests, answer_text, f"to judge sample index={sample.index}")
        score = parse_judge_score(answer, max_score)
        sample.extra[VLM_JUDGE_EXTRA_KEY] = {"unparsable": float(score is None), "answer": answer[:500]}
        if score is not None:
            return score
        if flags.vlm_judge_unparsable == "error":
            raise RemoteRewardError(
                f"{url}: the judge's answer for sample index={sample.index} has no score in [0, {max_score:g}] "
                f"(--vlm-judge-unparsable error; 'default' scores --vlm-judge-default-score instead): {answer[:200]!r}"
            )
        return flags.vlm_judge_default_score

    async with http_client(requests) as client:
        outcomes = await asyncio.gather(*(judge(client, sample) for sample in samples), return_exceptions=True)
    scores: list[float] = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        scores.append(outcome)
    return scores


def unparsable_metrics(samples: list[Sample]) -> dict[str, float]:
    """`rollout/vlm_judge_unparsable` and `_frac`: how many judged samples' answers had no score, and their share."""
    infos = [s.extra[VLM_JUDGE_EXTRA_KEY] for s in samples if VLM_JUDGE_EXTRA_KEY in s.extra]
    if not infos:
        return {}
    count = sum(info["unparsable"] for info in infos)
    return {"rollout/vlm_judge_unparsable": count, "rollout/vlm_judge_unparsable_frac": count / len(infos)}


def unparsable_problem(args: argparse.Namespace, samples: list[Sample]) -> str | None:
    """Why a scored batch (a rollout) cannot be trained on: more than --vlm-judge-max-unparsable-frac of the judge's
    answers had no score (each scored the default), naming the judge and showing the first; None otherwise. A batch
    with any unparsable answer is logged with that first answer either way."""
    judged = [s for s in samples if VLM_JUDGE_EXTRA_KEY in s.extra]
    bad = [s for s in judged if s.extra[VLM_JUDGE_EXTRA_KEY]["unparsable"]]
    if not bad:
        return None
    flags = JudgeFlags.from_args(args)
    limit = flags.vlm_judge_max_unparsable_frac
    url, model = (flags.rm_url or ["?"])[0], flags.rm_model
    judge = f"the VLM judge {model} at {url}" if model else f"the VLM judge at {url}"
    first = bad[0].extra[VLM_JUDGE_EXTRA_KEY]["answer"]
    counted = f"{len(bad)} of {len(judged)} answers of {judge} had no score in [0, {flags.vlm_judge_max_score:g}]"
    if len(bad) / len(judged) <= limit:
        logger.warning(
            "%s (scored --vlm-judge-default-score %g); the first, for sample index=%d: %r",
            counted,
            flags.vlm_judge_default_score,
            bad[0].index,
            first[:500],
        )
        return None
    return (
        f"{counted}, more than --vlm-judge-max-unparsable-frac {limit:g}: the rollout would train on "
        f"--vlm-judge-default-score. Make the judge answer 'Score: N' (--vlm-judge-prompt-file, --vlm-judge-max-tokens "
        f"{flags.vlm_judge_max_tokens}) or check --rm-model; the answer for sample index={bad[0].index}: {first[:200]!r}"
    )
