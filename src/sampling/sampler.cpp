#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <bit>

#include "core/check.h"
#include "sampling/sampler_math.h"

namespace tansy {

// The maximum first, in 8 independent lanes (the compiler turns `a > b ? a : b` into vector max instructions),
// then the first position holding it: 6x faster over a 248K vocabulary than one loop tracking the index.
// NaNs are skipped, unless every value is one (then 0).
int32_t argmax(const float* logits, int64_t n) {
    if (n <= 0) return 0;
    float m[8];
    for (float& v : m) v = -INFINITY;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m[j] = logits[i + j] > m[j] ? logits[i + j] : m[j];
    for (; i < n; i++) m[0] = logits[i] > m[0] ? logits[i] : m[0];
    float mx = m[0];
    for (int j = 1; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    for (i = 0; i < n; i++)
        if (logits[i] == mx) return (int32_t)i;
    return 0;  // all NaN
}

sampler::sampler(sampling_params p, int64_t n_valid) : p_(p), n_valid_(n_valid) {
    if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) fail("temperature must be >= 0");
    if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1]");
    if (!(p.min_p >= 0 && p.min_p < 1)) fail("min_p must be in [0, 1)");
    if (p.top_k < 0) fail("top_k must be >= 0");
    rng_ = sampling_math::rng_start(p.seed);
}

double sampler::uniform() { return sampling_math::rng_uniform(rng_); }  // splitmix64: tiny, fast, good enough

// The filters as defined: top-k on the logits, softmax at temperature over the survivors, then min-p (relative to
// the best) and top-p (the shortest descending prefix reaching top_p of the survivors' mass), whichever keeps
// fewer; then a draw. Sorting the whole vocabulary for every draw would cost milliseconds per token at 248K ids,
// so one pass keeps the tokens that can matter and only those are ordered, only as far as needed:
//  - a token whose probability is below e^-40 (sampling_math::k_cut) of the best's cannot change a sum whose
//    largest term is the best's (e^-40 x 248K < 2^-24 relative): dropped up front (its own chance is < 1e-11);
//  - without top-p, min-p is the same kind of cut: p_i >= min_p p_best <=> (l_i - l_best) / T >= ln(min_p);
//  - top-k keeps a bounded heap of the best k, top-p sorts prefixes of growing length until the mass is reached.
// The draw walks the survivors in descending order when top-k or top-p ordered them, else in id order (the same
// distribution; a seeded sampler repeats its draws either way). The top-k path is sampling_math::draw_sorted,
// which the CUDA sampler runs too.
int32_t sampler::sample(const float* logits, int64_t vocab) {
    using sampling_math::weight;
    const int64_t n = n_valid_ > 0 ? std::min(n_valid_, vocab) : vocab;
    if (p_.temperature == 0.0f || n <= 1) return argmax(logits, n);
    const int32_t best = argmax(logits, n);
    const float mx = logits[best], t = p_.temperature, inv_t = sampling_math::inv_temperature(t);
    if (!std::isfinite(mx)) return best;  // every token masked (-inf), or an infinite logit: nothing to weigh
    float floor_logit = sampling_math::floor_logit(mx, t);
    auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
    cand_.clear();
    if (p_.top_k > 0 && p_.top_k < n) {
        // a min-heap (worst on top) of the best top_k so far; most tokens fail the first comparison
        const size_t k = (size_t)p_.top_k;
        for (int64_t i = 0; i < n; i++) {
            const float l = logits[i];
            if (!(l >= floor_logit)) continue;
            if (cand_.size() < k) {
                cand_.emplace_back(l, (int32_t)i);
                std::push_heap(cand_.begin(), cand_.end(), by_logit);
            } else if (l > cand_.front().first) {  // ties keep the lower id, already in
                std::pop_heap(cand_.begin(), cand_.end(), by_logit);
                cand_.back() = {l, (int32_t)i};
                std::push_heap(cand_.begin(), cand_.end(), by_logit);
            }
        }
        std::sort(cand_.begin(), cand_.end(), by_logit);
        sl_.resize(cand_.size());
        w_.resize(cand_.size());
        for (size_t i = 0; i < cand_.size(); i++) sl_[i] = cand_[i].first;
        const int i = sampling_math::draw_sorted(sl_.data(), (int)sl_.size(), inv_t, p_.top_p, p_.min_p, uniform(), w_.data());
        return cand_[(size_t)i].second;
    }
    if (p_.min_p > 0 && p_.top_p >= 1)  // no top-p: min-p needs no order and no total, only a cut
        floor_logit = std::max(floor_logit, sampling_math::add_rn(mx, sampling_math::mul_rn(t, std::log(p_.min_p))));
    for (int64_t i = 0; i < n; i++)
        if (logits[i] >= floor_logit) cand_.emplace_back(logits[i], (int32_t)i);
    size_t keep = cand_.size();
    w_.resize(keep);
    for (size_t i = 0; i < keep; i++) w_[i] = weight(cand_[i].first, mx, inv_t);
    if (p_.top_p < 1) {
        // the shortest descending prefix whose mass reaches top_p of the total
        const double target = (double)p_.top_p * sampling_math::sum8(w_.data(), (int64_t)keep);
        size_t m = std::min(keep, (size_t)64), k = 0;
        for (;;) {
            std::partial_sort(cand_.begin(), cand_.begin() + (ptrdiff_t)m, cand_.begin() + (ptrdiff_t)keep, by_logit);
            double cum = 0;
            for (k = 0; k < m;) {
                cum += weight(cand_[k++].first, mx, inv_t);
                if (cum >= target) break;
            }
            if (cum >= target || m == keep) break;
            m = std::min(keep, m * 8);
        }
        keep = k;
        for (size_t i = 0; i < keep; i++) w_[i] = weight(cand_[i].first, mx, inv_t);
        if (p_.min_p > 0) {  // and min-p's prefix, if shorter
            size_t j = 1;
            while (j < keep && w_[j] >= p_.min_p) j++;
            keep = j;
        }
    }
    double r = uniform() * sampling_math::sum8(w_.data(), (int64_t)keep);
    for (size_t i = 0; i < keep; i++) {
        r -= w_[i];
        if (r < 0) return cand_[i].second;
    }
    return cand_[keep - 1].second;
}

}  // namespace tansy
