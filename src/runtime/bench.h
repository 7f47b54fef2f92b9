// Decode throughput measurement: batches of B sequences at a given context, each step one graph replay where
// the backend has graphs, timed as the median over runs after warm-up, with the bytes a step must move
// (weights actually touched + KV cache + DeltaNet state) to express it against the memory roofline.
// Prefill measurement: one prompt of n tokens processed in chunks (forward_pass::prefill) up to its first token,
// with the FLOPs that takes (prefill_flops) to express it against the tensor-core peak.
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

// NVIDIA H200 datasheet: 1,979 TFLOP/s BF16/FP16 tensor core "with sparsity"; dense is half of that.
constexpr double H200_BF16_DENSE_TFLOPS = 989;

struct prefill_point {
    int64_t prompt = 0, chunk = 0;  // prompt tokens; tokens per forward step
    int runs = 0;                   // timed runs (after one warm-up run)
    double ttft_s = 0;      // median time to first token: prefill in chunks + last token's lm_head + argmax, synced
    double tok_s = 0;       // prompt / ttft_s
    double flops = 0;       // prefill_flops(prompt)
    double tflops = 0;      // flops / ttft_s / 1e12
    double peak_pct = 0;    // tflops vs the peak given
    double peak_gib = 0;    // the most device memory in use seen during the runs (state of prompt + 1 tokens)
};

struct bench_options {
    std::vector<int64_t> contexts = {256, 2048, 8192, 32768, 131072};
    std::vector<int64_t> batches = {1};  // measured at every context
    std::vector<int64_t> batch_sweep = {4, 16, 64};  // measured at batch_context
    int64_t batch_context = 2048;
    int steps = 32, runs = 5, warmup = 3;
    double peak_gbps = 4280;  // H200 device-to-device copy, measured (shared/docs/DECODE_FLOOR.md)
    std::vector<int64_t> prompts = {256, 512, 2048, 8192, 32768, 131072};  // prefill rows
    // Timed prefill runs of a prompt of n tokens: max(1, min(runs, prefill_run_tokens / n)), so that long prompts
    // (seconds each) run fewer times: 5 up to 8K, 2 at 32K, 1 at 128K by default.
    int64_t prefill_run_tokens = 65536;
    double peak_tflops = H200_BF16_DENSE_TFLOPS;
    bool kv_fp8 = false;  // the engine's KV cache is FP8 (bytes per step)
    bool state_bf16 = false;  // the engine's DeltaNet state is bf16 (bytes per step)
    sampling_params sampling;  // every decode row's (default greedy); sampled rows draw on the device where it can
};

// FLOPs of prefilling n_prompt tokens after n_past cached ones, up to the first token's logits:
//   matmul    2 x (active matrix weights per token: every layer's input projections and output projection,
//             router, shared-expert gate, shared expert, top_k routed experts) x n_prompt
//   lm_head   2 x V x D, once (only the last token's logits are computed)
//   attention 2 x 2 x Hq x dh per causal (query, key) pair (q.k and p.v) per full-attention layer; the query at
//             position p attends to p + 1 keys, so n_prompt x n_past + n_prompt (n_prompt + 1) / 2 pairs
//   deltanet  per DeltaNet layer and token: 7 x dk x dv per value head for the recurrence as MODEL.md §4.6
//             writes it (decay S 1, prediction S^T k 2, rank-1 update k delta^T 2, readout S^T q 2; the chunked
//             form does the same plus O(64) intra-chunk terms, not counted) + 2 x K x C for the causal conv
// Norms, softmax, RoPE, gates and routing top-k are not counted (each is O(D) per token).
struct prefill_flop_count {
    double matmul = 0, lm_head = 0, attention = 0, deltanet = 0;
    double total() const { return matmul + lm_head + attention + deltanet; }
};
prefill_flop_count prefill_flop_parts(const model& m, int64_t n_prompt, int64_t n_past = 0);
double prefill_flops(const model& m, int64_t n_prompt, int64_t n_past = 0);

// Timed runs for a prompt of n_prompt tokens (see bench_options::prefill_run_tokens).
int prefill_runs(int64_t n_prompt, const bench_options& o);
// Time to first token of an n_prompt-token prompt in chunks of the engine's prefill_chunk: one state of capacity
// n_prompt + 1 (what a real prompt of that length needs, freed afterwards), one warm-up run, then the median of
// prefill_runs() runs.
prefill_point bench_prefill(engine& eng, int64_t n_prompt, const bench_options& o);

// Minimum bytes one decode step moves for `batch` sequences at `context` tokens.
double decode_bytes_per_step(const model& m, int64_t batch, int64_t context, bool kv_fp8 = false,
                             bool state_bf16 = false);

bench_point bench_decode(engine& eng, int64_t batch, int64_t context, const bench_options& o);

}  // namespace tansy
