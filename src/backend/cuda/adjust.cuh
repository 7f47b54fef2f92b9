// Per-slot logit adjustments before a decode step's pick: presence/frequency/repetition penalties and logit_bias
// (backend.h: k_adjust_cols, k_count_prompt_bit), and the count of each slot's picks they read.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace tansy::cuda {

// In place on logits [rows, cols]: row r gets slot row_slot[r]'s adjustments when pen marks the slot active; the
// first n_valid columns only; counts [slots, counts_cols], bias [slots, 2 * max_bias]. CPU twin:
// backend::adjust_logits of the cpu backend.
void adjust_logits_rows(float* logits, int rows, int64_t cols, int64_t n_valid, const int32_t* row_slot,
                        const float* pen, const int32_t* counts, int64_t counts_cols, const int32_t* bias,
                        int max_bias, cudaStream_t stream);
// counts[row_slot[r]][ids[r]] += 1 (saturating) for rows of active slots. CPU twin: backend::count_picks.
void count_picks_rows(int32_t* counts, int64_t counts_cols, const int32_t* ids, const int32_t* row_slot,
                      const float* pen, int rows, cudaStream_t stream);

}  // namespace tansy::cuda
