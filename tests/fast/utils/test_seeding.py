"""One recipe for id-derived random streams (miles/utils/seeding.py)."""

import random
import subprocess
import sys

import numpy as np
import torch

from miles.utils.seeding import seed_everything, stream_generator, stream_rng, stream_seed


def test_stream_seed_is_the_seed_sequence_of_the_ids():
    assert stream_seed(3, 1, 4) == int(np.random.SeedSequence([3, 1, 4]).generate_state(1)[0])
    assert stream_rng(3, 1, 4).integers(1 << 30) == np.random.default_rng([3, 1, 4]).integers(1 << 30)


def test_nearby_ids_give_different_streams_and_equal_ids_equal_ones():
    seeds = {stream_seed(0, rollout, index) for rollout in range(4) for index in range(16)}
    assert len(seeds) == 64
    a, b = stream_generator(1, 2, 3), stream_generator(1, 2, 3)
    assert torch.equal(torch.randn(5, generator=a), torch.randn(5, generator=b))


def test_negative_ids_are_accepted():
    assert stream_seed(-1, 0) == stream_seed((1 << 64) - 1, 0)


def test_the_stream_is_the_same_in_another_process():
    code = "from miles.utils.seeding import stream_seed; print(stream_seed(7, 11, 13))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", **__import__("os").environ},
    )
    assert int(out.stdout) == stream_seed(7, 11, 13)


def test_seed_everything_seeds_pythons_numpys_and_torchs_global_generators():
    draws = []
    for _ in range(2):
        seed_everything(11)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert draws[0] == draws[1]
    seed_everything(12)
    assert random.random() != draws[0][0]
