// FP8 E4M3 and the KV cache's 8-bit rounding (core/fp8.h): the code table, round-to-nearest-even against a
// brute-force nearest search, saturation, and the power-of-two scale rule. The CUDA kernels use the same scale
// rule and the hardware conversion; cuda_attention_prefill.fp8_cache_rows checks the GPU's cache against this.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/fp8.h"

using namespace tansy;

namespace {

// Every finite E4M3 magnitude, ascending, with its code.
std::vector<std::pair<float, uint8_t>> magnitudes() {
    std::vector<std::pair<float, uint8_t>> m;
    for (int c = 0; c < 0x7F; c++) m.push_back({e4m3_decode((uint8_t)c), (uint8_t)c});
    return m;
}

// The nearest magnitude to a (ties: the even code), the saturating rule for a >= 448.
uint8_t nearest_code(float a) {
    const auto m = magnitudes();
    if (a >= k_e4m3_max) return 0x7E;
    uint8_t best = 0;
    double bd = INFINITY;
    for (auto [v, c] : m) {
        const double d = std::fabs((double)v - (double)a);
        if (d < bd || (d == bd && (c & 1) == 0)) bd = d, best = c;
    }
    return best;
}

}  // namespace

TEST(fp8, code_table) {
    EXPECT_EQ(e4m3_decode(0x00), 0.0f);
    EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
    EXPECT_EQ(e4m3_decode(0x07), 7.0f * std::ldexp(1.0f, -9));
    EXPECT_EQ(e4m3_decode(0x08), std::ldexp(1.0f, -6));  // smallest normal
    EXPECT_EQ(e4m3_decode(0x38), 1.0f);
    EXPECT_EQ(e4m3_decode(0x39), 1.125f);
    EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
    EXPECT_EQ(e4m3_decode(0xB8), -1.0f);
    EXPECT_TRUE(std::isnan(e4m3_decode(0x7F)));
    EXPECT_TRUE(std::isnan(e4m3_decode(0xFF)));
    // strictly increasing over the finite positive codes, and every code round-trips
    for (int c = 0; c < 0x7F; c++) {
        EXPECT_EQ(e4m3_encode(e4m3_decode((uint8_t)c)), c) << c;
        if (c == 0) continue;
        EXPECT_LT(e4m3_decode((uint8_t)(c - 1)), e4m3_decode((uint8_t)c)) << c;
        EXPECT_EQ(e4m3_encode(e4m3_decode((uint8_t)(c | 0x80))), c | 0x80) << c;
    }
}

TEST(fp8, rounds_to_nearest_even_and_saturates) {
    EXPECT_EQ(e4m3_encode(1.0625f), 0x38);                        // tie between 1 and 1.125: even
    EXPECT_EQ(e4m3_encode(1.1875f), 0x3A);                        // tie between 1.125 and 1.25: even
    EXPECT_EQ(e4m3_encode(std::ldexp(1.0f, -10)), 0x00);          // half the smallest subnormal: 0
    EXPECT_EQ(e4m3_encode(3.0f * std::ldexp(1.0f, -10)), 0x02);   // tie between subnormals 1 and 2: even
    EXPECT_EQ(e4m3_encode(15.5f * std::ldexp(1.0f, -10)), 0x08);  // rounds up into the first normal
    EXPECT_EQ(e4m3_encode(460.0f), 0x7E);
    EXPECT_EQ(e4m3_encode(1e30f), 0x7E);
    EXPECT_EQ(e4m3_encode(-std::numeric_limits<float>::infinity()), 0xFE);
    EXPECT_EQ(e4m3_encode(std::nanf("")), 0x7F);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> ex(-12.0f, 9.5f);
    for (int i = 0; i < 20000; i++) {
        const float a = std::exp2(ex(rng));
        ASSERT_EQ(e4m3_encode(a), nearest_code(a)) << a;
        ASSERT_EQ(e4m3_encode(-a), nearest_code(a) | 0x80) << -a;
    }
}

TEST(fp8, kv_scale_is_the_smallest_power_of_two_that_fits) {
    EXPECT_EQ(kv8_scale_exp(448.0f), 0);
    EXPECT_EQ(kv8_scale_exp(448.5f), 1);
    EXPECT_EQ(kv8_scale_exp(1.0f), -8);  // 1 / 2^-8 = 256 <= 448 < 512
    EXPECT_EQ(kv8_scale_exp(0.0f), k_kv8_min_exp);
    EXPECT_EQ(kv8_scale_exp(std::numeric_limits<float>::infinity()), 0);
    EXPECT_EQ(kv8_scale_exp(1e30f), k_kv8_max_exp);
    EXPECT_EQ(kv8_scale_exp(1e-35f), k_kv8_min_exp);
    EXPECT_EQ(kv8_scale_exp(std::numeric_limits<float>::denorm_min()), k_kv8_min_exp);
    std::mt19937 rng(12);
    std::uniform_real_distribution<float> ex(-80.0f, 15.0f);
    for (int i = 0; i < 20000; i++) {
        const float a = std::exp2(ex(rng));
        const int e = kv8_scale_exp(a);
        ASSERT_LE(a, std::ldexp(k_e4m3_max, e)) << a;
        ASSERT_GT(a, std::ldexp(k_e4m3_max, e - 1)) << a;
    }
}

TEST(fp8, kv_round_keeps_four_significant_bits) {
    std::mt19937 rng(13);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float mag : {1e-6f, 0.03f, 1.0f, 37.0f, 5000.0f}) {
        std::vector<float> x(256), r;
        for (float& v : x) v = n(rng) * mag;
        r = x;
        kv8_round(r.data(), (int64_t)r.size());
        float amax = 0;
        for (float v : x) amax = std::fmax(amax, std::fabs(v));
        const float s = std::ldexp(1.0f, kv8_scale_exp(amax));
        for (size_t i = 0; i < x.size(); i++) {
            // normals: half a step of 3 mantissa bits; below 2^-6 * s: half a subnormal step
            const float bound = std::fmax(std::fabs(x[i]) / 16.0f, std::ldexp(s, -10));
            ASSERT_LE(std::fabs(r[i] - x[i]), bound) << "magnitude " << mag << " element " << i;
            ASSERT_EQ(e4m3_decode(e4m3_encode(r[i] / s)) * s, r[i]);  // representable: rounding again is a no-op
        }
        std::vector<float> again = r;
        kv8_round(again.data(), (int64_t)again.size());
        EXPECT_EQ(again, r) << "magnitude " << mag;
    }
}
