// CPU reference for Gated DeltaNet: causal conv, the delta rule (recurrent and chunked), gated RMSNorm.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/check.h"

namespace tansy::cpu {

static inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Y_t[c] = SiLU(sum_j w[c][j] X_{t-(K-1)+j}[c]); X before the span comes from `state` (MODEL.md §4.2).
void conv1d_silu(float* y, const float* x, float* state, const float* w, int64_t T, int64_t C, int64_t K) {
    const int64_t P = K - 1;
    // Window = [state (P rows); x (T rows)]; row r of the window is state[r] for r < P, else x[r - P].
    auto win = [&](int64_t r, int64_t c) { return r < P ? state[r * C + c] : x[(r - P) * C + c]; };
#pragma omp parallel for schedule(static) if (T * C > (1 << 15))
    for (int64_t c = 0; c < C; c++) {
        const float* wc = w + c * K;
        for (int64_t t = 0; t < T; t++) {
            float s = 0;
            for (int64_t j = 0; j < K; j++) s += wc[j] * win(t + j, c);
            y[t * C + c] = silu(s);
        }
    }
    // New state: the last P rows of the window.
    std::vector<float> tail((size_t)(P * C));
    for (int64_t r = 0; r < P; r++)
        for (int64_t c = 0; c < C; c++) tail[(size_t)(r * C + c)] = win(T + r, c);
    memcpy(state, tail.data(), tail.size() * sizeof(float));
}

// Per value head h, token t (MODEL.md §4.6; S rows = key dim i, columns = value dim j):
//   1. S <- alpha S            2. u = S^T k            3. delta = beta (v - u)
//   4. S <- S + k delta^T      5. o = S^T q  (with the updated state)
void delta_rule_recurrent(const delta_args& a) {
    const int64_t group = a.Hv / a.Hk, dk = a.dk, dv = a.dv;
#pragma omp parallel for schedule(dynamic)
    for (int64_t h = 0; h < a.Hv; h++) {
        float* S = a.S + h * dk * dv;
        std::vector<float> u((size_t)dv), d((size_t)dv);
        for (int64_t t = 0; t < a.T; t++) {
            const float* q = a.q + (t * a.Hk + h / group) * dk;
            const float* k = a.k + (t * a.Hk + h / group) * dk;
            const float* v = a.v + (t * a.Hv + h) * dv;
            const float alpha = std::exp(a.g[t * a.Hv + h]), beta = a.beta[t * a.Hv + h];
            float* o = a.o + (t * a.Hv + h) * dv;
            std::fill(u.begin(), u.end(), 0.0f);
            for (int64_t i = 0; i < dk; i++) {
                float* Si = S + i * dv;
                for (int64_t j = 0; j < dv; j++) {
                    Si[j] *= alpha;
                    u[j] += Si[j] * k[i];
                }
            }
            for (int64_t j = 0; j < dv; j++) d[j] = beta * (v[j] - u[j]);
            std::fill(o, o + dv, 0.0f);
            for (int64_t i = 0; i < dk; i++) {
                float* Si = S + i * dv;
                for (int64_t j = 0; j < dv; j++) {
                    Si[j] += k[i] * d[j];
                    o[j] += Si[j] * q[i];
                }
            }
        }
    }
}

// Chunk-parallel form (MODEL.md §4.7), per head and chunk of n <= C rows with incoming state S:
//   1. gamma_r = sum_{s<=r} g_s
//   2. L_rs = beta_r (k_r.k_s) e^(gamma_r - gamma_s), s < r
//   3. U = (I+L)^-1 (beta V), W = (I+L)^-1 (beta e^gamma K)         (forward substitution)
//   4. Delta = U - W S
//   5. O = (Q e^gamma) S + A Delta, A_rs = (q_r.k_s) e^(gamma_r - gamma_s), s <= r
//   6. S <- e^gamma_last S + (K e^(gamma_last - gamma))^T Delta
// A partial last chunk simply has n < C rows (zero padding would leave the state unchanged).
void delta_rule_chunked(const delta_args& a, int64_t chunk) {
    const int64_t group = a.Hv / a.Hk, dk = a.dk, dv = a.dv;
#pragma omp parallel for schedule(dynamic)
    for (int64_t h = 0; h < a.Hv; h++) {
        float* S = a.S + h * dk * dv;
        const int64_t C = chunk;
        std::vector<float> gam(C), L(C * C), A(C * C), U(C * dv), Wm(C * dk), D(C * dv), Snew(dk * dv);
        for (int64_t c0 = 0; c0 < a.T; c0 += C) {
            const int64_t n = std::min(C, a.T - c0);
            auto qr = [&](int64_t r) { return a.q + ((c0 + r) * a.Hk + h / group) * dk; };
            auto kr = [&](int64_t r) { return a.k + ((c0 + r) * a.Hk + h / group) * dk; };
            auto vr = [&](int64_t r) { return a.v + ((c0 + r) * a.Hv + h) * dv; };
            auto beta = [&](int64_t r) { return a.beta[(c0 + r) * a.Hv + h]; };
            // 1.
            float acc = 0;
            for (int64_t r = 0; r < n; r++) gam[r] = acc += a.g[(c0 + r) * a.Hv + h];
            // 2. and the intra-chunk attention matrix of step 5
            for (int64_t r = 0; r < n; r++)
                for (int64_t s = 0; s <= r; s++) {
                    const float decay = std::exp(gam[r] - gam[s]);
                    L[r * C + s] = s < r ? beta(r) * dot(kr(r), kr(s), dk) * decay : 0.0f;
                    A[r * C + s] = dot(qr(r), kr(s), dk) * decay;
                }
            // 3. row r: X_r = R_r - sum_{s<r} L_rs X_s
            for (int64_t r = 0; r < n; r++) {
                float* u = &U[r * dv];
                float* w = &Wm[r * dk];
                const float br = beta(r), bg = br * std::exp(gam[r]);
                for (int64_t j = 0; j < dv; j++) u[j] = br * vr(r)[j];
                for (int64_t i = 0; i < dk; i++) w[i] = bg * kr(r)[i];
                for (int64_t s = 0; s < r; s++) {
                    const float l = L[r * C + s];
                    for (int64_t j = 0; j < dv; j++) u[j] -= l * U[s * dv + j];
                    for (int64_t i = 0; i < dk; i++) w[i] -= l * Wm[s * dk + i];
                }
            }
            // 4. Delta = U - W S
            for (int64_t r = 0; r < n; r++) {
                float* d = &D[r * dv];
                for (int64_t j = 0; j < dv; j++) d[j] = U[r * dv + j];
                for (int64_t i = 0; i < dk; i++) {
                    const float wi = Wm[r * dk + i];
                    const float* Si = S + i * dv;
                    for (int64_t j = 0; j < dv; j++) d[j] -= wi * Si[j];
                }
            }
            // 5. O = (Q e^gamma) S + A Delta
            for (int64_t r = 0; r < n; r++) {
                float* o = a.o + ((c0 + r) * a.Hv + h) * dv;
                std::fill(o, o + dv, 0.0f);
                const float eg = std::exp(gam[r]);
                const float* q = qr(r);
                for (int64_t i = 0; i < dk; i++) {
                    const float qi = q[i] * eg;
                    const float* Si = S + i * dv;
                    for (int64_t j = 0; j < dv; j++) o[j] += qi * Si[j];
                }
                for (int64_t s = 0; s <= r; s++) {
                    const float as = A[r * C + s];
                    for (int64_t j = 0; j < dv; j++) o[j] += as * D[s * dv + j];
                }
            }
            // 6. S <- e^gamma_last S + sum_r (k_r e^(gamma_last - gamma_r)) Delta_r^T
            const float glast = gam[n - 1], el = std::exp(glast);
            for (int64_t i = 0; i < dk * dv; i++) Snew[i] = el * S[i];
            for (int64_t r = 0; r < n; r++) {
                const float e = std::exp(glast - gam[r]);
                const float* k = kr(r);
                for (int64_t i = 0; i < dk; i++) {
                    const float ki = k[i] * e;
                    float* Si = &Snew[i * dv];
                    for (int64_t j = 0; j < dv; j++) Si[j] += ki * D[r * dv + j];
                }
            }
            memcpy(S, Snew.data(), sizeof(float) * dk * dv);
        }
    }
}

// MODEL.md §2 variant 2: normalise first, plain weight, then the SiLU(z) gate.
void gated_rms_norm(float* y, const float* o, const float* z, const float* w, int64_t T, int64_t Hv, int64_t dv,
                    float eps) {
    for (int64_t r = 0; r < T * Hv; r++) {
        const float* x = o + r * dv;
        const float* zz = z + r * dv;
        float* out = y + r * dv;
        const float inv = 1.0f / std::sqrt(dot(x, x, dv) / (float)dv + eps);
        for (int64_t j = 0; j < dv; j++) out[j] = x[j] * inv * w[j] * silu(zz[j]);
    }
}

}  // namespace tansy::cpu
