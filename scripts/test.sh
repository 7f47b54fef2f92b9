#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test, printing each stage's seconds and the total:
#   deps        apt packages (skipped when all are present)
#   build       Release build: CPU and CUDA backends (the CUDA one is compiled whenever nvcc is found)
#   tests       ctest labels unit, model, cuda (CUDA tests skip themselves without a GPU), server (tansy serve end
#               to end with the official openai package, installed into a venv in the build tree), clients (six
#               client libraries at pinned versions against the server: tests/clients)
#   asan-build  clang ASan + UBSan build (no CUDA)
#   asan-tests  under the sanitizers: the unit and model tests but those listed in ASAN_SKIP (each still
#               runs in `tests`: they repeat one forward pass's code over long windows, 20-60x slower under ASan,
#               without reaching new code), the server load test, and the libFuzzer targets for a fixed time
# FAST=1 stops after `tests`.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
t_start=$(date +%s)
stage() {  # stage NAME COMMAND...: runs it and prints its duration
    local name=$1 t0
    shift
    t0=$(date +%s)
    echo "test.sh: stage $name ..."
    "$@"
    echo "test.sh: stage $name took $(($(date +%s) - t0)) s"
}

# Tests left out of the sanitizer pass (they run in the Release pass): whole-model numerics over long windows or
# many layouts, and the prefix cache's 1,500-token timing (its code paths run under ASan in the other prefix_cache
# tests), where ASan adds only time.
ASAN_SKIP='^(fixtures/prefill_chunks\.|quant_quality\.|kv_fp8\.tiny_model_teacher_window|layouts/golden_layout\.|consistency\.prefill_then_decode_equals_one_prefill|prefix_cache\.second_turn_of_a_long_conversation)'

stage deps scripts/install-deps.sh
stage build scripts/build.sh
stage tests ctest --test-dir build --output-on-failure -j"$jobs" -L 'unit|model|cuda|server|clients'
if [ "${FAST:-0}" = 1 ]; then
    echo "test.sh: FAST=1: sanitizer stages skipped; total $(($(date +%s) - t_start)) s"
    exit 0
fi
asan_build() {
    CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANSY_SANITIZE=ON \
        -DTANSY_FUZZ=ON -DTANSY_CUDA=OFF >/dev/null
    cmake --build build-asan
}
stage asan-build asan_build
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
stage asan-tests ctest --test-dir build-asan --output-on-failure -j"$jobs" -L 'unit|model|fuzz|server_asan' -E "$ASAN_SKIP"
echo "test.sh: all tests passed; total $(($(date +%s) - t_start)) s"
