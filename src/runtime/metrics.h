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

// Mean of token_nll over rows: row i of logits [rows, vocab] predicts targets[i].
double mean_nll(const float* logits, int64_t rows, int64_t vocab, const int32_t* targets);

// The p-th percentile (0..100) of v by the nearest-rank rule (the smallest value with at least p% of v at or
// below it); 0 for an empty v.
double percentile(std::vector<double> v, double p);

// How a candidate's logits differ from a reference's over the same rows (the consistency report of
// `tansy eval`): top-1 agreement and the distribution of KL(reference || candidate) per row.
struct logits_comparison {
    int64_t rows = 0;
    double top1_agreement = 0;
    double mean_kl = 0, p99_kl = 0, max_kl = 0;
};
logits_comparison compare_logits(const float* ref, const float* cand, int64_t rows, int64_t vocab);

}  // namespace tansy
