#!/usr/bin/env bash
# The project's GPU checks, in one run of under 8 minutes on one CUDA device (an H200 here).
# Installs the project offline into the machine's Python, checks correctness on CUDA, runs the CUDA
# benchmarks and writes under $OUT (default: ./gpu-results) two files: summary.txt (what ran, for
# how long, what failed) and checks.tgz (each check's JSON or text output and its log).
# Names given as arguments run only those checks.
#
#   OUT=/tmp/results bash benchmarks/gpu_check.sh
#   OUT=/tmp/results bash benchmarks/gpu_check.sh stream_protocol cuda_checks
#   OUT=/tmp/results bash benchmarks/gpu_check.sh wan_e2e      # only by name: each needs the
#   OUT=/tmp/results bash benchmarks/gpu_check.sh preset_step  # whole run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT/checks"
exec > >(tee "$OUT/summary.txt") 2>&1
only=" $* "
status=0
# The whole script stops within 470 s of its start: each check gets its own limit or what is left.
deadline=$((SECONDS + 470))

run() {  # run NAME TIMEOUT_S CMD...: keep going after a failure, remember it, save the output
  local name=$1 limit=$2
  shift 2
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 10 ]; then
    echo "== $name: skipped, the time is spent"
    status=1
    return
  fi
  echo "== $name (limit ${limit} s)"
  local started=$SECONDS
  if timeout "$limit" "$@" >"$OUT/checks/$name.out" 2>"$OUT/checks/$name.log"; then
    echo "   ok in $((SECONDS - started)) s"
  else
    echo "   FAILED (exit $?) after $((SECONDS - started)) s, see checks/$name.log"
    tail -n 20 "$OUT/checks/$name.log"
    status=1
  fi
}

python3 -m pip install --no-index --no-deps --no-build-isolation -e . >"$OUT/checks/install.log" 2>&1 || {
  echo "install failed"; tail -n 20 "$OUT/checks/install.log"; exit 1; }
# diffusers, for the Wan comparison, when its wheels were carried along (scripts/gpu_wheels.sh).
if [ -d wheels ]; then
  python3 -m pip install --no-index --find-links wheels diffusers >>"$OUT/checks/install.log" 2>&1 ||
    echo "diffusers wheels did not install; the Wan comparison is skipped"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/checks/gpu.csv" 2>&1

# Correctness first. The streaming protocol with real streams (every scenario the simulated device
# checks in CI, streamed against resident), then 3D-DSA kernels (bf16, fp16) against the
# reference, then streaming and training.
run stream_protocol 120 python3 benchmarks/stream_protocol.py --json
run dsa_cuda_check 150 python3 benchmarks/dsa_cuda_check.py
run cuda_checks 120 python3 benchmarks/cuda_checks.py --preset small --json
# Benchmarks.
run streaming_small 60 python3 benchmarks/streaming.py --device cuda --preset small --frames 16 --size 256x256 --json
# Weight formats: the lossless decode kernel's GB/s (checked bitwise) and the streamed step time
# per format (raw, lossless, fp8) of the small preset.
run weight_formats 90 python3 benchmarks/weight_formats_device.py --device cuda --json
run attention 180 python3 benchmarks/attention.py --json --quick
# 8-bit attention: the kernel against its reference (bf16, fp16), then its time against bf16 SDPA
# at Wan2.1-14B's 480p self-attention.
run sage_cuda_check 120 python3 benchmarks/sage_cuda_check.py --json
if python3 -c "import diffusers" 2>/dev/null; then
  run wan_streaming 90 python3 benchmarks/wan_streaming.py --json
fi
# End to end at Wan2.1-T2V-14B's size (480x832x81; benchmarks/wan_e2e.py): MegaSlide resident and
# streamed, each lever on and off, against diffusers resident and group-offloaded. Opt-in by name
# (`bash benchmarks/gpu_check.sh wan_e2e`): writing the 40 GB random model and opening it per
# contender takes the whole run, after the checks above it would get no time. It skips the
# contenders that would not fit in what is left and rewrites its JSON after each one, so what it
# measured comes back even when the limit stops it.
if [[ "$only" == *" wan_e2e "* ]] && python3 -c "import diffusers" 2>/dev/null; then
  run wan_e2e 460 python3 benchmarks/wan_e2e.py --json --budget-s $((deadline - SECONDS - 30)) \
    --out "$OUT/checks/wan_e2e.json"
elif [[ "$only" == *" wan_e2e "* ]]; then
  echo "== wan_e2e: skipped, diffusers is not installed (carry its wheels: scripts/gpu_wheels.sh)"
  status=1
fi
# The 105B preset streamed in fp8 with 3D-DSA: one 480p step against the planner's prediction
# (benchmarks/preset_step.py). Opt-in by name too: drawing and encoding 105B random parameters
# takes minutes of the run.
if [[ "$only" == *" preset_step "* ]]; then
  run preset_step 460 python3 benchmarks/preset_step.py --json --out "$OUT/checks/preset_step.json"
fi
# One video split over two GPUs (sequence parallel, NCCL), where the machine has two: the frames
# against one GPU's, and the wall time with the ranks' start-up.
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  run sequence_parallel 180 python3 benchmarks/sequence_parallel.py --devices cuda:0,cuda:1 --frames 16 --size 64 --json
fi
# Two files, whatever the number of checks: a device run brings back only a few.
tar -czf "$OUT/checks.tgz" -C "$OUT" checks && rm -rf "$OUT/checks"
echo "results in $OUT/checks.tgz"
exit $status
