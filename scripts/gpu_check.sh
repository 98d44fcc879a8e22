#!/usr/bin/env bash
# The first checks on a GPU machine, in about 10 minutes, ending with one summary table to paste into
# docs/user-guide/memory.md with the date and GPU:
#   1. the environment (GPU, driver, torch, CUDA);
#   2. tests/fast-gpu pinned to one GPU (trunk on CUDA, colocation sleep/wake, prefetch, bf16 parity at dp 2 with
#      two ranks on one GPU and with CPU offload);
#   3. a colocated bf16 Flow-GRPO run on the shipped tiny model: ratio, clip fraction, log-prob difference, swap and
#      weight-sync seconds from its metrics.jsonl;
#   4. benchmarks/bench_gpu.py on SD3.5-Medium and FLUX.1-dev (random weights from their configs) with activation
#      checkpointing and bf16 master weights: step time, peak memory, MFU.
# Each step has its own time limit and a failed step does not stop the others; the table says what passed.
#   ./scripts/gpu_check.sh            # from the repository root; installs into .venv on first use
#   GPU_CHECK_OUT=/tmp/out ./scripts/gpu_check.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC1091
source "$root/scripts/setup.sh"
out="${GPU_CHECK_OUT:-$root/outputs/gpu_check}"
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
declare -A status

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "[gpu_check] $name (at most ${limit}s)" >&2
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  status[$name]="rc $rc, $((SECONDS - started)) s"
  tail -n 3 "$out/$name.log" >&2
}

step environment 60 python - <<'PY'
import subprocess, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                     capture_output=True, text=True).stdout)
PY

step fast_gpu 240 python -m pytest -q tests/fast-gpu -p no:cacheprovider

run_dir="$out/colocated_grpo"
rm -rf "$run_dir"
step colocated_grpo 180 python train_diffusion.py --loss-type policy_loss --device cuda --dp-size 1 --colocate \
  --diffusion-forward-dtype bf16 --diffusion-recompute-old-log-prob --num-rollout 3 --eval-interval 0 \
  --image-grid-interval 0 --no-progress --output-dir "$run_dir"

step bench_gpu 240 python benchmarks/bench_gpu.py --preset sd3.5-medium --preset flux-dev \
  --gradient-checkpointing --master-dtype bf16 --warmup 1 --steps 3

{
  echo "## gpu_check $(date -u +%Y-%m-%d) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  echo
  echo "| step | result |"
  echo "|---|---|"
  for name in environment fast_gpu colocated_grpo bench_gpu; do
    echo "| $name | ${status[$name]:-not run} |"
  done
  echo
  echo "fast-gpu: $(grep -E 'passed|failed|error' "$out/fast_gpu.log" | tail -n 1)"
  echo
  python - "$run_dir/metrics.jsonl" <<'PY'
import json, sys
keys = ["train/ratio_mean", "train/clipfrac", "train/log_prob_abs_diff", "perf/colocate_swap_s", "perf/weight_sync_s",
        "perf/rollout_s", "perf/train_s"]
try:
    records = [json.loads(line) for line in open(sys.argv[1])]
except OSError as exc:
    print(f"colocated run: no metrics ({exc})")
    sys.exit(0)
print("| colocated bf16 Flow-GRPO | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for rollout in sorted({r.get("rollout_id") for r in records if "rollout_id" in r}):
    merged = {}
    for r in records:
        if r.get("rollout_id") == rollout:
            merged.update(r)
    print(f"| rollout {rollout} | " + " | ".join(f"{merged[k]:.4g}" if k in merged else "-" for k in keys) + " |")
PY
  echo
  echo '```'
  sed -n '/^preset/,$p' "$out/bench_gpu.log" | grep -v '^running:' || echo "bench_gpu: no table (see $out/bench_gpu.log)"
  echo '```'
} | tee "$out/summary.md"
