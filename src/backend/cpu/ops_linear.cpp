// CPU reference: matmul over any weight format, dot, RMSNorm.
#include <omp.h>

#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace tansy::cpu {

// Eight independent partial sums: vectorisable without -ffast-math, and a fixed summation order.
float dot(const float* a, const float* b, int64_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float r = 0;
    for (; i < n; i++) r += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + r;
}

void matmul(float* out, const float* in, int64_t T, const matrix& W) {
    const int64_t N = W.rows, K = W.cols;
    // Blocks of output rows: each weight row is dequantised once into a thread-local buffer and reused for all
    // T inputs. Block size balances dequant reuse against load balance across threads.
    constexpr int64_t ROWS = 16;
    const int64_t n_blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel if (N * K * T > (1 << 16))
    {
        std::vector<float> wbuf((size_t)(ROWS * K));
#pragma omp for schedule(dynamic)
        for (int64_t blk = 0; blk < n_blocks; blk++) {
            const int64_t n0 = blk * ROWS, nb = std::min(ROWS, N - n0);
            for (int64_t r = 0; r < nb; r++) W.row_f32(n0 + r, wbuf.data() + r * K);
            for (int64_t t = 0; t < T; t++) {
                const float* x = in + t * K;
                float* y = out + t * N + n0;
                for (int64_t r = 0; r < nb; r++) y[r] = dot(x, wbuf.data() + r * K, K);
            }
        }
    }
}

void rms_norm(float* out, const float* in, int64_t T, int64_t n, const float* w, float eps) {
#pragma omp parallel for schedule(static) if (T * n > (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const float* x = in + t * n;
        float* y = out + t * n;
        const float r = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
    }
}

}  // namespace tansy::cpu
