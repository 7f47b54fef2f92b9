// FP8 E4M3 (OCP "fn" variant: bias 7, 3 mantissa bits, no infinities, 0x7F/0xFF = NaN, max 448) and the KV
// cache's 8-bit form: each (position, KV head) vector of K or V is stored as E4M3 codes times a power-of-two
// scale chosen from the vector's largest magnitude (kv8_scale_exp), so that the largest value lands at most at
// 448. A power of two makes x / scale and code * scale exact: the CPU reference and the CUDA kernels dequantise
// to the very same floats. Host code here; the CUDA kernels use the same exponent rule (kv8_scale_exp is
// __host__ __device__) and the hardware's round-to-nearest-even conversion; cuda_attention_prefill.fp8_cache_rows
// reads the GPU's cache back and compares it with this rounding.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"  // TANSY_HD

namespace tansy {

constexpr float k_e4m3_max = 448.0f;
// The scale's exponent range. The top keeps 2^(e + 120) finite in fp32 (vectors up to 448 * 2^7 = 57344 keep
// full precision; larger values saturate at that); the bottom keeps the scale a normal float.
constexpr int k_kv8_min_exp = -100, k_kv8_max_exp = 7;

// The exponent e of the smallest power of two with amax <= 448 * 2^e (clamped), from amax's bits: amax =
// 1.f * 2^E, 448 = 1.75 * 2^8, so e = E - 8, plus one when f > 0.75. An all-zero vector takes the smallest
// scale (its codes are 0 either way, and a large scale would only set the attention kernels' V reference); a
// non-finite amax takes 2^0 (the codes saturate or are NaN).
TANSY_HD int kv8_scale_exp(float amax) {
    const uint32_t b = f32_bits(amax) & 0x7FFFFFFFu;
    const int E = (int)(b >> 23);
    if (b == 0) return k_kv8_min_exp;
    if (E == 255) return 0;
    int e = (E == 0 ? -127 : E - 127) - 8 + ((b & 0x7FFFFFu) > 0x600000u ? 1 : 0);
    return e < k_kv8_min_exp ? k_kv8_min_exp : (e > k_kv8_max_exp ? k_kv8_max_exp : e);
}

// E4M3 code of x, rounded to nearest even, saturating to +-448 (NaN -> 0x7F).
inline uint8_t e4m3_encode(float x) {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const float a = std::fabs(x);
    if (a >= k_e4m3_max) return sign | 0x7E;
    if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 of them reach the first normal, code 0x08)
        return sign | (uint8_t)std::nearbyint(a * 512.0f);
    }
    int e = 0;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): a = (2m) * 2^(e-1)
    int q = (int)std::nearbyint((2.0f * m - 1.0f) * 8.0f);
    int ex = e - 1;
    if (q == 8) q = 0, ex++;
    const int code = ((ex + 7) << 3) | q;
    return sign | (uint8_t)(code > 0x7E ? 0x7E : code);
}

inline float e4m3_decode(uint8_t c) {
    const int ex = (c >> 3) & 0xF, q = c & 7;
    if ((c & 0x7F) == 0x7F) return NAN;
    const float mag = ex == 0 ? std::ldexp((float)q, -9) : std::ldexp(1.0f + (float)q / 8.0f, ex - 7);
    return (c & 0x80) ? -mag : mag;
}

// The KV cache's rounding of one vector, in place: x = decode(encode(x / 2^e)) * 2^e.
inline void kv8_round(float* x, int64_t n) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = std::fmax(amax, std::fabs(x[i]));
    const int e = kv8_scale_exp(amax);
    const float inv = std::ldexp(1.0f, -e), s = std::ldexp(1.0f, e);
    for (int64_t i = 0; i < n; i++) x[i] = e4m3_decode(e4m3_encode(x[i] * inv)) * s;
}

}  // namespace tansy
