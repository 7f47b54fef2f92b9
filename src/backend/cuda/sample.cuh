// Top-k sampling on the device (temperature, top-k 1..k_sample_max_top_k, top-p, min-p): the sampled token is
// written to device memory like argmax_rows' (a decode step with sampling stays one graph replay), and the
// splitmix64 state lives on the device too. Same candidates and same arithmetic as the host sampler
// (sampling/sampler_math.h), so both draw the same token from the same logits and seed. Host launcher only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tansy::cuda {

constexpr int k_sample_max_top_k = 64;
// Vocabulary sizes the device draws from (ids 0 .. n_valid-1), at most: the split layout's (sample.cu).
constexpr int64_t k_sample_max_ids = 524288;

struct sample_args {
    float temperature = 1.0f;  // > 0
    int top_k = 1;             // 1 .. k_sample_max_top_k
    float top_p = 1.0f;        // (0, 1]
    float min_p = 0.0f;        // [0, 1)
};

// Scratch (uint64 words) that a draw of `rows` rows of n_valid ids needs.
size_t sample_scratch_words(int rows, int64_t n_valid);

// ids[r] = a draw from row r of logits [rows, ld] (only the first n_valid columns compete); rng[r] is row r's
// splitmix64 state, advanced once. CPU twin: tansy::sampler with the same parameters and seed.
void sample_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const sample_args& a,
                 uint64_t* rng, uint64_t* scratch, cudaStream_t stream);

// The rows of a batch of sequence slots: row r draws with slot row_slot[r]'s parameters (params [slots, 4]:
// temperature, top_k, top_p, min_p) and advances rng[row_slot[r]]; a row whose slot has temperature 0 or a top-k
// outside 1..k_sample_max_top_k keeps ids[r] (the argmax written before). CPU twin: backend::sample_rows.
void sample_slot_rows(int32_t* ids, const float* logits, int rows, int64_t ld, int64_t n_valid, const float* params,
                      uint64_t* rng, const int32_t* row_slot, uint64_t* scratch, cudaStream_t stream);

}  // namespace tansy::cuda
