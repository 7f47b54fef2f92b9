#include "runtime/metrics.h"

#include <algorithm>
#include <cmath>

#include "sampling/sampler.h"

namespace tansy {

static double log_sum_exp(const float* x, int64_t n) {
    double mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += std::exp((double)x[i] - mx);
    return mx + std::log(s);
}

double token_nll(const float* logits, int64_t vocab, int32_t target) {
    return log_sum_exp(logits, vocab) - (double)logits[target];
}

double kl_divergence(const float* ref, const float* ours, int64_t vocab) {
    const double lr = log_sum_exp(ref, vocab), lo = log_sum_exp(ours, vocab);
    double kl = 0;
    for (int64_t i = 0; i < vocab; i++) {
        const double lp = (double)ref[i] - lr, lq = (double)ours[i] - lo;
        kl += std::exp(lp) * (lp - lq);
    }
    return kl > 0 ? kl : 0.0;  // rounding can give tiny negatives
}

double rel_frobenius(const float* a, const float* b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double mean_nll(const float* logits, int64_t rows, int64_t vocab, const int32_t* targets) {
    double s = 0;
    for (int64_t i = 0; i < rows; i++) s += token_nll(logits + i * vocab, vocab, targets[i]);
    return rows ? s / (double)rows : 0.0;
}

double percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const double rank = std::ceil(p / 100.0 * (double)v.size());
    const size_t i = (size_t)std::clamp(rank, 1.0, (double)v.size()) - 1;
    return v[i];
}

logits_comparison compare_logits(const float* ref, const float* cand, int64_t rows, int64_t vocab) {
    logits_comparison c;
    c.rows = rows;
    std::vector<double> kl((size_t)rows);
    int64_t same = 0;
#pragma omp parallel for reduction(+ : same) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *r = ref + i * vocab, *q = cand + i * vocab;
        same += argmax(r, vocab) == argmax(q, vocab);
        kl[(size_t)i] = kl_divergence(r, q, vocab);
    }
    double sum = 0;
    for (double k : kl) sum += k, c.max_kl = std::max(c.max_kl, k);
    if (rows) c.top1_agreement = (double)same / (double)rows, c.mean_kl = sum / (double)rows;
    c.p99_kl = percentile(std::move(kl), 99.0);
    return c;
}

}  // namespace tansy
