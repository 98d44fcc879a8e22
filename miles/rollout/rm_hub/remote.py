"""Rewards scored by another process over HTTP: the wire format of `python -m miles.reward_server` (docs/user-guide/
reward-server.md) and its client (`--rm-url`), with a total deadline per request (`--rm-timeout`), bounded retries with
backoff and a bearer token.

Wire format (version 1), JSON both ways, media as base64 PNG (lossless, so a served reward sees the same pixels):

    POST /score   {"version": 1, "samples": [SAMPLE, ...]}
      SAMPLE      {"index": int, "prompt": str, "metadata": {...}, "group_index": int, "seed": int,
                   "image": "<base64 PNG>"}                                  (an image sample)
                  {..., "frames": ["<base64 PNG>", ...], "fps": float}        (a video sample: one PNG per frame)
                  {..., "source_images": ["<base64 PNG>", ...]}              (editing / image-to-video inputs)
    200           {"rewards": [float, ...], "extra": [{...}, ...]}           (one of each per sample, in order)
    4xx / 5xx     {"error": "why"}
    GET /health   {"status": "ok", "version": 1, "rm_type": "shapes", "batching": {...}}   (the merging counters)

Audio is not sent. `extra` holds the JSON-serialisable `sample.extra` entries the served reward added (the shapes
reward's per-field scores), copied into the caller's samples.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from miles.arguments.records import FlagRecord
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
T = TypeVar("T")
MAX_BACKOFF_S = 30.0
# answers worth another attempt: the server is overloaded, restarting, or behind a failing proxy
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """A remote reward (a reward server, a VLM judge) failed; the message names the URL. compute_rewards raises it
    as it is (a RewardError), without re-sending the batch sample by sample to locate a culprit."""


class FatalReply(Exception):
    """An answer that another attempt would not change (a refused token, a reward that raised on the server)."""


# ---- media -----------------------------------------------------------------------------------------------------
def png_b64(array: Any) -> str:
    """Base64 of the PNG of an (H, W, 3) uint8 image (float arrays in [0, 1] are rounded to uint8 first)."""
    image = np.asarray(array)
    if np.issubdtype(image.dtype, np.floating):
        image = np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"an image to send must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)  # level 1: ~3x faster, ~10% larger
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_from_b64(text: str, what: str) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Exception as exc:
        raise ValueError(f"{what} is not a base64 PNG ({type(exc).__name__}: {exc})") from None


def encode_sample(sample: Sample) -> dict[str, Any]:
    """One SAMPLE of the wire format (module docstring)."""
    out: dict[str, Any] = {
        "index": int(sample.index),
        "prompt": sample.prompt,
        "metadata": sample.metadata,
        "group_index": int(sample.group_index),
        "seed": int(sample.seed),
    }
    if sample.frames is not None:
        out["frames"] = [png_b64(frame) for frame in np.asarray(sample.frames)]
        out["fps"] = float(sample.fps) if sample.fps is not None else None
    elif sample.image is not None:
        out["image"] = png_b64(sample.image)
    if sample.source_images is not None:
        out["source_images"] = [png_b64(np.asarray(image)) for image in sample.source_images]
    return out


def decode_sample(record: Any, position: int) -> Sample:
    """The Sample a SAMPLE describes; a malformed one is a ValueError naming its position and field."""
    where = f"samples[{position}]"
    if not isinstance(record, dict):
        raise ValueError(f"{where} is {type(record).__name__}, expected an object")
    if not isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}.prompt must be a string")
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}.metadata must be an object")
    sample = Sample(
        index=int(record.get("index", position)),
        prompt=record["prompt"],
        metadata=metadata,
        group_index=int(record.get("group_index", 0)),
        seed=int(record.get("seed", 0)),
    )
    if "frames" in record:
        frames = record["frames"]
        if not isinstance(frames, list) or not frames:
            raise ValueError(f"{where}.frames must be a non-empty list of base64 PNGs")
        sample.frames = np.stack([png_from_b64(f, f"{where}.frames[{k}]") for k, f in enumerate(frames)])
        sample.fps = float(record["fps"]) if record.get("fps") is not None else None
    elif "image" in record:
        sample.image = png_from_b64(record["image"], f"{where}.image")
    if "source_images" in record:
        sources = record["source_images"]
        if not isinstance(sources, list) or not sources:
            raise ValueError(f"{where}.source_images must be a non-empty list of base64 PNGs")
        sample.source_images = [png_from_b64(x, f"{where}.source_images[{k}]") for k, x in enumerate(sources)]
    return sample


# ---- HTTP with retries -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteFlags(FlagRecord):
    """The flags of the remote rewards' requests (`miles.arguments.rewards`: the remote rewards' group)."""

    rm_timeout: float
    rm_retries: int
    rm_retry_backoff: float
    rm_token_env: str | None
    rm_batch_size: int
    rm_max_concurrency: int


def bearer_headers(flags: RemoteFlags) -> dict[str, str]:
    """`Authorization: Bearer <token>` from the environment variable --rm-token-env names (none when unset)."""
    name = flags.rm_token_env
    if not name:
        return {}
    token = os.environ.get(name)
    if not token:
        raise RemoteRewardError(f"--rm-token-env {name}: the environment variable {name} is not set or empty")
    return {"Authorization": f"Bearer {token}"}


def backoff_s(flags: RemoteFlags, attempt: int) -> float:
    """Seconds before attempt `attempt + 1`: --rm-retry-backoff * 2**attempt, at most 30 s."""
    return min(flags.rm_retry_backoff * 2.0**attempt, MAX_BACKOFF_S)


async def post_json(
    client: Any,
    url: str,
    body: dict[str, Any],
    flags: RemoteFlags,
    parse: Callable[[Any], T],
    what: str,
) -> T:
    """POST `body` to `url` and return `parse(reply JSON)`. Each attempt has --rm-timeout seconds in all, from the
    connection to the answer's last byte (a server that drips its answer, or keeps the connection open, is cut off
    there: a per-read timeout alone would wait forever). A refused connection, a timeout, a 408/429/5xx answer, a
    body that is not JSON, or one `parse` rejects (ValueError) is retried --rm-retries times with backoff; a 4xx
    answer (a refused token, a bad request, a reward that raised there) is not. The last failure raises
    RemoteRewardError naming `url`, `what`, the deadline and the attempts."""
    import httpx

    attempts = flags.rm_retries + 1
    headers = bearer_headers(flags)
    problem = ""
    for attempt in range(attempts):
        if attempt:
            delay = backoff_s(flags, attempt - 1)
            logger.warning("%s: %s; attempt %d of %d in %.1fs", url, problem, attempt + 1, attempts, delay)
            await asyncio.sleep(delay)
        try:
            response = await asyncio.wait_for(client.post(url, json=body, headers=headers), flags.rm_timeout)
            if response.status_code != 200:
                detail = _error_text(response)
                problem = f"HTTP {response.status_code}: {detail}"
                if response.status_code in (401, 403):
                    raise FatalReply(f"HTTP {response.status_code}, the bearer token was refused (--rm-token-env)")
                if response.status_code not in RETRY_STATUS:
                    raise FatalReply(problem)
                continue
            try:
                reply = response.json()
            except ValueError:
                problem = f"the answer is not JSON: {response.text[:200]!r}"
                continue
            try:
                return parse(reply)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                problem = f"malformed answer ({exc}): {response.text[:200]!r}"
                continue
        except FatalReply as exc:
            raise RemoteRewardError(f"{url} refused {what}: {exc}") from None
        except (httpx.TimeoutException, asyncio.TimeoutError):
            problem = f"no complete answer within the deadline of --rm-timeout {flags.rm_timeout:g}s per request"
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc or 'connection failed'}"
    raise RemoteRewardError(
        f"{url} failed {what} after {attempts} attempt(s) (--rm-retries {flags.rm_retries}): {problem}"
    )


def _error_text(response: Any) -> str:
    try:
        reply = response.json()
        if isinstance(reply, dict) and "error" in reply:
            return str(reply["error"])[:500]
    except ValueError:
        pass
    text: str = response.text[:200]
    return text


def http_client(flags: RemoteFlags) -> Any:
    """The client of the remote rewards; its per-read timeout backs up `post_json`'s total deadline."""
    import httpx

    return httpx.AsyncClient(timeout=flags.rm_timeout)


# ---- the reward server's client ----------------------------------------------------------------------------------
def parse_score_reply(reply: Any, count: int) -> tuple[list[float], list[dict[str, Any]]]:
    """(rewards, extra) of a /score answer for `count` samples; anything else is a ValueError saying what."""
    if not isinstance(reply, dict) or "rewards" not in reply:
        raise ValueError("no 'rewards' list")
    rewards, extra = reply["rewards"], reply.get("extra") or [{} for _ in range(count)]
    if not isinstance(rewards, list) or len(rewards) != count:
        raise ValueError(f"'rewards' must be a list of {count} numbers, got {str(rewards)[:80]}")
    values = []
    for value in rewards:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"'rewards' holds {value!r}, not a finite number")
        values.append(float(value))
    if not isinstance(extra, list) or len(extra) != count or not all(isinstance(e, dict) for e in extra):
        raise ValueError(f"'extra' must be a list of {count} objects")
    return values, extra


def server_rewards(url: str) -> Callable[[argparse.Namespace, list[Sample]], Any]:
    """The reward a server at `url` scores: the batch in --rm-batch-size requests sent concurrently (at most
    --rm-max-concurrency at a time), each answer's `extra` copied into its samples."""
    endpoint = url.rstrip("/") + "/score"

    async def remote(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
        flags = RemoteFlags.from_args(args)
        size = flags.rm_batch_size
        chunks = [samples[start : start + size] for start in range(0, len(samples), size)]
        gate = asyncio.Semaphore(flags.rm_max_concurrency)

        async def send(client: Any, chunk: list[Sample]) -> list[float]:
            body = {
                "version": WIRE_VERSION,
                "samples": await asyncio.to_thread(lambda: list(map(encode_sample, chunk))),
            }
            what = f"to score samples {chunk[0].index}..{chunk[-1].index}"
            async with gate:
                values, extra = await post_json(
                    client, endpoint, body, flags, lambda reply: parse_score_reply(reply, len(chunk)), what
                )
            for sample, entries in zip(chunk, extra):
                sample.extra.update(entries)
            return values

        async with http_client(flags) as client:
            parts = await asyncio.gather(*(send(client, chunk) for chunk in chunks), return_exceptions=True)
        values: list[float] = []
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            values.extend(part)
        return values

    remote.__name__ = f"remote reward {url}"
    return remote
