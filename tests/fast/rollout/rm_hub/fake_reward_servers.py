"""Misbehaving servers for the remote-reward tests, in one process: `python fake_reward_servers.py READY_FILE`.

- POST /flaky/<key>/<n>/score: the first n requests of each key answer 503, later ones 0.25 per sample.
- POST /garbage/<key>/score: 200 with a body that is not JSON.  /short/<key>/score: one reward too few.
- POST /v1/chat/completions: an OpenAI-style judge. It checks the request's shape (a text part, then base64 PNG
  image_url parts that decode) and answers by the prompt's first word after "Prompt: ": good -> "Score: 8",
  verbose -> reasoning then "**Score:** 6/10", frames -> "Score: <number of images sent>", none -> no score,
  malformed -> a reply without choices.
- GET /count/<key>: how many requests that key received.
"""

import base64
import io
import re
import socket
import sys
from collections import Counter

import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

COUNTS: Counter = Counter()


async def flaky(request):
    key, failures = request.path_params["key"], int(request.path_params["n"])
    COUNTS[key] += 1
    if COUNTS[key] <= failures:
        return JSONResponse({"error": "warming up"}, status_code=503)
    samples = (await request.json())["samples"]
    return JSONResponse({"rewards": [0.25] * len(samples), "extra": [{} for _ in samples]})


async def garbage(request):
    COUNTS[request.path_params["key"]] += 1
    return PlainTextResponse("<html>proxy error</html>")


async def short(request):
    COUNTS[request.path_params["key"]] += 1
    samples = (await request.json())["samples"]
    return JSONResponse({"rewards": [1.0] * (len(samples) - 1)})


async def chat(request):
    COUNTS["chat"] += 1
    body = await request.json()
    content = body["messages"][0]["content"]
    assert body["model"] and content[0]["type"] == "text", body
    images = 0
    for part in content[1:]:
        url = part["image_url"]["url"]
        assert part["type"] == "image_url" and url.startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).verify()
        images += 1
    word = re.search(r"Prompt: (\w+)", content[0]["text"]).group(1)
    answers = {
        "good": "Score: 8",
        "verbose": "The image shows a red circle; the score is not perfect.\n**Score:** 6/10",
        "frames": f"Score: {images}",
        "none": "I cannot rate this image.",
    }
    if word == "malformed":
        return JSONResponse({"id": "x", "object": "chat.completion"})
    message = {"role": "assistant", "content": answers[word]}
    return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


async def count(request):
    return JSONResponse({"count": COUNTS[request.path_params["key"]]})


app = Starlette(
    routes=[
        Route("/flaky/{key}/{n}/score", flaky, methods=["POST"]),
        Route("/garbage/{key}/score", garbage, methods=["POST"]),
        Route("/short/{key}/score", short, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/count/{key}", count),
    ]
)

if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    import os

    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
