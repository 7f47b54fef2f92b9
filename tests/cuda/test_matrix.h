// A random weight matrix in one of the checkpoint formats, on the host (the `matrix` view the CPU twins read)
// and on the device (the `dmat` the kernels read), for the GEMV/GEMM kernel tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cuda/device.h"
#include "backend/cuda/gemv.cuh"
#include "core/dtype.h"
#include "model/weights.h"
#include "test_util.h"

namespace tansy::test {

// v as the fast kernel rounds it: fp16 (11 significant bits, subnormals below 2^-14), clamped to its range.
inline float f16_round(float v) {
    v = std::clamp(v, -65504.0f, 65504.0f);
    const float a = std::fabs(v);
    if (a < 6.103515625e-05f) return std::nearbyint(v * 16777216.0f) / 16777216.0f;  // multiples of 2^-24
    int e = 0;
    std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): spacing 2^(e - 11)
    const float q = std::ldexp(1.0f, e - 11);
    return std::clamp(std::nearbyint(v / q) * q, -65504.0f, 65504.0f);
}

// An IEEE half (as to_f16 and the fast GEMM's fp16 outputs store it) as a float.
inline float f16_bits_to_float(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float mag = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), e - 25);
    return (h & 0x8000) ? -mag : mag;
}

// A random matrix in a checkpoint format on the host (matrix view) and on the device (dmat).
struct test_matrix {
    matrix m;
    std::vector<uint32_t> words, sb;
    std::vector<uint16_t> sc, bi, dense;
    cuda::device_buffer dw, dsb;
    cuda::dmat d;

    test_matrix(cuda::dfmt f, int64_t rows, int64_t cols, uint32_t seed, int group = 64) {
        std::mt19937 rng(seed);
        m.rows = rows, m.cols = cols;
        m.name.assign(1, 'w');  // note: `= "w"` trips a GCC 12 -Wrestrict false positive here
        if (f != cuda::dfmt::bf16) {
            const int bits = f == cuda::dfmt::q4 ? 4 : 8;
            words.resize((size_t)(rows * cols * bits / 32));
            for (auto& w : words) w = rng();
            const int64_t G = cols / group;
            auto s = random_uniform((size_t)(rows * G), rng(), 0.001f, 0.05f);
            auto b = random_uniform((size_t)(rows * G), rng(), -0.3f, 0.3f);
            for (size_t i = 0; i < s.size(); i++) {
                sc.push_back(f32_to_bf16(s[i]));
                bi.push_back(f32_to_bf16(b[i]));
                sb.push_back((uint32_t)sc.back() | ((uint32_t)bi.back() << 16));
            }
            m.fmt = wfmt::affine, m.type = dtype::bf16, m.bits = bits, m.group = group;
            m.w = (const uint8_t*)words.data(), m.scales = (const uint8_t*)sc.data(), m.biases = (const uint8_t*)bi.data();
        } else {
            for (float x : random_normal((size_t)(rows * cols), rng(), 0.05f)) dense.push_back(f32_to_bf16(x));
            m.fmt = wfmt::dense, m.type = dtype::bf16;
            m.w = (const uint8_t*)dense.data();
        }
        dw = cuda::device_buffer(words.empty() ? dense.size() * 2 : words.size() * 4);
        dw.upload(words.empty() ? (const void*)dense.data() : (const void*)words.data(), dw.size());
        dsb = cuda::device_buffer(std::max<size_t>(sb.size(), 1) * 4);
        if (!sb.empty()) dsb.upload(sb.data(), sb.size() * 4);
        d.fmt = f, d.rows = rows, d.cols = cols, d.group = f == cuda::dfmt::bf16 ? 0 : group;
        d.w = (const uint32_t*)dw.get();
        d.sb = sb.empty() ? nullptr : (const uint32_t*)dsb.get();
    }
    // Row r as the fast kernel sees it: dequantised, rounded to fp16 (or not).
    std::vector<float> row(int64_t r, bool round) const {
        std::vector<float> v((size_t)m.cols);
        m.row_f32(r, v.data());
        if (round)
            for (float& x : v) x = f16_round(x);
        return v;
    }
};

}  // namespace tansy::test
