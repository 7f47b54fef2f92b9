// Decode throughput measurement: batches of B sequences at a given context, each step one graph replay where
// the backend has graphs, timed as the median over runs after warm-up, with the bytes a step must move
// (weights actually touched + KV cache + DeltaNet state) to express it against the memory roofline.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace tansy {

struct bench_point {
    int64_t batch = 1, context = 0;
    double step_s = 0;          // median seconds per decode step (all sequences)
    double tok_s = 0;           // batch / step_s
    double bytes_per_step = 0;  // modelled minimum traffic of one step
    double gbps = 0;            // bytes_per_step / step_s / 1e9
    double roofline_pct = 0;    // gbps vs the peak given
    double peak_gib = 0;        // device memory in use after the run
    bool graphs = false;
};

struct bench_options {
    std::vector<int64_t> contexts = {256, 2048, 8192, 32768, 131072};
    std::vector<int64_t> batches = {1};  // measured at every context
    std::vector<int64_t> batch_sweep = {4, 16, 64};  // measured at batch_context
    int64_t batch_context = 2048;
    int steps = 32, runs = 5, warmup = 3;
    double peak_gbps = 4280;  // H200 device-to-device copy, measured (shared/docs/DECODE_FLOOR.md)
};

// Minimum bytes one decode step moves for `batch` sequences at `context` tokens.
double decode_bytes_per_step(const model& m, int64_t batch, int64_t context);

bench_point bench_decode(engine& eng, int64_t batch, int64_t context, const bench_options& o);

}  // namespace tansy
