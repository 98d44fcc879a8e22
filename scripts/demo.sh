#!/usr/bin/env bash
# The README's main command: installs on first use, then runs the default job (DiffusionNFT on the shipped shapes model).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec python train_diffusion.py "$@"
