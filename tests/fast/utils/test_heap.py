"""miles.utils.heap: a CPU actor keeps the memory it frees, so the next rollout does not fault its pages in again."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# three 20 MB blocks allocated, written and freed per round, as a rollout does with its activations: the page faults
# of five rounds after two warm-up rounds
ROUNDS = f"""
import ctypes, ctypes.util, resource, sys
sys.path.insert(0, {ROOT!r})
from miles.utils.heap import keep_freed_memory
from miles.utils.heap import TRAINER_MMAP_THRESHOLD
modes = {{"keep": {{}}, "trainer": {{"mmap_threshold": TRAINER_MMAP_THRESHOLD}}}}
kept = keep_freed_memory(**modes[sys.argv[1]]) if sys.argv[1] in modes else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def one_round():
    blocks = [libc.malloc(20 << 20) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, 20 << 20)
    for block in blocks:
        libc.free(block)
one_round(); one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def rounds(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_with_the_process_and_user_settings_win():
    kept, faults = rounds("keep")
    _, default_faults = rounds("default")
    assert kept == "True"
    # glibc's own thresholds trim the freed 60 MB and fault it in again every round (~15k pages a round)
    assert default_faults > 5 * 10_000, default_faults
    assert faults < default_faults / 10, (faults, default_faults)
    kept, _ = rounds("keep", MALLOC_TRIM_THRESHOLD_="5")  # the user's own allocator setting stands
    assert kept == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_trainer_rank_hands_blocks_of_a_gathered_parameters_size_back_to_the_kernel():
    kept, faults = rounds("trainer")  # the 20 MB blocks (a gathered FSDP2 parameter's size) are not kept
    _, kept_faults = rounds("keep")
    assert kept == "True" and faults > 5 * 10_000 > kept_faults, (faults, kept_faults)
