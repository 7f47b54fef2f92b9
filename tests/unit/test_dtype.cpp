#include <cmath>

#include "core/dtype.h"
#include "test_util.h"

using namespace tansy;

TEST(dtype, bf16_round_trip_and_rounding) {
    for (float f : {0.0f, 1.0f, -2.5f, 3.140625f, 0x1p-100f, 65536.0f}) EXPECT_EQ(bf16_to_f32(f32_to_bf16(f)), f);
    // 1 + 2^-8 is exactly half-way between two bf16 values: ties to even (down to 1.0).
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(dtype, f16_to_f32_all_classes) {
    EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
    EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
    EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
    EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));
    EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
    EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
    EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
    EXPECT_EQ(f16_to_f32(0x8000), -0.0f);
}
