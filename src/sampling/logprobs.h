// Log-probabilities of a raw logits row as OpenAI's logprobs / top_logprobs report them: the chosen token's
// log-probability and the top N (id, log-probability), N <= k_max_top_logprobs, of the model's distribution
// before penalties, logit_bias, masks and temperature. log p(i) = logit(i) - log-sum-exp(row).
//
// The device computes them per row into a fixed-size record (backend::logprob_rows), k_logprob_words 4-byte
// words, floats as their bits (core/dtype.h f32_bits):
//   [0]                      log-sum-exp of the row's first n_valid logits
//   [1]                      the logit of the row's pick
//   [2 + 2i], [3 + 2i]       i < k_max_top_logprobs: the i-th largest logit's id and the logit, logit descending,
//                            ties to the smaller id; id -1 (logit -inf) past min(N, n_valid)
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace tansy {

constexpr int k_max_top_logprobs = 20;  // OpenAI's cap on top_logprobs
constexpr int64_t k_logprob_words = 2 + 2 * k_max_top_logprobs;

// log(sum_i e^row[i]) over row[0, n), in double with the maximum subtracted; -inf when every entry is -inf.
double log_sum_exp(const float* row, int64_t n);

// The k largest (id, logit) of row[0, n), logit descending, ties to the smaller id (min(k, n) of them). O(n k)
// at worst, one pass without allocating beyond the result.
std::vector<std::pair<int32_t, float>> top_logits(const float* row, int64_t n, int k);

// From a record: the chosen token's log-probability and the top n (id, log-probability), most likely first
// (n <= k_max_top_logprobs; entries with id -1 are left out). Computed in double as the host path does.
void read_logprob_record(const int32_t* rec, int n, float* logprob, std::vector<std::pair<int32_t, float>>* top);

}  // namespace tansy
