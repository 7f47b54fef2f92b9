#include "quant/affine.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"

// note: the search's arithmetic is plain fp32 in a fixed order, so its result is the same on every build; fused
// multiply-adds would change roundings (GCC does not contract in ISO C++ mode; clang needs telling).
#ifdef __clang__
#pragma clang fp contract(off)
#endif

// The group search is also compiled for AVX2 and picked at run time (x86-64 only; not under sanitizers, whose
// runtime is not initialised yet when ifunc resolvers run).
#if defined(__SANITIZE_ADDRESS__)
#define TANSY_NO_CLONES 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANSY_NO_CLONES 1
#endif
#endif
#if defined(__x86_64__) && !defined(TANSY_NO_CLONES)
#define TANSY_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define TANSY_AVX2_CLONE
#endif

namespace tansy {

quant_method parse_quant_method(const std::string& s) {
    if (s == "minmax") return quant_method::minmax;
    if (s == "mse") return quant_method::mse;
    fail("unknown quantisation method '%s' (mse or minmax)", s.c_str());
}

const char* quant_method_name(quant_method m) {
    switch (m) {
        case quant_method::minmax: return "minmax";
        case quant_method::mse: return "mse";
    }
    return "?";
}

namespace {

constexpr int MAX_GROUP = 256;  // per-group scratch lives on the stack

// bf16 of a double the way torch's .to(bfloat16) does it from float64: via float, then round to nearest even.
uint16_t bf16_of(double x) { return f32_to_bf16((float)x); }

// MLX's affine rule (mlx/ops.cpp affine_quantize), in double: the edge with the larger magnitude is placed
// exactly on the grid (q0 = round(edge/scale)), the scale is adjusted so that edge = q0*scale, and the bias is
// that edge; scale and bias are then rounded to bf16 and q recomputed against the rounded values.
void minmax_group(const float* w, int n, int bits, uint16_t* scale_out, uint16_t* bias_out, uint8_t* q) {
    const double nb = (double)((1 << bits) - 1);
    double mn = w[0], mx = w[0];
    for (int i = 1; i < n; i++) mn = std::min(mn, (double)w[i]), mx = std::max(mx, (double)w[i]);
    double scale = std::max((mx - mn) / nb, 1e-8);
    const bool neg = std::fabs(mn) > std::fabs(mx);
    if (!neg) scale = -scale;
    const double edge = neg ? mn : mx;
    const double q0 = std::nearbyint(edge / scale);  // round half to even, as torch.round
    if (q0 != 0) scale = edge / q0;
    const double bias = q0 == 0 ? 0.0 : edge;
    *scale_out = bf16_of(scale);
    *bias_out = bf16_of(bias);
    const double s = bf16_to_f32(*scale_out), b = bf16_to_f32(*bias_out);
    for (int i = 0; i < n; i++) q[i] = (uint8_t)std::clamp(std::nearbyint(((double)w[i] - b) / s), 0.0, nb);
}

// The (weighted) squared error of codes q on the grid (s, b), with the dequantised value computed in fp32 as
// every kernel does (matrix::row_f32).
double group_error(const float* w, const float* h, int n, float s, float b, const uint8_t* q) {
    double e = 0;
    for (int i = 0; i < n; i++) {
        const double d = (double)(s * (float)q[i] + b) - (double)w[i];
        e += (h ? (double)h[i] : 1.0) * d * d;
    }
    return e;
}

// Round to nearest, ties to even, for 0 <= x < 2^22: adding 1.5 * 2^23 pushes the fraction bits out under the
// default rounding mode. Unlike std::nearbyint it compiles to two vector adds on baseline x86-64 (no SSE4.1),
// which is what lets the search loops below vectorise.
inline float round_small(float x) { return (x + 12582912.0f) - 12582912.0f; }

constexpr int LANES = 8;  // partial sums per loop: vectorisable without -ffast-math, and a fixed order

// One search pass over a group, all in fp32: nearest-level codes on the grid (s, b), their weighted squared
// error, and the weighted moments of the codes a least-squares refit needs. s may be negative (b is then the
// top level). n % LANES == 0.
struct pass_result {
    float err, q, qq, qw;
};

inline float lane_sum(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

inline pass_result search_pass(const float* w, const float* h, int n, float s, float b, float nmax) {
    const float inv = 1.0f / s;
    float e[LANES] = {}, sq[LANES] = {}, sqq[LANES] = {}, sqw[LANES] = {};
    for (int i = 0; i < n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float x = w[i + j], hx = h[i + j];
            const float q = round_small(std::min(std::max((x - b) * inv, 0.0f), nmax));
            const float d = s * q + b - x;
            e[j] += hx * d * d;
            sq[j] += hx * q, sqq[j] += hx * q * q, sqw[j] += hx * q * x;
        }
    return {lane_sum(e), lane_sum(sq), lane_sum(sqq), lane_sum(sqw)};
}

// Weighted squared error of a grid in fp32 (the search's score; the final choice is re-scored in double).
inline float grid_error(const float* w, const float* h, int n, float s, float b, float nmax) {
    const float inv = 1.0f / s;
    float e[LANES] = {};
    for (int i = 0; i < n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float q = round_small(std::min(std::max((w[i + j] - b) * inv, 0.0f), nmax));
            const float d = s * q + b - w[i + j];
            e[j] += h[i + j] * d * d;
        }
    return lane_sum(e);
}

// Nearest-level codes for the grid (s, b).
inline void assign_codes(const float* w, int n, float s, float b, float nmax, uint8_t* q) {
    const float inv = 1.0f / s;
    for (int i = 0; i < n; i++) q[i] = (uint8_t)round_small(std::min(std::max((w[i] - b) * inv, 0.0f), nmax));
}

uint16_t bf16_step(uint16_t x, int d) { return (uint16_t)(x + d); }  // neighbouring bf16 of the same sign

// A scale whose reciprocal is finite: with finite weights, no search step then meets 0 * inf.
bool usable(float s) { return std::isfinite(s) && std::fabs(s) > 1e-30f; }

struct candidate {
    float s = 0, b = 0, err = INFINITY;  // continuous (unrounded) grid, s > 0, and its error
};

// Clipping ratios of the group's range tried as starting grids. 1.0 is the plain min/max grid; the lower ones
// trade the outermost weights for a finer step, which wins whenever a group has a few outliers. A denser grid
// (60 ratios, 6 refits, 10 candidates rounded) lowers the squared error by only 0.3% more (bench_quant).
constexpr std::array<float, 16> CLIP_RATIOS = {1.0f,  0.97f, 0.94f, 0.91f, 0.88f, 0.85f, 0.82f, 0.79f,
                                               0.76f, 0.73f, 0.70f, 0.66f, 0.62f, 0.58f, 0.54f, 0.50f};
constexpr int REFITS = 2;     // least-squares refits per start (a third changes the error by <0.1%)
constexpr int ROUND_TOP = 3;  // continuous candidates carried into the bf16 rounding stage

// The mse method for one group (see quant_method::mse). Writes bf16 scale/bias and the codes. The AVX2 clone
// gives the same result: the lanes above fix the order of every sum.
TANSY_AVX2_CLONE void mse_group(const float* w, const float* h_in, int n, int bits, uint16_t* scale_out,
                                uint16_t* bias_out, uint8_t* q_out) {
    const float nmax = (float)((1 << bits) - 1);
    static const std::array<float, MAX_GROUP> ones = [] {
        std::array<float, MAX_GROUP> a;
        a.fill(1.0f);
        return a;
    }();
    const float* h = h_in ? h_in : ones.data();
    // MLX's own grid is the baseline, scored as the kernels see it: the search only ever improves on it.
    minmax_group(w, n, bits, scale_out, bias_out, q_out);
    const double base = group_error(w, h_in, n, bf16_to_f32(*scale_out), bf16_to_f32(*bias_out), q_out);
    float mn = w[0], mx = w[0];
    double sh = 0, sw = 0;
    for (int i = 0; i < n; i++) mn = std::min(mn, w[i]), mx = std::max(mx, w[i]), sh += h[i], sw += (double)h[i] * w[i];
    const float range = mx - mn;
    if (!(range > 0) || base == 0 || !(sh > 0)) return;  // constant group: minmax is exact

    // 1. Continuous search: starting grids from clipped ranges anchored low, high and centred, each refined by
    //    alternating nearest-level assignment and a least-squares refit of (scale, bias).
    std::array<candidate, ROUND_TOP> top{};
    auto keep = [&](float s, float b, float e) {
        for (const candidate& c : top)
            if (c.s == s && c.b == b) return;
        if (!(e < top[ROUND_TOP - 1].err)) return;
        int k = ROUND_TOP - 1;
        while (k > 0 && top[k - 1].err > e) top[k] = top[k - 1], k--;
        top[k] = {s, b, e};
    };
    for (float r : CLIP_RATIOS) {
        const float s0 = range * r / nmax, cut = range - range * r;
        const float anchors[3] = {mn, mn + cut, mn + 0.5f * cut};
        for (int a = 0; a < (r == 1.0f ? 1 : 3); a++) {
            float s = s0, b = anchors[a];
            if (!usable(s)) break;  // a range near the bottom of fp32: minmax stands
            pass_result p = search_pass(w, h, n, s, b, nmax);
            for (int it = 0; it < REFITS; it++) {
                // least squares for fixed codes: min over (s, b) of sum h (w - s q - b)^2
                const double det = sh * p.qq - (double)p.q * p.q;
                if (!(det > 1e-9 * sh * p.qq)) break;
                const float s1 = (float)((sh * p.qw - p.q * sw) / det), b1 = (float)((p.qq * sw - p.q * p.qw) / det);
                if (!(s1 > 0) || !usable(s1) || !std::isfinite(b1)) break;
                const pass_result p1 = search_pass(w, h, n, s1, b1, nmax);
                if (!(p1.err < p.err)) break;
                s = s1, b = b1, p = p1;
            }
            keep(s, b, p.err);
        }
    }

    // 2. bf16 rounding: for each candidate and both orientations of its grid (bias at the low end with s > 0,
    //    or at the high end with s < 0: the same levels, but a different value must survive rounding), round s,
    //    re-fit the bias for that s and the candidate's codes, round it, and try the neighbouring bf16 values of
    //    both; each is scored with the codes re-assigned.
    float best = INFINITY;
    uint16_t best_s = 0, best_b = 0;
    for (const candidate& c : top) {
        if (!std::isfinite(c.err)) continue;
        const pass_result m = search_pass(w, h, n, c.s, c.b, nmax);  // the candidate's code moments
        for (int orient = 0; orient < 2; orient++) {
            const float s_c = orient ? -c.s : c.s;
            const uint16_t s16 = f32_to_bf16(s_c);
            for (int ds = -1; ds <= 1; ds++) {
                const uint16_t s_try = bf16_step(s16, ds);
                const float sf = bf16_to_f32(s_try);
                if (!usable(sf) || (sf > 0) != (s_c > 0)) continue;
                // mean of w - sf*code, where the flipped grid's codes are nmax - q
                const double b_fit = orient ? (sw - (double)sf * (nmax * sh - m.q)) / sh : (sw - (double)sf * m.q) / sh;
                const uint16_t b16 = f32_to_bf16((float)b_fit);
                const bool zero = (b16 & 0x7fff) == 0;  // +-0 has no same-signed neighbour below
                for (int db = zero ? 0 : -1; db <= (zero ? 0 : 1); db++) {
                    const uint16_t b_try = bf16_step(b16, db);
                    const float bf = bf16_to_f32(b_try);
                    if (!std::isfinite(bf)) continue;
                    const float e = grid_error(w, h, n, sf, bf, nmax);
                    if (e < best) best = e, best_s = s_try, best_b = b_try;
                }
            }
        }
    }
    if (!std::isfinite(best)) return;
    // 3. The winner against MLX's grid, both scored exactly (double sums of the fp32 dequantised values).
    uint8_t q[MAX_GROUP];
    const float sf = bf16_to_f32(best_s), bf = bf16_to_f32(best_b);
    assign_codes(w, n, sf, bf, nmax, q);
    if (group_error(w, h_in, n, sf, bf, q) < base) {
        *scale_out = best_s, *bias_out = best_b;
        memcpy(q_out, q, (size_t)n);
    }
}

}  // namespace

void quantize_rows_into(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                        uint32_t* packed, uint16_t* scales, uint16_t* biases, const float* col_weight) {
    TANSY_CHECK(bits == 2 || bits == 4 || bits == 8, "bits=%d", bits);
    TANSY_CHECK(group > 0 && group <= MAX_GROUP && group % LANES == 0 && group % (32 / bits) == 0 && cols % group == 0,
                "cols=%lld group=%d bits=%d", (long long)cols, group, bits);
    const int per_word = 32 / bits;
    const int64_t G = cols / group, words = cols / per_word;
    // Dynamic schedule: the search's cost varies per row (constant groups end early); a row's result does not
    // depend on which thread computes it.
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t q[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) {
            const float* wg = w + r * cols + g * group;
            const float* hg = col_weight ? col_weight + g * group : nullptr;
            uint16_t* s = &scales[r * G + g];
            uint16_t* b = &biases[r * G + g];
            switch (method) {
                case quant_method::minmax: minmax_group(wg, group, bits, s, b, q); break;
                case quant_method::mse: mse_group(wg, hg, group, bits, s, b, q); break;
            }
            uint32_t* dst = &packed[r * words + g * group / per_word];
            for (int k = 0; k < group / per_word; k++) {
                uint32_t word = 0;
                for (int j = 0; j < per_word; j++) word |= (uint32_t)q[k * per_word + j] << (bits * j);
                dst[k] = word;
            }
        }
    }
}

void quantize_rows(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                   quantized_rows* out, const float* col_weight) {
    TANSY_CHECK(bits > 0 && group > 0, "bits=%d group=%d", bits, group);
    out->packed.resize((size_t)(rows * (cols * bits / 32)));
    out->scales.resize((size_t)(rows * (cols / group)));
    out->biases.resize((size_t)(rows * (cols / group)));
    quantize_rows_into(w, rows, cols, bits, group, method, out->packed.data(), out->scales.data(),
                       out->biases.data(), col_weight);
}

void dequantize_rows(const quantized_rows& q, int64_t rows, int64_t cols, int bits, int group, float* out) {
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const int64_t G = cols / group, words = cols / per_word;
    TANSY_CHECK(q.packed.size() == (size_t)(rows * words) && q.scales.size() == (size_t)(rows * G),
                "quantized_rows does not hold %lld x %lld at %d bits", (long long)rows, (long long)cols, bits);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const float s = bf16_to_f32(q.scales[(size_t)(r * G + c / group)]);
            const float b = bf16_to_f32(q.biases[(size_t)(r * G + c / group)]);
            const uint32_t v = (q.packed[(size_t)(r * words + c / per_word)] >> (bits * (c % per_word))) & mask;
            out[r * cols + c] = s * (float)v + b;
        }
}

}  // namespace tansy
