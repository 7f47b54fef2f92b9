#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test:
#   1. Release build: ctest labels unit, model, cuda (CUDA tests skip themselves without a GPU), server (tansy
#      serve end to end with the official openai package, installed into a venv in the build tree)
#   2. ASan + UBSan build (clang): unit and model tests, the server load test, and the libFuzzer targets for a
#      fixed time (label fuzz)
# FAST=1 skips stage 2.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
scripts/install-deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$jobs" -L 'unit|model|cuda|server'
if [ "${FAST:-0}" = 1 ]; then exit 0; fi
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANSY_SANITIZE=ON \
  -DTANSY_FUZZ=ON -DTANSY_CUDA=OFF >/dev/null
cmake --build build-asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure -j"$jobs" -L 'unit|model|fuzz|server_asan'
echo "test.sh: all tests passed"
