"""`--rm-type vlm_judge` against a local process speaking the chat-completions API (fake_reward_servers.py): scores
parsed by the documented rule, key frames of a video, malformed and unparsable answers as errors or as a default,
counted in the metrics."""

import asyncio

import numpy as np
import pytest

from miles.arguments.parser import build_parser
from miles.ray.reward_workers import RewardWorkerPool
from miles.rollout.rm_hub import RewardError, compute_rewards, reward_metrics
from miles.rollout.rm_hub.vlm_judge import key_frames, parse_judge_score
from miles.utils.types import Sample
from tests.fast.rollout.rm_hub.reward_processes import fake_servers


@pytest.fixture(scope="module")
def judge_url():
    with fake_servers() as (_, url):
        yield url + "/v1"


def judge_args(url, *extra):
    return build_parser().parse_args(["--rm-type", "vlm_judge", "--rm-url", url, "--rm-model", "qwen-vl", *extra])


def image_sample(index, word):
    return Sample(index=index, prompt=word, image=np.full((16, 16, 3), 40 * index, dtype=np.uint8))


def judge(args, samples):
    return asyncio.run(compute_rewards(args, samples, [("vlm_judge", 1.0)]))


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("Score: 7", 0.7),
        ("score=10", 1.0),
        ("**Score:** 6/10", 0.6),
        ("The score is 4.5", 0.45),
        ("Its score is unclear. Final score: 3", 0.3),  # the last "score" with a number
        ("  9 ", 0.9),  # a lone number
        ("0", 0.0),
        ("Score: 11", None),  # outside [0, max]
        ("Score: -1", None),
        ("I would give it a 7", None),  # a number that is neither after "score" nor alone
        ("", None),
    ],
)
def test_score_rule(answer, score):
    got = parse_judge_score(answer, 10.0)
    assert got == (None if score is None else pytest.approx(score))


def test_key_frames_are_evenly_spaced_with_both_ends():
    frames = np.arange(10)[:, None, None, None] * np.ones((1, 2, 2, 3), dtype=np.uint8)
    assert [int(f[0, 0, 0]) for f in key_frames(frames, 4)] == [0, 3, 6, 9]
    assert [int(f[0, 0, 0]) for f in key_frames(frames[:2], 4)] == [0, 1]


def test_well_formed_answers_are_scored_and_videos_send_key_frames(judge_url):
    video = Sample(index=2, prompt="frames", frames=np.zeros((10, 8, 8, 3), dtype=np.uint8), fps=8.0)
    samples = [image_sample(0, "good"), image_sample(1, "verbose"), video]
    totals, per_reward = judge(judge_args(judge_url, "--vlm-judge-frames", "3"), samples)
    assert totals == pytest.approx([0.8, 0.6, 0.3]) == per_reward["vlm_judge"]  # 3 key frames -> "Score: 3"
    assert reward_metrics(totals, per_reward, samples)["rollout/vlm_judge_unparsable_frac"] == 0.0


def test_unparsable_answers_fail_or_score_the_default_and_are_counted(judge_url):
    samples = [image_sample(0, "good"), image_sample(1, "none"), image_sample(2, "good")]
    with pytest.raises(
        RewardError,
        match=rf"{judge_url}/chat/completions: the judge's answer for sample index=1 has no score in \[0, 10\].*'I cannot rate this image.'",
    ):
        judge(judge_args(judge_url), samples)
    args = judge_args(judge_url, "--vlm-judge-unparsable", "default", "--vlm-judge-default-score", "-1")
    totals, per_reward = judge(args, samples)
    assert totals == pytest.approx([0.8, -1.0, 0.8])
    metrics = reward_metrics(totals, per_reward, samples)
    assert (metrics["rollout/vlm_judge_unparsable"], metrics["rollout/vlm_judge_unparsable_frac"]) == (
        1,
        pytest.approx(1 / 3),
    )
    assert samples[1].extra["vlm_judge"] == {"unparsable": 1.0, "answer": "I cannot rate this image."}


def test_a_judge_that_rarely_scores_fails_the_rollout_naming_the_judge_and_an_answer(judge_url, caplog):
    """Under --vlm-judge-unparsable default: a few unparsable answers are logged with the first one; more than
    --vlm-judge-max-unparsable-frac of a rollout's fail the rollout instead of training on the default."""
    args = judge_args(judge_url, "--vlm-judge-unparsable", "default", "--vlm-judge-max-unparsable-frac", "0.5")
    pool = RewardWorkerPool(args, [("vlm_judge", 1.0)], num_workers=0)
    with caplog.at_level("WARNING", logger="miles.rollout.rm_hub.vlm_judge"):
        totals, _ = pool.score([image_sample(0, "good"), image_sample(1, "none"), image_sample(2, "good")], 3)
    assert totals == pytest.approx([0.8, 0.0, 0.8])  # 1 of 3: within the limit, scored the default
    assert "1 of 3 answers of the VLM judge qwen-vl at" in caplog.text
    assert "the first, for sample index=1: 'I cannot rate this image.'" in caplog.text
    with pytest.raises(RewardError) as caught:
        pool.score([image_sample(0, "none"), image_sample(1, "good"), image_sample(2, "none")], 4)
    message = str(caught.value)
    assert f"2 of 3 answers of the VLM judge qwen-vl at {judge_url} had no score in [0, 10]" in message
    assert "more than --vlm-judge-max-unparsable-frac 0.5" in message
    assert "sample index=0: 'I cannot rate this image.' [score of rollout 4]" in message


def test_a_malformed_reply_is_retried_then_fails_naming_the_url(judge_url):
    args = judge_args(judge_url, "--rm-retries", "1", "--rm-retry-backoff", "0")
    with pytest.raises(
        RewardError,
        match=rf"{judge_url}/chat/completions failed to judge sample index=0 after 2 attempt\(s\).*malformed answer \(no 'choices' list\)",
    ):
        judge(args, [image_sample(0, "malformed")])
