// Per-slot logit adjustments before a decode step's pick: presence/frequency/repetition penalties, logit_bias and
// grammar masks
// (backend.h: k_adjust_cols, k_count_prompt_bit), and the count of each slot's picks they read.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace tansy::cuda {

// In place on logits [rows, cols]: row r gets slot row_slot[r]'s penalties and bias where pen marks them active,
// then its grammar mask where pen marks it masked; the first n_valid columns only; counts [slots, counts_cols],
// bias [slots, 2 * max_bias], mask [slots, mask_cols] (may be null when no slot uses them). CPU twin:
// backend::adjust_logits of the cpu backend.
void adjust_logits_rows(float* logits, int rows, int64_t cols, int64_t n_valid, const int32_t* row_slot,
                        const float* pen, const int32_t* counts, int64_t counts_cols, const int32_t* bias,
                        int max_bias, const uint32_t* mask, int64_t mask_cols, cudaStream_t stream);
// counts[row_slot[r]][ids[r]] += 1 (saturating) for rows of active slots. CPU twin: backend::count_picks.
void count_picks_rows(int32_t* counts, int64_t counts_cols, const int32_t* ids, const int32_t* row_slot,
                      const float* pen, int rows, cudaStream_t stream);

}  // namespace tansy::cuda
