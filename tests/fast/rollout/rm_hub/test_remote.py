"""A remote reward that answers slowly forever (it drips its answer a byte at a time, or never answers) is cut off by
the total deadline of each request (`--rm-timeout`), retried, and then fails naming the URL, the samples and the
deadline: the reward server's client (`--rm-url`) and the VLM judge alike."""

from __future__ import annotations

import asyncio
import contextlib
import socketserver
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from miles.arguments.parser import build_parser
from miles.rollout.rm_hub import RewardError, compute_rewards, reward_spec_from_args
from miles.utils.types import Sample

DRIP_EVERY_S = 0.05  # far below the per-read timeout: only a deadline on the whole request ends it


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.connections += 1
        self.request.recv(1 << 20)  # the request (its size is irrelevant: the answer never completes)
        if self.server.mode == "silent":  # keeps the connection open, says nothing
            self.server.stop.wait(60)
            return
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        try:
            self.request.sendall(head)
            while not self.server.stop.wait(DRIP_EVERY_S):
                self.request.sendall(b" ")
        except OSError:  # the client gave up and closed the connection
            return


@contextlib.contextmanager
def slow_server(mode: str) -> Iterator[tuple[str, socketserver.ThreadingTCPServer]]:
    """http://127.0.0.1:PORT of a server that drips a 200 answer a byte at a time (`drip`) or answers nothing
    (`silent`), on every path."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.mode, server.connections, server.stop = mode, 0, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def samples(num: int) -> list[Sample]:
    return [Sample(index=i, prompt=f"p{i}", image=np.zeros((8, 8, 3), dtype=np.uint8)) for i in range(num)]


@pytest.mark.parametrize(("reward", "mode"), [("server", "drip"), ("vlm_judge", "drip"), ("server", "silent")])
def test_a_slow_remote_reward_meets_the_deadline_then_fails_naming_url_samples_and_deadline(reward, mode):
    with slow_server(mode) as (base, server):
        common = ["--rm-timeout", "0.2", "--rm-retries", "1", "--rm-retry-backoff", "0.05"]
        if reward == "server":
            argv, endpoint, what = ["--rm-url", base, *common], f"{base}/score", "to score samples 0..2"
        else:
            argv = ["--rm-type", "vlm_judge", "--rm-url", base + "/v1", "--rm-model", "m", *common]
            endpoint, what = f"{base}/v1/chat/completions", "to judge sample index=0"
        args = build_parser().parse_args(argv)
        started = time.perf_counter()
        with pytest.raises(RewardError) as caught:
            asyncio.run(compute_rewards(args, samples(3), reward_spec_from_args(args)))
        took = time.perf_counter() - started
    message = str(caught.value)
    assert f"{endpoint} failed {what} after 2 attempt(s)" in message, message
    assert "no complete answer within the deadline of --rm-timeout 0.2s per request" in message, message
    assert 0.4 <= took < 3.0, took  # two attempts of 0.2 s and a backoff, not forever
    assert server.connections >= 2  # the retry was made
