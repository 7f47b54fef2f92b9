// Log-prob records of raw logits rows on the device (backend::logprob_rows; layout: sampling/logprobs.h), so that
// a request asking for logprobs / top_logprobs keeps the device pick and only its record comes down. Host
// launcher only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tansy::cuda {

// Vocabulary sizes the records cover (ids 0 .. n_valid-1), at most: the split layout's (logprobs.cu).
constexpr int64_t k_logprob_max_ids = 524288;

// Scratch (uint64 words) that `rows` rows of n_valid ids need.
size_t logprob_scratch_words(int rows, int64_t n_valid);

// records[r] (k_logprob_words int32 words) for the rows r of logits [rows, ld] whose slot asks for log-probs:
// n = top[row_slot[r]] (-1: none, the row is skipped; 0..k_max_top_logprobs), from the first n_valid columns,
// with the logit of ids[r] (the row's pick). CPU twin: cpu::logprob_record (backend::logprob_rows).
void logprob_slot_rows(int32_t* records, const float* logits, int rows, int64_t ld, int64_t n_valid, const int32_t* ids,
                       const int32_t* row_slot, const int32_t* top, uint64_t* scratch, cudaStream_t stream);

}  // namespace tansy::cuda
