#!/usr/bin/env bash
# The README's main command: installs on first use, then runs the demo job (extra args override the config).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec python train_diffusion.py --config configs/sft_tiny_shapes.yaml "$@"
