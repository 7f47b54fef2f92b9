// Element types and scalar conversions, usable on host and device.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANSY_HD __host__ __device__ __forceinline__
#else
#define TANSY_HD inline
#endif

namespace tansy {

// Storage types that appear in checkpoints and in our own buffers.
enum class dtype : uint8_t { f32, f16, bf16, u32, i32, i64, u8, i8, u16, i16, u64, f64, boolean, f8_e4m3, f8_e5m2 };

size_t dtype_size(dtype t);
const char* dtype_name(dtype t);  // safetensors spelling: "F32", "BF16", ...
bool dtype_from_name(const char* s, size_t n, dtype* out);

// The bits of a float as a uint32_t and back (memcpy: the defined way on host and device alike).
template <class TO, class FROM>
TANSY_HD TO bits_as(FROM x) {
    static_assert(sizeof(TO) == sizeof(FROM), "bits_as: sizes differ");
    TO y;
    memcpy(&y, &x, sizeof(TO));
    return y;
}
TANSY_HD uint32_t f32_bits(float f) { return bits_as<uint32_t>(f); }
TANSY_HD float f32_from_bits(uint32_t u) { return bits_as<float>(u); }

TANSY_HD float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even; NaN stays NaN (quiet).
TANSY_HD uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// IEEE half -> float, exact for every input including subnormals, inf and NaN.
TANSY_HD float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

}  // namespace tansy
