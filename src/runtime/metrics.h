// Teacher-forced quality metrics over rows of logits (double precision throughout).
#pragma once
#include <cstdint>
#include <vector>

namespace tansy {

// -log softmax(logits)[target]
double token_nll(const float* logits, int64_t vocab, int32_t target);
// KL(p || q) with p = softmax(ref), q = softmax(ours)
double kl_divergence(const float* ref, const float* ours, int64_t vocab);

struct agreement {
    int64_t n = 0, same = 0;
    double rate() const { return n ? (double)same / (double)n : 0.0; }
};

// Relative Frobenius error ||a - b|| / ||b||.
double rel_frobenius(const float* a, const float* b, int64_t n);

}  // namespace tansy
