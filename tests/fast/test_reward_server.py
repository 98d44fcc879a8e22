"""The reward server (`python -m miles.reward_server`) and its client (`--rm-url`), each a real process on loopback:
served rewards equal the same reward in process, weighted like a local one; garbage answers, short answers, a
killed server and a refused token fail naming the URL (and the rollout); retries back off and are counted."""

import asyncio
import os
import sys
import time

import httpx
import numpy as np
import pytest

from miles.arguments.parser import build_parser
from miles.arguments.reward_spec import remote_rules
from miles.data.shapes import shapes_items
from miles.ray.reward_workers import RewardWorkerPool
from miles.rollout.rm_hub import RewardError, compute_rewards, reward_spec_from_args
from miles.rollout.rm_hub.remote import RemoteFlags, backoff_s, decode_sample, encode_sample
from miles.utils.types import Sample
from tests.fast.rollout.rm_hub.reward_processes import fake_servers, reward_server

BRIGHTNESS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "rewards.py") + ":brightness"
SLOW = os.path.join(os.path.dirname(__file__), "rollout", "rm_hub", "slow_rewards.py") + ":slow_brightness"
TOKEN = "s3cret-token"


def flags(*argv):
    return build_parser().parse_args(list(argv))


def shape_samples(num):
    items = shapes_items(num, seed=5)
    return [
        Sample(index=i, prompt=it["prompt"], metadata=it["metadata"], image=it["image"]) for i, it in enumerate(items)
    ]


def video_samples(num):
    rng = np.random.default_rng(0)
    return [
        Sample(index=i, prompt=f"clip {i}", frames=rng.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8), fps=8.0)
        for i in range(num)
    ]


def score(args, samples, rollout_id=0):
    return RewardWorkerPool(args, reward_spec_from_args(args), num_workers=0).score(samples, rollout_id)


SERVED = "shapes:1,custom:2"  # the shapes reward plus twice tests/e2e/rewards.py's brightness


@pytest.fixture(scope="module")
def served():
    env = {"MILES_TEST_SERVER_TOKEN": TOKEN}
    with reward_server(
        "--rm-type", SERVED, "--custom-rm-path", BRIGHTNESS, "--server-token-env", "MILES_TEST_SERVER_TOKEN", env=env
    ) as (_, url):
        yield url


@pytest.fixture(scope="module")
def fake():
    with fake_servers() as (_, url):
        yield url


def test_samples_cross_the_wire_losslessly():
    image, video = shape_samples(1)[0], video_samples(1)[0]
    back = decode_sample(encode_sample(image), 0)
    assert np.array_equal(back.image, image.image) and back.metadata == image.metadata and back.prompt == image.prompt
    back = decode_sample(encode_sample(video), 0)
    assert np.array_equal(back.frames, video.frames) and back.fps == 8.0 and back.image is None


def test_served_rewards_equal_in_process_weigh_like_a_local_reward_and_need_the_token(served, monkeypatch):
    url = served
    with httpx.Client() as client:
        health = client.get(url + "/health").json()
    assert {k: health[k] for k in ("status", "version", "rm_type")} == {"status": "ok", "version": 1, "rm_type": SERVED}
    local, remote = shape_samples(64), shape_samples(64)
    expected, terms = asyncio.run(
        compute_rewards(flags("--custom-rm-path", BRIGHTNESS), local, [("shapes", 1.0), ("custom", 2.0)])
    )
    brightness = [float(np.asarray(s.image, dtype=np.float32).mean() / 255.0) for s in local]  # by hand
    assert expected == pytest.approx([a + 2 * b for a, b in zip(terms["shapes"], brightness)], abs=1e-6)
    # 64 samples in 4 concurrent requests of 16; a local jpeg reward plus the served one at weight 0.5
    monkeypatch.setenv("MILES_TEST_CLIENT_TOKEN", TOKEN)
    args = flags(
        "--rm-type",
        "jpeg_compressibility",
        "--rm-url",
        url,
        "--rm-url-weight",
        "0.5",
        "--rm-token-env",
        "MILES_TEST_CLIENT_TOKEN",
    )
    assert reward_spec_from_args(args) == [("jpeg_compressibility", 1.0), ("remote0", 0.5)]
    totals, per_reward = score(args, remote)
    assert per_reward["remote0"] == expected  # bit for bit: PNG is lossless
    assert totals == [a + 0.5 * b for a, b in zip(per_reward["jpeg_compressibility"], expected)]
    assert [s.extra["shapes"] for s in remote] == [s.extra["shapes"] for s in local]  # the served extras came back
    assert len(set(expected)) > 3  # the batch is not degenerate
    for token in (None, "wrong"):  # no token, a wrong one: refused at once, not retried
        if token is None:
            monkeypatch.delenv("MILES_TEST_CLIENT_TOKEN")
            args = flags("--rm-url", url)
        else:
            monkeypatch.setenv("MILES_TEST_CLIENT_TOKEN", token)
            args = flags("--rm-url", url, "--rm-token-env", "MILES_TEST_CLIENT_TOKEN")
        started = time.perf_counter()
        with pytest.raises(RewardError, match=rf"{url}/score refused .*HTTP 401, the bearer token was refused"):
            score(args, remote[:2])
        assert time.perf_counter() - started < 0.9  # the first retry would wait 1 s


def post_together(url, bodies):
    async def send():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url + "/score", json=body) for body in bodies))

    return asyncio.run(send())


def test_concurrent_requests_merge_into_batches_answered_as_if_each_was_scored_alone():
    samples = shape_samples(24)
    chunks = [samples[start : start + 4] for start in range(0, 24, 4)]
    poison = Sample(index=99, prompt="poison", image=samples[0].image)
    bodies = [{"version": 1, "samples": [encode_sample(s) for s in chunk]} for chunk in [*chunks, [poison]]]
    with reward_server("--rm-type", "custom", "--custom-rm-path", SLOW) as (_, url):
        replies = post_together(url, bodies)
        stats = httpx.get(url + "/health").json()["batching"]
    alone = [
        asyncio.run(compute_rewards(flags("--custom-rm-path", BRIGHTNESS), c, [("custom", 1.0)]))[0] for c in chunks
    ]
    assert [reply.status_code for reply in replies] == [200] * 6 + [422]
    assert [reply.json()["rewards"] for reply in replies[:6]] == alone  # slow_brightness is brightness, bit for bit
    assert "prompt='poison': ValueError: refusing the poison prompt" in replies[6].json()["error"]
    assert stats["requests"] == 7 and stats["samples"] == 25
    # 7 requests sent together to a reward that takes 0.3 s per call: they queue and merge (evidence of merging)
    assert stats["batches"] < 7 and stats["largest_batch_requests"] >= 2, stats
    assert (stats["max_batch_size"], stats["wait_ms"]) == (256, 0.0)


def test_retries_back_off_then_succeed_or_fail_naming_url_and_rollout(fake):
    samples = shape_samples(3)
    args = flags("--rm-url", f"{fake}/flaky/a/2", "--rm-retries", "2", "--rm-retry-backoff", "0.1")
    started = time.perf_counter()
    totals, _ = score(args, samples)
    assert totals == [0.25] * 3 and time.perf_counter() - started >= 0.1 + 0.2  # backoff 0.1 s, then 0.2 s
    assert httpx.get(f"{fake}/count/a").json()["count"] == 3
    assert [backoff_s(RemoteFlags.from_args(args), k) for k in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4]
    args = flags("--rm-url", f"{fake}/flaky/b/5", "--rm-retries", "1", "--rm-retry-backoff", "0")
    with pytest.raises(
        RewardError,
        match=rf"'remote0': {fake}/flaky/b/5/score failed .* after 2 attempt\(s\) .*HTTP 503: warming up \[score of rollout 4\]",
    ):
        score(args, samples, rollout_id=4)
    assert httpx.get(f"{fake}/count/b").json()["count"] == 2


@pytest.mark.parametrize(
    ("path", "why"),
    [("garbage", "the answer is not JSON: '<html>"), ("short", "malformed answer \\('rewards' must be a list of 3")],
)
def test_a_malformed_answer_fails_naming_the_url(fake, path, why):
    url = f"{fake}/{path}/{path}"
    with pytest.raises(RewardError, match=rf"{url}/score failed to score samples 0..2 after 3 attempt\(s\).*{why}"):
        score(flags("--rm-url", url, "--rm-retry-backoff", "0"), shape_samples(3), rollout_id=2)
    assert httpx.get(f"{fake}/count/{path}").json()["count"] == 3


def test_a_killed_server_fails_naming_url_and_rollout():
    samples = shape_samples(4)
    with fake_servers() as (process, base):
        url = f"{base}/flaky/k/0"
        args = flags("--rm-url", url, "--rm-retries", "1", "--rm-retry-backoff", "0.01")
        assert score(args, samples)[0] == [0.25] * 4
        process.kill()
        process.wait(timeout=30)
        with pytest.raises(
            RewardError, match=rf"{url}/score failed .* after 2 attempt\(s\).*ConnectError.*\[score of rollout 7\]"
        ):
            score(args, samples, rollout_id=7)


def test_rules_name_the_flags(monkeypatch):
    monkeypatch.delenv("MILES_TEST_UNSET", raising=False)
    errors = remote_rules(
        flags(
            "--rm-url",
            "host:8000",
            "--rm-url",
            "http://b",
            "--rm-url-weight",
            "1",
            "--rm-token-env",
            "MILES_TEST_UNSET",
            "--rm-model",
            "m",
        )
    )
    assert errors == [
        "--rm-url 'host:8000' must start with http:// or https://",
        "--rm-model names the VLM judge's model; it needs --rm-type vlm_judge",
        "--rm-url-weight: 1 weights for 2 --rm-url; give one per --rm-url",
        "--rm-token-env MILES_TEST_UNSET: the environment variable MILES_TEST_UNSET is not set or empty",
    ]
    errors = remote_rules(flags("--rm-type", "vlm_judge", "--vlm-judge-prompt-file", "/nonexistent/t.txt"))
    assert errors[0].startswith("--rm-type vlm_judge needs exactly one --rm-url")
    assert errors[1:] == [
        "--rm-type vlm_judge needs --rm-model, the model name the judge's server serves",
        "--vlm-judge-prompt-file /nonexistent/t.txt: file not found",
    ]
    # the judge's URL is not a reward server; without --rm-type the servers alone are the spec
    assert reward_spec_from_args(flags("--rm-type", "vlm_judge:2", "--rm-url", "http://j/v1", "--rm-model", "m")) == [
        ("vlm_judge", 2.0)
    ]
    assert reward_spec_from_args(flags("--rm-url", "http://a", "--rm-url", "http://b")) == [
        ("remote0", 1.0),
        ("remote1", 1.0),
    ]


def test_without_the_server_extra_the_error_names_it(monkeypatch):
    from miles import reward_server as server_module

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    with pytest.raises(SystemExit, match=r"pip install 'miles\[server\]'"):
        server_module.require_server_extra()
