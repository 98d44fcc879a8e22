#!/usr/bin/env bash
# The first checks on a GPU machine, ending with one summary table (paste it into docs/user-guide/performance.md with
# the date and GPU). Every step runs under its own time limit, a failed step does not stop the others, and the table
# says what passed.
#
#   bash scripts/gpu_check.sh --no-setup [--wheels DIR]   # a bare GPU machine: the current python, no network, no Ray
#   bash scripts/gpu_check.sh                             # installs into .venv first (scripts/setup.sh), adds Ray steps
#   GPU_CHECK_OUT=/tmp/out bash scripts/gpu_check.sh --no-setup
#
# --no-setup uses the python on PATH as it is (torch with CUDA already installed), installs nothing and needs neither
# the network nor Ray. Its steps (limits add up to 8 min 51 s; one H100; the limits were set without a GPU: no GPU was
# lent to the sessions that set them, 2026-12-06 and -07, so they are estimates from the steps' work, not measured
# times; the first six steps take 1-8 s each on the 2-core CPU machine with --device cpu):
#   environment 10 s        GPU, driver, torch, CUDA, which packages are missing
#   trainer_step 35 s       FSDP2 trainer rank, world size 1 over NCCL, two optimizer windows (scripts/gpu_check_core.py)
#   engine_generate 30 s    a rollout engine samples 4 prompts with CFG in micro-batches of 2, against one batch
#   weight_sync 35 s        trainer rank -> an engine in a second process on the same GPU over cuda_ipc: two syncs
#                           into the engine's parameters in place, checksummed, equal to the trainer's export
#   pinned_sizes 25 s       --colocate-sleep's host buffer after sleeping 1.1 GiB: exact size, page-locked, not cached
#   precision_parity 35 s   engine (bf16) vs the trainer's FSDP2 recompute of the recorded log-probs, bf16 bound 1e-2
#   bench_sd35_medium 90 s  benchmarks/bench_gpu.py, SD3.5-Medium 1024 px, full fine-tuning, bf16 master weights
#   bench_flux_dev 120 s    benchmarks/bench_gpu.py, FLUX.1-dev 1024 px, LoRA rank 16 (full fine-tuning of 12B with
#                           AdamW needs ~96 GB even with bf16 master weights: more than one H100)
#   plan_sd35_medium 65 s   the planner's engine and trainer phases vs torch.cuda.max_memory_allocated of the same
#                           library steps run for real (random weights), SD3.5-Medium as bench_sd35_medium trains it,
#                           each phase within 10% (scripts/gpu_check_plan.py)
#   plan_flux_dev 86 s      the same for FLUX.1-dev, LoRA rank 16 on a bf16 base as bench_flux_dev (the library's
#                           trainer and engine, not bench's bare FSDP2 step: a run of its own)
#                           (their plan side, on fake tensors, took 41 s of CPU time for FLUX.1-dev and about 30 s
#                           for SD3.5-Medium on the 2-core CPU machine, imports included; the real side is unmeasured)
# Without CUDA every step is skipped with the reason and the script exits 0.
#
# Packages the Ray-free core needs besides torch (and torch's own dependencies). Where the machine lacks them and has
# no network, fetch the wheels elsewhere into one folder (set PYVER to the GPU machine's python, e.g. 311 for 3.11;
# see the size below) and pass it with --wheels DIR: each wheel whose distribution is not installed is
# unpacked into $GPU_CHECK_OUT/site and put on PYTHONPATH for the steps (nothing is installed):
#   PYVER=311; pip download --no-deps --only-binary=:all: --python-version $PYVER --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
#     diffusers==0.42.1 transformers==5.25.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0 \
#     accelerate==1.16.0 peft==0.21.2 kernels==0.19.1 tomlkit==0.15.3 regex==2026.12.2 pyyaml==6.0.4 \
#     pillow==13.0.0 numpy==2.4.6 tqdm==4.70.1 packaging==26.4 psutil==7.2.2 requests==2.34.2 urllib3==2.8.0 \
#     idna==3.21 certifi==2026.10.19.post1 charset-normalizer==3.5.3 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 \
#     anyio==4.16.0 truststore==0.10.5 hf-xet==1.8.0 click==8.5.1 importlib_metadata==10.2.0 zipp==4.1.2
# (58 MB; numpy, pillow and pyyaml are often installed beside torch: leave out what is, to save 24 MB.) Tested here
# with python -S and only torch and its dependencies on the path: every step's code imports and runs on CPU.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
no_setup=0
wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-setup) no_setup=1 ;;
    --wheels) wheels="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--no-setup, --wheels DIR, --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$no_setup" = 0 ]; then
  # shellcheck disable=SC1091
  source "$root/scripts/setup.sh"
  set +e  # setup.sh's `set -e` must not end the checks at the first failed step
fi
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${GPU_CHECK_OUT:-$root/outputs/gpu_check}"
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
if [ -n "$wheels" ]; then
  python "$root/scripts/gpu_check_wheels.py" "$wheels" "$out/site"
  export PYTHONPATH="$out/site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
cuda_reason="$(python -c 'import torch; print("" if torch.cuda.is_available() else f"no CUDA device visible to this python (torch {torch.__version__}, CUDA build {torch.version.cuda})")' 2>&1 | tail -n 1)" \
  || cuda_reason="$(command -v python || echo no python) cannot import torch: $cuda_reason"
core="python scripts/gpu_check_core.py"
bench="python benchmarks/bench_gpu.py --gradient-checkpointing --warmup 1 --steps 3"
plan="python scripts/gpu_check_plan.py --workdir $out"
names=(environment trainer_step engine_generate weight_sync pinned_sizes precision_parity bench_sd35_medium
  bench_flux_dev plan_sd35_medium plan_flux_dev)
declare -A limit=([environment]=10 [trainer_step]=35 [engine_generate]=30 [weight_sync]=35 [pinned_sizes]=25
  [precision_parity]=35 [bench_sd35_medium]=90 [bench_flux_dev]=120 [plan_sd35_medium]=65 [plan_flux_dev]=86)
declare -A command=(
  [environment]="python scripts/gpu_check_wheels.py --report"
  [trainer_step]="$core trainer_step --workdir $out"
  [engine_generate]="$core engine_generate --workdir $out"
  [weight_sync]="$core weight_sync --workdir $out"
  [pinned_sizes]="$core pinned_sizes"
  [precision_parity]="$core precision_parity --workdir $out"
  [bench_sd35_medium]="$bench --preset sd3.5-medium --master-dtype bf16"
  [bench_flux_dev]="$bench --preset flux-dev --lora-rank 16"
  [plan_sd35_medium]="$plan --model sd3.5-medium"
  [plan_flux_dev]="$plan --model flux-dev"
)
if [ "$no_setup" = 0 ]; then  # with the venv (Ray installed): the GPU test tier and a whole colocated run too
  names+=(fast_gpu colocated_grpo)
  limit+=([fast_gpu]=240 [colocated_grpo]=180)
  command+=([fast_gpu]="python -m pytest -q tests/fast-gpu -p no:cacheprovider"
    [colocated_grpo]="python train_diffusion.py --loss-type policy_loss --device cuda --dp-size 1 --colocate \
--diffusion-forward-dtype bf16 --diffusion-recompute-old-log-prob --num-rollout 3 --eval-interval 0 \
--image-grid-interval 0 --no-progress --output-dir $out/colocated_grpo")
fi
declare -A status result
total=0
failed=0
echo "[gpu_check] plan (python $(command -v python), output in $out):" >&2
for name in "${names[@]}"; do
  total=$((total + limit[$name]))
  echo "[gpu_check]   $name (at most ${limit[$name]}s): ${command[$name]}" >&2
done
echo "[gpu_check]   limits add up to ${total}s" >&2

for name in "${names[@]}"; do
  if [ -n "$cuda_reason" ]; then
    status[$name]="skipped"
    result[$name]="$cuda_reason"
    echo "[gpu_check] $name skipped: $cuda_reason" >&2
    continue
  fi
  echo "[gpu_check] $name (at most ${limit[$name]}s)" >&2
  started=$SECONDS
  # shellcheck disable=SC2086
  timeout "${limit[$name]}" ${command[$name]} >"$out/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  status[$name]="$([ $rc = 0 ] && echo passed || { [ $rc = 124 ] && echo "timed out" || echo "failed (rc $rc)"; }), $((SECONDS - started)) s"
  # the step's RESULT line, else its last line (a bench row, an error, pytest's count)
  result[$name]="$({ grep '^RESULT: ' "$out/$name.log" || tail -n 1 "$out/$name.log"; } | tail -n 1 | cut -c1-200)"
  tail -n 3 "$out/$name.log" >&2
done

{
  gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
  echo "## gpu_check $(date -u +%Y-%m-%d) on ${gpu:-no GPU}"
  echo
  echo "| step | limit s | status | result |"
  echo "|---|---|---|---|"
  for name in "${names[@]}"; do
    echo "| $name | ${limit[$name]} | ${status[$name]} | ${result[$name]:-see $out/$name.log} |"
  done
  for name in bench_sd35_medium bench_flux_dev plan_sd35_medium plan_flux_dev; do
    if [ -f "$out/$name.log" ]; then
      echo
      echo '```'
      sed -n '/^images/,$p;/^process/,/^RESULT/p' "$out/$name.log"
      echo '```'
    fi
  done
} | tee "$out/summary.md"
exit "$failed"  # 0 when every step passed or was skipped (no CUDA)
