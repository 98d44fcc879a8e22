"""Helpers of `scripts/gpu_check.sh --no-setup`, which installs nothing:

    python scripts/gpu_check_wheels.py WHEELS_DIR SITE_DIR   # unpack each wheel whose distribution is not installed
    python scripts/gpu_check_wheels.py --report              # GPU, driver, torch, CUDA and the packages still missing

A wheel is a zip of the files an install would copy into site-packages: unpacked into SITE_DIR and put on PYTHONPATH,
its modules import as if installed (a package that is installed already keeps its installed version).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import zipfile

# the modules the Ray-free core imports besides torch (scripts/gpu_check_core.py, benchmarks/bench_gpu.py)
NEEDED = ["diffusers", "transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "peft", "numpy"]


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def unpack(wheels: str, site: str) -> list[str]:
    """Unpack into `site` each wheel in `wheels` whose distribution is not installed; the names unpacked."""
    if not os.path.isdir(wheels):
        raise SystemExit(f"--wheels {wheels}: no such folder (see the pip download command in scripts/gpu_check.sh)")
    os.makedirs(site, exist_ok=True)
    unpacked = []
    for name in sorted(os.listdir(wheels)):
        if not name.endswith(".whl"):
            continue
        distribution = re.split(r"-\d", name, maxsplit=1)[0]
        if installed(distribution) or installed(distribution.replace("_", "-")):
            continue
        with zipfile.ZipFile(os.path.join(wheels, name)) as wheel:
            wheel.extractall(site)
        unpacked.append(distribution)
    print(f"[gpu_check] unpacked from {wheels}: {', '.join(unpacked) or 'nothing (all installed)'}", file=sys.stderr)
    return unpacked


def report() -> None:
    import torch

    print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    try:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        print("nvidia-smi:", subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.TimeoutExpired) as exc:
        print("nvidia-smi:", exc)
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    ray = "present" if importlib.util.find_spec("ray") else "absent (not needed)"
    print(f"RESULT: missing {', '.join(missing) or 'nothing'}; ray {ray}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--report"]:
        report()
    elif len(sys.argv) == 3:
        unpack(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit(__doc__)
