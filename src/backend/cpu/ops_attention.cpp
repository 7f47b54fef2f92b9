// CPU reference: partial rotate-half RoPE (the attention core itself is in cpu_backend.cpp).
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace tansy::cpu {

// u'[j] = u[j] cos - u[j+h] sin, u'[j+h] = u[j+h] cos + u[j] sin, for j < h = rope_dim/2, angle pos * f_j with
// f_j = theta^(-2j/rope_dim). Angles in double: fp32 p*f loses precision at long context. (MODEL.md §3: for
// text, mRoPE's three position rows are equal, so this is plain partial NeoX RoPE.)
void rope_neox(float* u, int64_t rope_dim, int64_t pos, double theta) {
    const int64_t h = rope_dim / 2;
    for (int64_t j = 0; j < h; j++) {
        const double f = std::pow(theta, -2.0 * (double)j / (double)rope_dim);
        const double ang = (double)pos * f;
        const float c = (float)std::cos(ang), s = (float)std::sin(ang);
        const float a = u[j], b = u[j + h];
        u[j] = a * c - b * s;
        u[j + h] = b * c + a * s;
    }
}

}  // namespace tansy::cpu
