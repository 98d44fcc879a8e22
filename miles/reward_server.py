"""Serve any built-in or custom reward over HTTP: `python -m miles.reward_server --rm-type shapes --port 8000`.

A training run scores it with `--rm-url http://host:8000` (docs/user-guide/reward-server.md; the wire format is in
`miles/rollout/rm_hub/remote.py`). Starlette + uvicorn (`pip install miles[server]`); requests that arrive together
are merged into one `compute_rewards` batch (`miles/reward_batcher.py`, up to --server-max-batch-size samples), scored
in one scoring thread (a reward model is loaded once and is not shared between threads), so `/health` answers while a
batch is scored. The reward flags (`--rm-type` with weights, `--custom-rm-path`, `--clip-model-path`, ...) are the
training parser's, with the same defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import json
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from miles.arguments.reward_spec import remote_rules, reward_model_problems, reward_spec_from_args
from miles.reward_batcher import RequestBatcher
from miles.utils.ranges import AT_LEAST_0, AT_LEAST_1, Range, range_violation

logger = logging.getLogger("miles.reward_server")
MISSING_EXTRA = (
    "the reward server needs starlette and uvicorn, the 'server' extra of miles: pip install 'miles[server]' "
    "(or pip install starlette uvicorn)"
)
MAX_BODY_BYTES = 512 * 1024 * 1024
SERVER_RANGES: dict[str, Range] = {"server_max_batch_size": AT_LEAST_1, "server_batch_wait_ms": AT_LEAST_0}


def require_server_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"{MISSING_EXTRA} ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    """The training parser's flags (so every reward finds the flags it reads) and the server's own."""
    from miles.arguments.parser import build_parser as training_parser

    parser = training_parser()
    parser.prog = "python -m miles.reward_server"
    parser.description = "Serve a miles reward (--rm-type, --custom-rm-path) over HTTP for --rm-url."
    add_server_arguments(parser)
    return parser


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (docs/user-guide/cli-reference.md lists them after the training flags)."""
    group = parser.add_argument_group("reward server (python -m miles.reward_server)")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on (0: any free port).")
    group.add_argument(
        "--server-token-env",
        default=None,
        help="Environment variable holding the bearer token every /score request must send (unset: no token).",
    )
    group.add_argument(
        "--server-max-batch-size",
        type=int,
        default=256,
        help="Most samples scored in one compute_rewards call: requests that arrive while a batch is scored (or "
        "within --server-batch-wait-ms) are merged up to this many samples, never splitting a request (1: each "
        "request alone).",
    )
    group.add_argument(
        "--server-batch-wait-ms",
        type=float,
        default=0.0,
        help="Milliseconds an idle server waits after a request for others to merge with it (0: none, the first "
        "request is scored at once; requests that queue behind a batch being scored merge either way).",
    )
    group.add_argument("--ready-file", default=None, help="Write the bound port here once listening (for scripts).")


def server_rules(args: argparse.Namespace) -> list[str]:
    """The server flags' SERVER_RANGES (the training parser's parse-time range check knows only its own flags)."""
    return [problem for dest in SERVER_RANGES if (problem := range_violation(dest, getattr(args, dest), SERVER_RANGES))]


def jsonable_extra(entries: dict[str, Any]) -> dict[str, Any]:
    """The entries of a sample's extra that JSON can carry (others, such as arrays, stay on the server)."""
    out = {}
    for key, value in entries.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def token_accepted(authorization: str, token: str | None) -> bool:
    """Whether a request's Authorization header carries the server's bearer `token` (any request when it has none)."""
    return token is None or hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def decode_score_request(body: bytes) -> list[Any]:
    """The samples of a POST /score body; a ValueError saying what is wrong with it (a 400)."""
    from miles.rollout.rm_hub.remote import WIRE_VERSION, decode_sample

    payload = json.loads(body)
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        raise ValueError("the body must be an object with a 'samples' list")
    if payload.get("version", WIRE_VERSION) != WIRE_VERSION:
        raise ValueError(f"wire version {payload.get('version')!r}; this server speaks {WIRE_VERSION}")
    return [decode_sample(record, k) for k, record in enumerate(payload["samples"])]


def create_app(args: argparse.Namespace, spec: list[tuple[str, float]], token: str | None = None) -> Any:
    """The Starlette app: GET /health, POST /score (schema in miles/rollout/rm_hub/remote.py)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from miles.rollout.rm_hub import RewardError, compute_rewards
    from miles.rollout.rm_hub.remote import WIRE_VERSION

    scorer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
    rm_type = ",".join(f"{name}:{weight:g}" for name, weight in spec)

    def score_batch(samples: list[Any]) -> list[tuple[float, dict[str, Any]]]:
        """(weighted total, JSON extra entries the rewards added) per sample."""
        before = [dict(sample.extra) for sample in samples]
        totals, _ = asyncio.run(compute_rewards(args, samples, spec))
        added = [
            jsonable_extra({k: v for k, v in sample.extra.items() if k not in old or old[k] is not v})
            for sample, old in zip(samples, before)
        ]
        return list(zip(totals, added))

    batcher = RequestBatcher(
        score_batch,
        max_batch_size=args.server_max_batch_size,
        wait_s=args.server_batch_wait_ms / 1000.0,
        executor=scorer,
    )

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {"status": "ok", "version": WIRE_VERSION, "rm_type": rm_type, "batching": batcher.describe()}
        )

    async def score(request: Request) -> JSONResponse:
        if not token_accepted(request.headers.get("authorization", ""), token):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return JSONResponse({"error": f"request of {len(body)} bytes exceeds {MAX_BODY_BYTES}"}, status_code=413)
        try:
            samples = decode_score_request(body)
        except ValueError as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        try:
            scored = await batcher.submit(samples)
        except RewardError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        except Exception as exc:  # a reward server stays up; the client names the URL and the message
            logger.exception("scoring failed")
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse({"rewards": [total for total, _ in scored], "extra": [extra for _, extra in scored]})

    return Starlette(routes=[Route("/health", health), Route("/score", score, methods=["POST"])])


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    require_server_extra()
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO), format="%(asctime)s %(name)s %(message)s"
    )
    errors = remote_rules(args) + server_rules(args)  # remote_rules: a served vlm_judge, or a server behind another
    if errors:
        parser.error("; ".join(errors))
    try:
        spec = reward_spec_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    problems = reward_model_problems(args, spec)  # a CLIP reward without its model folder: refused before serving
    if problems:
        parser.error("; ".join(problems))
    token = None
    if args.server_token_env:
        token = os.environ.get(args.server_token_env)
        if not token:
            parser.error(f"--server-token-env {args.server_token_env}: the environment variable is not set or empty")
    import uvicorn

    app = create_app(args, spec, token)  # imports the rewards' modules before the ready file says "listening"
    # the socket is bound (and listening) before uvicorn starts, so --port 0 gets a free port the ready file names
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        parser.error(f"--host {args.host} --port {args.port}: cannot listen there ({exc.strerror})")
    sock.listen(2048)
    port = sock.getsockname()[1]
    logger.info("serving rewards %s on http://%s:%d", spec, args.host, port)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(args.ready_file + ".tmp", args.ready_file)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
