// The arithmetic of a sampled draw, shared by the host sampler (sampler.cpp) and the CUDA one (backend/cuda/
// sample.cu), so that both draw the same token from the same logits and the same seed: the weights
// e^((l - l_best) / T) by one polynomial with every product and sum rounded on its own (no FMA contraction on
// either side), sums of weights in one fixed order in double, the splitmix64 stream, and the top-p cut and draw
// over candidates sorted by (logit descending, id ascending).
#pragma once
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // TANSY_HD: host and device, inline; f32_bits

namespace tansy::sampling_math {

TANSY_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;  // ISO C++ mode: GCC does not contract across statements or into FMA (-ffp-contract=off)
#endif
}
TANSY_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

// e^x for x <= 0 to ~2e-7 relative: Cody-Waite reduction to [-ln2/2, ln2/2], degree-6 polynomial, no libm call;
// clamped at -87 (e^-87 ~ 2^-126, the result stays a normal float). NaN in, NaN out.
TANSY_HD float exp_nonpos(float x) {
    x = x >= -87.0f ? x : -87.0f;  // NaN too: weight ~0, never a NaN weight
    constexpr float k_round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
    const float n = add_rn(add_rn(mul_rn(x, 1.44269504088896341f), k_round), -k_round);
    const float r = add_rn(add_rn(x, -mul_rn(n, 0.693359375f)), mul_rn(n, 2.12194440e-4f));  // x - n ln2
    float p = 1.0f / 720.0f;
    p = add_rn(mul_rn(p, r), 1.0f / 120.0f);
    p = add_rn(mul_rn(p, r), 1.0f / 24.0f);
    p = add_rn(mul_rn(p, r), 1.0f / 6.0f);
    p = add_rn(mul_rn(p, r), 0.5f);
    p = add_rn(mul_rn(p, r), 1.0f);
    p = add_rn(mul_rn(p, r), 1.0f);
    return f32_from_bits(f32_bits(p) + ((uint32_t)(int32_t)n << 23));  // times 2^n (unsigned: no UB for n < 0)
}

// The weight of a logit l given the best logit and 1/T.
TANSY_HD float weight(float l, float best, float inv_t) { return exp_nonpos(mul_rn(add_rn(l, -best), inv_t)); }

// 1/T; for T below ~2.9e-39 it would overflow (and 0 * inf give NaN weights): FLT_MAX keeps the limit, an even
// draw among the tokens tied at the best.
TANSY_HD float inv_temperature(float t) {
    const float v = 1.0f / t;
    return v <= 3.4028234663852886e38f ? v : 3.4028234663852886e38f;
}

// Tokens below this logit never matter (sampler.cpp): e^-40 of the best's probability; never -inf (a masked
// token stays out at any temperature) and never above the best.
constexpr float k_cut = 40.0f;
TANSY_HD float floor_logit(float best, float t) {
    float f = add_rn(best, -mul_rn(k_cut, t));
    f = f > -3.4028234663852886e38f ? f : -3.4028234663852886e38f;
    return f < best ? f : best;
}

// v[0, n) summed in double through 8 interleaved partial sums, combined pairwise: one fixed order.
TANSY_HD double sum8(const float* v, int64_t n) {
    double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += v[i + j];
    for (; i < n; i++) p[0] += v[i];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// splitmix64: the seed's starting state, and the next uniform in [0, 1) (53 bits).
TANSY_HD uint64_t rng_start(uint64_t seed) { return seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull; }
TANSY_HD double rng_uniform(uint64_t& state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// Candidates l[0, m) sorted by (logit descending, id ascending), l[0] the best (the top-k survivors): their
// weights into w, then min-p (the prefix with w >= min_p, i.e. p >= min_p p_best) and top-p (the shortest
// prefix whose mass reaches top_p of the survivors' total), whichever is shorter; then the draw with u in
// [0, 1). Returns the drawn candidate's index.
TANSY_HD int draw_sorted(const float* l, int m, float inv_t, float top_p, float min_p, double u, float* w) {
    for (int i = 0; i < m; i++) w[i] = weight(l[i], l[0], inv_t);
    int keep = m;
    if (min_p > 0)
        for (keep = 1; keep < m && w[keep] >= min_p;) keep++;
    if (top_p < 1.0f) {
        const double target = (double)top_p * sum8(w, m);
        double cum = 0;
        int k = 0;
        while (k < keep) {
            cum += w[k++];
            if (cum >= target) break;
        }
        keep = k;
    }
    double r = u * sum8(w, keep);
    for (int i = 0; i < keep; i++) {
        r -= w[i];
        if (r < 0) return i;
    }
    return keep - 1;
}

// The penalties of one logit, in scheduler::choose's order (and backend::adjust_logits'): OpenAI's presence and
// frequency penalties for an id generated n > 0 times, then HF's repetition penalty for an id in the prompt or
// the generated text (positive logits divided, negative ones multiplied).
TANSY_HD float presence_frequency(float x, int32_t n, float presence, float frequency) {
    return add_rn(x, -add_rn(mul_rn(frequency, (float)n), presence));
}
TANSY_HD float repetition(float x, float penalty) {
#if defined(__CUDA_ARCH__)
    return x > 0 ? __fdiv_rn(x, penalty) : __fmul_rn(x, penalty);
#else
    return x > 0 ? x / penalty : x * penalty;
#endif
}

}  // namespace tansy::sampling_math
