#!/usr/bin/env bash
# Configures and builds tansy in build/ (Release; the CUDA backend too when nvcc is on PATH or in /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build
