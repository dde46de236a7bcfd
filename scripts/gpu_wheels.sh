#!/usr/bin/env bash
# Download the wheels the GPU check needs beyond what a device machine has, for Python 3.12 on
# x86_64 Linux, into wheels/ (ignored by git). The machine has torch, triton, numpy, safetensors,
# transformers and huggingface_hub but not diffusers; diffusers' other needs are there too, so
# only these travel. Carry wheels/ with the run; gpu_check.sh installs from it when it is there,
# so the Wan benchmark can compare against diffusers' group offloading.
#
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels
python3 -m pip download --dest wheels --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  "diffusers>=0.42,<0.43" "importlib_metadata" "lazy-importer"
du -sh wheels
