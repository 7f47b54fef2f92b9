#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace tansy {

int32_t argmax(const float* logits, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return (int32_t)best;
}

sampler::sampler(sampling_params p, int64_t n_valid) : p_(p), n_valid_(n_valid) {
    if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) fail("temperature must be >= 0");
    if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1]");
    if (!(p.min_p >= 0 && p.min_p < 1)) fail("min_p must be in [0, 1)");
    if (p.top_k < 0) fail("top_k must be >= 0");
    rng_ = p.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
}

double sampler::uniform() {
    // splitmix64: tiny, fast, good enough for sampling
    uint64_t z = (rng_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

int32_t sampler::sample(const float* logits, int64_t vocab) {
    const int64_t n = n_valid_ > 0 ? std::min(n_valid_, vocab) : vocab;
    if (p_.temperature == 0.0f) return argmax(logits, n);
    cand_.clear();
    for (int64_t i = 0; i < n; i++) cand_.emplace_back(logits[i], (int32_t)i);
    auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
    size_t keep = cand_.size();
    if (p_.top_k > 0 && (size_t)p_.top_k < keep) {
        keep = (size_t)p_.top_k;
        std::partial_sort(cand_.begin(), cand_.begin() + (ptrdiff_t)keep, cand_.end(), by_logit);
        cand_.resize(keep);
    } else {
        std::sort(cand_.begin(), cand_.end(), by_logit);
    }
    // Softmax at temperature over the survivors (in double: stable for any temperature).
    std::vector<double> pr(keep);
    const double mx = cand_[0].first, inv_t = 1.0 / p_.temperature;
    double sum = 0;
    for (size_t i = 0; i < keep; i++) sum += pr[i] = std::exp(((double)cand_[i].first - mx) * inv_t);
    for (double& x : pr) x /= sum;
    if (p_.min_p > 0) {
        size_t k = 1;
        while (k < keep && pr[k] >= p_.min_p * pr[0]) k++;
        keep = k;
    }
    if (p_.top_p < 1) {
        double cum = 0;
        size_t k = 0;
        while (k < keep) {
            cum += pr[k++];
            if (cum >= p_.top_p) break;
        }
        keep = k;
    }
    double total = 0;
    for (size_t i = 0; i < keep; i++) total += pr[i];
    double r = uniform() * total;
    for (size_t i = 0; i < keep; i++) {
        r -= pr[i];
        if (r < 0) return cand_[i].second;
    }
    return cand_[keep - 1].second;
}

}  // namespace tansy
