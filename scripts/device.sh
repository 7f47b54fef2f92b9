#!/usr/bin/env bash
# Build + test + bench on the GPU machine in one go (the device tool runs it in a copy of this tree, with
# .carry from scripts/prepare-device-carry.sh). Results land in $OUT (or ./device-out).
#   scripts/device.sh [test|bench|serve-bench|all|gtest|profile|detail|source|gdn-check|ab|ab-multi|tokenizer] [extra bench args...]
#   gtest: FILTER='cuda_gemm*' [MEMCHECK=1] scripts/device.sh gtest
#   ab:    AB_PATCH=.carry/change.patch AB_REVERSE=1 scripts/device.sh ab --contexts 2048 --batches none --prompts none
#          AB_ENV='TANSY_KERNELS=int8=off' scripts/device.sh ab   (B: the same binary under that environment;
#          TANSY_KERNELS takes the --kernels syntax, src/backend/cuda/kernel_plan.h)
#          AB_TEST_FILTER='cuda_ops.*:cuda_attention*' also runs those CUDA tests on the patched tree (B)
#   ab-multi: AB_LIST='post-wait-loads post-wait-loads+gdn-norm-in-out-proj' [AB_TEST_FILTER=...] scripts/device.sh ab-multi [bench args]
#          an item names a patch $AB_DIR/NAME.patch (default .carry/experiments; old ones come back with
#          git show, docs/PERF.md "Method") ('+' applies them in order, -NAME one reversed); each variant is
#          an incremental rebuild of this tree with its patches applied in place (then reverted), and the benches
#          alternate over all variants (A B1 B2 ..) ${AB_ROUNDS:-2} times; NAMES@VAR=value,VAR2=value runs that
#          build under that environment (built once per set of patches; '@VAR=value' alone: this tree's binary;
#          several kernel switches: '@TANSY_KERNELS=int8=off;mma=all')
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-device-out}; mkdir -p "$OUT"
deps=$PWD/.carry/deps
export LD_LIBRARY_PATH=$deps/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
# Files an earlier ab-multi patched and reverted in place: this call's fresh copy of the tree gives them their old
# mtimes again, older than the objects of the last variant built, so ninja would keep those objects: touch them.
if [ -f build-dev/.ab-touched ]; then
  sort -u build-dev/.ab-touched | while read -r f; do [ -f "$f" ] && touch "$f"; done
  rm -f build-dev/.ab-touched
fi
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANSY_DEPS_DIR="$deps" \
  -DTANSY_GTEST_SOURCE="$deps/googletest-src" -DTANSY_CUDA_ARCHS=90 > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
target=all; [ "$what" = gtest ] && target=tansy_cuda_tests
[ "$what" = ab-multi ] && target="tansy${AB_TEST_FILTER:+ tansy_cuda_tests}"
cmake --build build-dev -j 16 --target $target > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
rc=0
if [ "$what" = test ] || [ "$what" = all ]; then
  ctest --test-dir build-dev -L cuda --output-on-failure --timeout 150 -j 1 > "$OUT/ctest-cuda.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|\*\*\*Failed" "$OUT/ctest-cuda.log" | head -20
  build-dev/tests/tansy_cuda_tests --gtest_filter='cuda_model.*' 2>&1 | grep -E "^\[ (tiny|real|paths)" | tee "$OUT/cuda-model.txt"
  if command -v compute-sanitizer >/dev/null; then
    timeout 200 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \
      build-dev/tests/tansy_cuda_tests --gtest_filter='*cuda_gemv*:cuda_ops.tiny_shapes:cuda_ops.real_shapes:cuda_ops.router_tap*:cuda_ops.embed*:cuda_model.graphs*:cuda_rms*:cuda_gemm_swiglu*:cuda_gemm_grouped*:cuda_gemm_scale*:cuda_gemm_split*:*cuda_gemm.dense_store_matches_cpu_twin/1?:cuda_gemm_ops.tiny*:cuda_attention_prefill.tiny*:cuda_attention_prefill.fp8_cache_tiny*:cuda_gdn_prefill.tiny*:cuda_sample*:cuda_logprobs.records*' \
      > "$OUT/memcheck.log" 2>&1 && echo "memcheck: clean" || { echo "memcheck: FAILED"; tail -30 "$OUT/memcheck.log"; rc=1; }
  fi
fi
if [ "$what" = test ] || [ "$what" = all ]; then
  # tansy serve on the tiny model with --backend cuda: streamed = non-streamed = tansy run (greedy)
  timeout 300 scripts/device-serve-check.sh cuda > "$OUT/serve-check.log" 2>&1 && echo "serve check: PASS" \
    || { echo "serve check: FAIL"; tail -25 "$OUT/serve-check.log"; rc=1; }
fi
if [ "$what" = serve-bench ] || [ "$what" = all ]; then
  # tansy bench --serve: served speed (streaming HTTP clients) beside the engine's own decode rate, one process
  timeout ${SERVE_BENCH_TIMEOUT:-560} build-dev/bin/tansy bench --serve --backend cuda \
    --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json ${SERVE_BENCH_ARGS:-} --json > "$OUT/serve-bench.json" \
    2> "$OUT/serve-bench.log" || { echo "serve-bench: FAILED"; rc=1; }
  grep -vE "^\s*$" "$OUT/serve-bench.log" | tail -16
fi
if [ "$what" = gtest ]; then
  # only the CUDA test binary, the tests matching $FILTER (gtest syntax), optionally under compute-sanitizer ($MEMCHECK=1)
  pre=""; [ "${MEMCHECK:-0}" = 1 ] && pre="compute-sanitizer --tool memcheck --error-exitcode 3"
  timeout ${GTEST_TIMEOUT:-400} $pre build-dev/tests/tansy_cuda_tests --gtest_filter="${FILTER:-*}" > "$OUT/gtest.log" 2>&1 || rc=1
  grep -E "^\[  (FAILED|PASSED) |^\[ +OK|^\[ (tiny|real|paths)|Failure|rel_error|error|Expected|Which is|actual|ERROR SUMMARY" "$OUT/gtest.log" | head -${GTEST_LINES:-80}
  # the counts always, whatever the head above left out
  grep -E "^\[==========\] [0-9]+ tests? from .* ran|^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ tests?" "$OUT/gtest.log" | tail -4
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-560} build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json "$@" \
    --json > "$OUT/bench.json" 2> "$OUT/bench.log" || { tail -20 "$OUT/bench.log"; rc=1; }
  cat "$OUT/bench.log"
fi
if [ "$what" = profile ]; then
  # per-kernel time of decode steps (batch 1, context 2048) with Nsight Compute; summary by kernel name
  ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
    -k regex:'^(?!.*synth)' build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json \
    --contexts ${PROFILE_CONTEXT:-2048} --batches ${PROFILE_BATCHES:-none} --prompts none --steps 1 --runs 1 --warmup 0 "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.log" || tail -5 "$OUT/ncu.log"
  python3 scripts/ncu_summary.py "$OUT/ncu.csv" ${NCU_SUMMARY_ARGS:-} | tee "$OUT/ncu-summary.txt"
fi
if [ "$what" = profile-prefill ]; then
  # per-kernel time of one prefill of ${PROFILE_PROMPT:-2048} tokens (all its chunks; the warm-up run is left out)
  ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:'^(?!.*synth)' \
    build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json \
    --contexts none --batches none --prompts ${PROFILE_PROMPT:-2048} --runs 1 "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.log" || tail -5 "$OUT/ncu.log"
  python3 scripts/ncu_summary.py "$OUT/ncu.csv" --prefill | tee "$OUT/ncu-summary.txt"
fi
if [ "$what" = detail ]; then
  # Nsight Compute sections for one launch of each decode kernel named in $KERNELS (regex), plus their SASS
  for k in ${KERNELS:-gemv_stream_kernel}; do
    ncu --clock-control none --graph-profiling node -k regex:"$k" --launch-skip ${SKIP:-120} --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json \
      --contexts 2048 --batches none --prompts none --steps 4 --runs 1 --warmup 0 2>/dev/null | grep -vE "^==PROF==|^  *$" | cut -c1-120 > "$OUT/detail-$k.txt"
    tail -60 "$OUT/detail-$k.txt"
  done
  cuobjdump -sass build-dev/libtansy_cuda.a 2>/dev/null | awk -v pat="Function : .*${SASS_FN:-gemv_stream_kernelILNS0_4dfmtE0ELi2E}" '$0 ~ pat {f=1;n=0} f{print; n++} n>4000{f=0}' \
    > "$OUT/sass.txt"
fi
if [ "$what" = source ]; then
  # per-SASS-line stall samples and execution counts of one launch of the decode kernel $KERNEL (regex)
  # (with $PROFILE_PROMPT: a launch of the prefill of a prompt of that many tokens instead)
  work="--contexts ${PROFILE_CONTEXT:-2048} --batches ${PROFILE_BATCHES:-none} --prompts none --steps 4"
  [ -n "${PROFILE_PROMPT:-}" ] && work="--contexts none --batches none --prompts $PROFILE_PROMPT"
  ncu --clock-control none --graph-profiling node -k regex:"${KERNEL:-gemv_stream_kernel}" --launch-skip ${SKIP:-120} \
    --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no -f -o /tmp/src \
    build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json \
    $work --runs 1 --warmup 0 "$@" > /dev/null 2>&1
  ncu -i /tmp/src.ncu-rep --page details 2>&1 | grep -E "Duration|Throughput|Warp Cycles|Issued Ipc|Stall|Pipe|Active" | head -30
  ncu -i /tmp/src.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1
  gzip -c /tmp/src.csv > "$OUT/source-$(echo "${KERNEL:-gemv_stream_kernel}" | tr -c 'a-zA-Z0-9_\n' _).csv.gz"
  python3 scripts/ncu_source.py /tmp/src.csv ${TOP:-40} || head -c 3000 /tmp/src.csv
fi
if [ "$what" = gdn-check ]; then
  # the chunked DeltaNet prefill in one call: its tests under memcheck, racecheck and initcheck, then prefill
  # A/B against the token scan (2K, 8K, 128K: tok/s and peak memory)
  f='cuda_gdn_prefill*'
  for tool in memcheck racecheck initcheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 build-dev/tests/tansy_cuda_tests --gtest_filter="$f" \
      > "$OUT/$tool.log" 2>&1 && echo "$tool: clean" || { echo "$tool: FAILED"; grep -E "FAILED|Failure|ERROR|Expected|Which is" "$OUT/$tool.log" | head -20; rc=1; }
  done
  for form in chunked recurrent; do
    echo "== --deltanet $form"
    timeout 200 build-dev/bin/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json \
      --contexts none --batches none --prompts ${GDN_PROMPTS:-2048,8192,131072} --deltanet $form 2>&1 | tail -7
  done
fi
if [ "$what" = ab ]; then
  # A/B in one session: this tree against a copy with $AB_PATCH applied (git diff output; AB_REVERSE=1 applies
  # it reversed, e.g. the diff of the change under test), the bench alternating between the two ${AB_ROUNDS:-2}
  # times. Extra args go to both benches (default: --contexts 2048,131072 --batches none --prompts none).
  # Or AB_ENV='VAR=value ...': B is this tree's binary under that environment (a run-time switch).
  if [ -n "${AB_ENV:-}" ]; then
    bin_b=build-dev/bin/tansy; label_b="env $AB_ENV"
  else
    # AB_PATCH: a patch file, or NAME for $AB_DIR/NAME.patch (as ab-multi's items)
    ab_dir=${AB_DIR:-.carry/experiments}
    [ ! -f "${AB_PATCH:-}" ] && [ -f "$ab_dir/${AB_PATCH:-}.patch" ] && AB_PATCH=$ab_dir/$AB_PATCH.patch
    [ -f "${AB_PATCH:-}" ] || { echo "ab: set AB_PATCH to a patch file or a name in $ab_dir (or AB_ENV)"; exit 1; }
    rm -rf /tmp/ab && mkdir -p /tmp/ab && tar --exclude='./build*' --exclude=./.carry --exclude=./.git --exclude="./$OUT" -cf - . | tar -xf - -C /tmp/ab
    pf=$AB_PATCH; case $pf in /*) ;; *) pf=$PWD/$pf ;; esac
    (cd /tmp/ab && patch -p1 -s ${AB_REVERSE:+-R} < "$pf") || { echo "ab: the patch does not apply"; exit 1; }
    cmake -S /tmp/ab -B /tmp/ab/build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANSY_DEPS_DIR="$deps" -DTANSY_GTEST_SOURCE="$deps/googletest-src" \
      -DTANSY_CUDA_ARCHS=90 > "$OUT/configure-b.log" 2>&1 && cmake --build /tmp/ab/build-dev -j 16 --target tansy > "$OUT/build-b.log" 2>&1 \
      || { grep -E "error" -A5 "$OUT/build-b.log" | head -40; exit 1; }
    bin_b=/tmp/ab/build-dev/bin/tansy; label_b="patched"
  fi
  args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--contexts 2048,131072 --batches none --prompts none)
  for i in $(seq ${AB_ROUNDS:-2}); do
    for side in A B; do
      bin=build-dev/bin/tansy; [ $side = B ] && bin="env ${AB_ENV:-} $bin_b"
      label="this tree"; [ $side = B ] && label="$label_b"
      echo "== $side ($label) round $i"
      timeout 200 $bin bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json --steps 16 --runs 5 "${args[@]}" 2>&1 \
        | grep -E "^ *batch +[0-9]+ context|prompt +[0-9]+:"
    done
  done
fi
if [ "$what" = ab ] && [ -n "${AB_TEST_FILTER:-}" ] && [ -z "${AB_ENV:-}" ]; then
  cmake --build /tmp/ab/build-dev -j 16 --target tansy_cuda_tests > "$OUT/build-b-tests.log" 2>&1 \
    || { grep -E "error" -A5 "$OUT/build-b-tests.log" | head -40; exit 1; }
  timeout ${GTEST_TIMEOUT:-300} /tmp/ab/build-dev/tests/tansy_cuda_tests --gtest_filter="$AB_TEST_FILTER" > "$OUT/gtest-b.log" 2>&1 || rc=1
  grep -E "^\[  (FAILED|PASSED) |^\[  SKIPPED \] [0-9]|Failure|Expected|Which is" "$OUT/gtest-b.log" | head -30
fi
if [ "$what" = ab-multi ]; then
  ab_dir=${AB_DIR:-.carry/experiments}
  rm -rf /tmp/abm && mkdir -p /tmp/abm/A && cp build-dev/bin/tansy /tmp/abm/A/ && : > /tmp/abm/A/env
  variants=(A); declare -A built=(["p:"]=A)
  for item in ${AB_LIST:?set AB_LIST}; do
    # PATCHES@VAR=value,VAR2=value: those patches' binary under that environment (no patches: this tree's)
    pp=${item%%@*}; envs=; [ "$pp" != "$item" ] && envs=$(echo "${item#*@}" | tr ',' ' ')
    v=$(echo "$item" | tr -c 'a-zA-Z0-9_\n-' '_'); names=$(echo "$pp" | tr '+' ' '); applied=()
    echo "######## $item"
    if [ -n "${built["p:$pp"]:-}" ]; then  # the same patches as an earlier variant: its binary
      mkdir -p /tmp/abm/$v && cp /tmp/abm/${built["p:$pp"]}/tansy /tmp/abm/$v/ && echo "$envs" > /tmp/abm/$v/env && variants+=("$v")
      continue
    fi
    for name in $names; do  # -NAME: the patch reversed (B = this tree without a change it holds)
      rev=; [ "${name#-}" != "$name" ] && rev=-R
      grep '^+++ b/' "$ab_dir/${name#-}.patch" | cut -c7- >> build-dev/.ab-touched
      patch -p1 -s $rev --no-backup-if-mismatch < "$ab_dir/${name#-}.patch" || { echo "ab-multi: $name does not apply"; break; }
      applied=("$name" "${applied[@]}")
    done
    if [ ${#applied[@]} -eq $(echo $names | wc -w) ]; then
      t1=$(date +%s)
      if cmake --build build-dev -j 16 --target $target > "$OUT/build-$v.log" 2>&1; then
        mkdir -p /tmp/abm/$v && cp build-dev/bin/tansy /tmp/abm/$v/ && echo "$envs" > /tmp/abm/$v/env && variants+=("$v")
        built["p:$pp"]=$v
        echo "build: $(( $(date +%s) - t1 )) s"
        if [ -n "${AB_TEST_FILTER:-}" ]; then
          timeout ${GTEST_TIMEOUT:-300} build-dev/tests/tansy_cuda_tests --gtest_filter="$AB_TEST_FILTER" > "$OUT/gtest-$v.log" 2>&1 || rc=1
          grep -E "^\[  (FAILED|PASSED) |^\[  SKIPPED \] [0-9]|Failure|Expected|Which is" "$OUT/gtest-$v.log" | head -20
        fi
      else
        grep -E "error" -A5 "$OUT/build-$v.log" | head -30; rc=1
      fi
    fi
    for name in "${applied[@]}"; do
      rev=-R; [ "${name#-}" != "$name" ] && rev=
      patch -p1 $rev -s --no-backup-if-mismatch < "$ab_dir/${name#-}.patch"
    done
  done
  args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--contexts 2048,131072 --batches none --prompts none)
  for i in $(seq ${AB_ROUNDS:-2}); do
    for v in "${variants[@]}"; do
      echo "== $v round $i"
      timeout 200 env $(cat /tmp/abm/$v/env) /tmp/abm/$v/tansy bench --backend cuda --synthetic tests/fixtures/qwen3.6-35b-a3b/config.json --steps 16 --runs 5 "${args[@]}" 2>&1 \
        | grep -E "^ *batch +[0-9]+ context|prompt +[0-9]+:"
    done
  done
  echo "ab-multi: $(( $(date +%s) - t0 )) s in all"
fi
if [ "$what" = tokenizer ] || [ "$what" = all ]; then
  # encode speed on this machine's CPU, ours vs Hugging Face tokenizers (installed here), same text and ids
  if [ -f .carry/tok_bench.txt.xz ]; then
    xz -dc .carry/tok_bench.txt.xz > /tmp/tok_bench.txt
    tj=build-dev/fixtures/tokenizers/qwen3/tokenizer.json
    build-dev/bin/bench_tokenizer --tokenizer $tj --text-file /tmp/tok_bench.txt --runs 5 --ids-out /tmp/ids_tansy.txt 2>&1 | tail -3
    python3 scripts/bench_tokenizer_hf.py --tokenizer $tj --text-file /tmp/tok_bench.txt --runs 3 --ids-out /tmp/ids_hf.txt 2>&1 | tail -3
    cmp -s /tmp/ids_tansy.txt /tmp/ids_hf.txt && echo "tokenizer: ids identical to HF" || echo "tokenizer: ids DIFFER from HF"
  fi
fi
exit $rc
