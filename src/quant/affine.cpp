#include "quant/affine.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/dtype.h"

namespace tansy {

quant_method parse_quant_method(const std::string& s) {
    if (s == "minmax") return quant_method::minmax;
    fail("unknown quantisation method '%s' (minmax)", s.c_str());
}

const char* quant_method_name(quant_method m) {
    switch (m) {
        case quant_method::minmax: return "minmax";
    }
    return "?";
}

namespace {

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

}  // namespace

void quantize_rows(const float* w, int64_t rows, int64_t cols, int bits, int group, quant_method method,
                   quantized_rows* out) {
    TANSY_CHECK(bits == 2 || bits == 4 || bits == 8, "bits=%d", bits);
    TANSY_CHECK(group > 0 && cols % group == 0, "cols=%lld group=%d", (long long)cols, group);
    const int per_word = 32 / bits;
    const int64_t G = cols / group, words = cols / per_word;
    out->packed.assign((size_t)(rows * words), 0);
    out->scales.resize((size_t)(rows * G));
    out->biases.resize((size_t)(rows * G));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        std::vector<uint8_t> q((size_t)group);
        for (int64_t g = 0; g < G; g++) {
            const float* wg = w + r * cols + g * group;
            switch (method) {
                case quant_method::minmax:
                    minmax_group(wg, group, bits, &out->scales[(size_t)(r * G + g)], &out->biases[(size_t)(r * G + g)],
                                 q.data());
                    break;
            }
            uint32_t* dst = &out->packed[(size_t)(r * words + g * group / per_word)];
            for (int i = 0; i < group; i++) dst[i / per_word] |= (uint32_t)q[(size_t)i] << (bits * (i % per_word));
        }
    }
}

}  // namespace tansy
