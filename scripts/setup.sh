#!/usr/bin/env bash
# Create .venv and install miles the first time: torch pinned FIRST (an unpinned torch pulls a multi-GB CUDA build
# on CPU machines), then the package with its dev extra. Later calls only activate the venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MILES_VENV:-$root/.venv}"
stamp="$venv/.miles-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing into $venv (first run: about a minute)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$venv/bin/python" -m pip install -q "torch==${MILES_TORCH_VERSION:-2.13.0}" --index-url "${MILES_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}" \
        || "$venv/bin/python" -m pip install -q "torch==${MILES_TORCH_VERSION:-2.13.0}"
    else
      "$venv/bin/python" -m pip install -q "torch==${MILES_TORCH_VERSION:-2.13.0}"
    fi
  fi
  "$venv/bin/python" -m pip install -q -e "$root[dev]"
  touch "$stamp"
fi
# miles' own bytecode, written ahead: with PYTHONDONTWRITEBYTECODE set (as on CI machines) every process would
# recompile miles from source, ~0.5-1 s in each Ray actor; up-to-date files are skipped (~0.1 s)
"$venv/bin/python" -m compileall -q "$root/miles" "$root/train_diffusion.py" >/dev/null
# shellcheck disable=SC1091
source "$venv/bin/activate"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
