#include "runtime/metrics.h"

#include <cmath>

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

}  // namespace tansy
