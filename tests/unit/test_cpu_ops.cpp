// The CPU reference ops on their own, with fresh random inputs and awkward shapes.
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_ops.h"
#include "test_util.h"

using namespace tansy;

namespace {

// Chunked and recurrent delta rules are the same math in a different order of fp32 operations; over a few
// hundred tokens they agree to ~1e-6 relative. 1e-5 leaves room without hiding a wrong term (a missing decay
// or diagonal term shows up at 1e-2 or worse).
constexpr double TOL_DELTA_RULE = 1e-5;
// fp32 dequantisation of affine weights: scale*q is exact, +bias rounds once.
constexpr float TOL_DEQUANT_REL = 1e-6f;

void l2_normalise_rows(std::vector<float>& x, int64_t d, float scale) {
    for (size_t r = 0; r < x.size() / d; r++) {
        double s = 0;
        for (int64_t i = 0; i < d; i++) s += (double)x[r * d + i] * x[r * d + i];
        const float inv = (float)(1.0 / std::sqrt(s + 1e-6)) * scale;
        for (int64_t i = 0; i < d; i++) x[r * d + i] *= inv;
    }
}

struct delta_inputs {
    std::vector<float> q, k, v, beta, g, S;
};

delta_inputs make_delta_inputs(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, uint32_t seed) {
    delta_inputs d;
    d.q = test::random_normal((size_t)(T * Hk * dk), seed);
    d.k = test::random_normal((size_t)(T * Hk * dk), seed + 1);
    l2_normalise_rows(d.q, dk, 1.0f / std::sqrt((float)dk));
    l2_normalise_rows(d.k, dk, 1.0f);
    d.v = test::random_normal((size_t)(T * Hv * dv), seed + 2);
    d.beta = test::random_uniform((size_t)(T * Hv), seed + 3, 0.0f, 1.0f);
    d.g = test::random_uniform((size_t)(T * Hv), seed + 4, -2.0f, 0.0f);  // decays in (e^-2, 1]
    d.S = test::random_normal((size_t)(Hv * dk * dv), seed + 5, 0.1f);     // a prefix already processed
    return d;
}

}  // namespace

class delta_rule_test : public ::testing::TestWithParam<int64_t> {};

TEST_P(delta_rule_test, chunked_equals_recurrent) {
    const int64_t T = GetParam(), Hk = 2, Hv = 4, dk = 16, dv = 24;
    delta_inputs in = make_delta_inputs(T, Hk, Hv, dk, dv, 100 + (uint32_t)T);
    std::vector<float> S1 = in.S, S2 = in.S, o1((size_t)(T * Hv * dv)), o2(o1.size());
    cpu::delta_rule_recurrent({in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S1.data(), o1.data(), T, Hk, Hv, dk, dv});
    cpu::delta_rule_chunked({in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S2.data(), o2.data(), T, Hk, Hv, dk, dv});
    EXPECT_LT(test::rel_error(o2, o1), TOL_DELTA_RULE);
    EXPECT_LT(test::rel_error(S2, S1), TOL_DELTA_RULE);
}

TEST_P(delta_rule_test, chunked_in_pieces_equals_whole) {
    // Prefill continuing from a state: splitting the sequence anywhere gives the same result.
    const int64_t T = GetParam(), Hk = 1, Hv = 2, dk = 8, dv = 8, cut = T / 3;
    delta_inputs in = make_delta_inputs(T, Hk, Hv, dk, dv, 7 + (uint32_t)T);
    std::vector<float> S1 = in.S, S2 = in.S, o1((size_t)(T * Hv * dv)), o2(o1.size());
    cpu::delta_rule_chunked({in.q.data(), in.k.data(), in.v.data(), in.beta.data(), in.g.data(), S1.data(), o1.data(), T, Hk, Hv, dk, dv});
    for (auto [t0, n] : {std::pair<int64_t, int64_t>{0, cut}, {cut, T - cut}}) {
        if (n == 0) continue;
        cpu::delta_rule_chunked({in.q.data() + t0 * Hk * dk, in.k.data() + t0 * Hk * dk, in.v.data() + t0 * Hv * dv,
                                 in.beta.data() + t0 * Hv, in.g.data() + t0 * Hv, S2.data(), o2.data() + t0 * Hv * dv,
                                 n, Hk, Hv, dk, dv});
    }
    EXPECT_LT(test::rel_error(o2, o1), TOL_DELTA_RULE);
    EXPECT_LT(test::rel_error(S2, S1), TOL_DELTA_RULE);
}

INSTANTIATE_TEST_SUITE_P(lengths, delta_rule_test, ::testing::Values(1, 2, 7, 63, 64, 65, 130, 201));

TEST(delta_rule, single_token_matches_hand_computation) {
    // T=1, one head, dk=dv=2: S' = a S + k (b (v - a S^T k))^T, o = S'^T q.
    const float q[2] = {0.6f, 0.8f}, k[2] = {1.0f, 0.0f}, v[2] = {2.0f, -1.0f}, beta = 0.5f, g = std::log(0.5f);
    float S[4] = {1, 2, 3, 4}, o[2];
    cpu::delta_rule_recurrent({q, k, v, &beta, &g, S, o, 1, 1, 1, 2, 2});
    // a S = [[.5,1],[1.5,2]]; u = (aS)^T k = [.5, 1]; delta = .5([2,-1]-[.5,1]) = [.75,-1]
    // S' = [[1.25, 0],[1.5, 2]]; o = S'^T q = [.75 + 1.2, 0 + 1.6]
    EXPECT_FLOAT_EQ(S[0], 1.25f);
    EXPECT_FLOAT_EQ(S[1], 0.0f);
    EXPECT_FLOAT_EQ(o[0], 1.95f);
    EXPECT_FLOAT_EQ(o[1], 1.6f);
}

TEST(conv1d, streaming_equals_whole_and_matches_definition) {
    const int64_t T = 37, C = 11, K = 4;
    auto x = test::random_normal((size_t)(T * C), 3), w = test::random_normal((size_t)(C * K), 4);
    std::vector<float> st0 = test::random_normal((size_t)((K - 1) * C), 5);
    std::vector<float> y1((size_t)(T * C)), y2((size_t)(T * C)), s1 = st0, s2 = st0;
    cpu::conv1d_silu(y1.data(), x.data(), s1.data(), w.data(), T, C, K);
    for (int64_t t = 0; t < T; t++)  // one token at a time, as decode does
        cpu::conv1d_silu(y2.data() + t * C, x.data() + t * C, s2.data(), w.data(), 1, C, K);
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(s1, s2);
    for (int64_t r = 0; r < K - 1; r++)  // state holds the last K-1 raw inputs
        for (int64_t c = 0; c < C; c++) EXPECT_EQ(s1[r * C + c], x[(T - (K - 1) + r) * C + c]);
    // y_t[c] = silu(sum_j w[c][j] X_{t-3+j}[c]) at t = 1: taps 0,1 read the initial state rows 1,2
    const int64_t t = 1, c = 5;
    float s = w[c * K + 0] * st0[1 * C + c] + w[c * K + 1] * st0[2 * C + c] + w[c * K + 2] * x[0 * C + c] +
              w[c * K + 3] * x[1 * C + c];
    EXPECT_NEAR(y1[t * C + c], s / (1 + std::exp(-s)), 1e-6);
}

TEST(moe_route, top_k_softmax_renormalised) {
    const int64_t T = 5, E = 16, k = 8;
    auto logits = test::random_normal((size_t)(T * E), 9, 2.0f);
    logits[0] = logits[1] = 10.0f;  // a tie: the lower id comes first
    std::vector<int32_t> idx((size_t)(T * k));
    std::vector<float> w((size_t)(T * k));
    cpu::moe_route(idx.data(), w.data(), logits.data(), T, E, k);
    EXPECT_EQ(idx[0], 0);
    EXPECT_EQ(idx[1], 1);
    for (int64_t t = 0; t < T; t++) {
        float sum = 0;
        for (int64_t j = 0; j < k; j++) {
            sum += w[t * k + j];
            if (j) {
                EXPECT_GE(w[t * k + j - 1], w[t * k + j]);
            }
        }
        EXPECT_NEAR(sum, 1.0f, 1e-6);
        // the chosen experts are the k largest logits; weight ratio = exp(logit difference)
        std::vector<float> sorted(logits.begin() + t * E, logits.begin() + (t + 1) * E);
        std::sort(sorted.rbegin(), sorted.rend());
        EXPECT_EQ(logits[t * E + idx[t * k + k - 1]], sorted[k - 1]);
        EXPECT_NEAR(w[t * k] / w[t * k + 1], std::exp(logits[t * E + idx[t * k]] - logits[t * E + idx[t * k + 1]]), 1e-4);
    }
}

class affine_test : public ::testing::TestWithParam<int> {};

TEST_P(affine_test, dequant_and_matmul_match_definition) {
    // MODEL.md §11.2: value c at bit (c*bits)%32 of word (c*bits)/32, w = scale*q + bias per group of 64.
    const int bits = GetParam();
    const int64_t rows = 7, cols = 192, group = 64, per = 32 / bits, G = cols / group;
    std::mt19937 rng(11);
    std::vector<uint32_t> q((size_t)(rows * cols)), packed((size_t)(rows * cols / per), 0);
    for (size_t i = 0; i < q.size(); i++) q[i] = rng() & ((1u << bits) - 1);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) packed[(size_t)(r * cols / per + c / per)] |= q[(size_t)(r * cols + c)] << (bits * (c % per));
    std::vector<uint16_t> sc((size_t)(rows * G)), bi((size_t)(rows * G));
    auto s = test::random_uniform(sc.size(), 12, 0.001f, 0.1f), b = test::random_uniform(bi.size(), 13, -0.5f, 0.5f);
    for (size_t i = 0; i < sc.size(); i++) sc[i] = f32_to_bf16(s[i]), bi[i] = f32_to_bf16(b[i]);
    matrix m;
    m.fmt = wfmt::affine, m.type = dtype::bf16, m.rows = rows, m.cols = cols, m.bits = bits, m.group = (int)group;
    m.w = (const uint8_t*)packed.data(), m.scales = (const uint8_t*)sc.data(), m.biases = (const uint8_t*)bi.data();
    std::vector<float> dense((size_t)(rows * cols));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dense[(size_t)(r * cols + c)] = (float)((double)bf16_to_f32(sc[(size_t)(r * G + c / group)]) * q[(size_t)(r * cols + c)] +
                                                   bf16_to_f32(bi[(size_t)(r * G + c / group)]));
    std::vector<float> row((size_t)cols);
    for (int64_t r = 0; r < rows; r++) {
        m.row_f32(r, row.data());
        for (int64_t c = 0; c < cols; c++) EXPECT_NEAR(row[c], dense[r * cols + c], TOL_DEQUANT_REL * (1 + std::fabs(dense[r * cols + c])));
    }
    // matmul over an odd number of tokens against a plain double-precision product
    const int64_t T = 5;
    auto x = test::random_normal((size_t)(T * cols), 14);
    std::vector<float> y((size_t)(T * rows));
    cpu::matmul(y.data(), x.data(), T, m);
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double acc = 0;
            for (int64_t c = 0; c < cols; c++) acc += (double)x[t * cols + c] * dense[r * cols + c];
            EXPECT_NEAR(y[t * rows + r], acc, 1e-4 * (1 + std::fabs(acc)));
        }
    // a row view of the stacked tensor addresses the same rows
    matrix sub = m.rows_view(3, 2);
    sub.row_f32(1, row.data());
    EXPECT_NEAR(row[5], dense[4 * cols + 5], TOL_DEQUANT_REL * (1 + std::fabs(dense[4 * cols + 5])));
}

INSTANTIATE_TEST_SUITE_P(bits, affine_test, ::testing::Values(2, 4, 8));

TEST(rope, rotates_pairs_and_preserves_norm) {
    auto u = test::random_normal(32, 21);
    auto v = u;
    cpu::rope_neox(v.data(), 16, 0, 1e7);
    EXPECT_EQ(u, v);  // position 0: identity
    cpu::rope_neox(v.data(), 16, 12345, 1e7);
    for (int i = 16; i < 32; i++) EXPECT_EQ(u[i], v[i]);  // beyond rope_dim untouched
    double n0 = 0, n1 = 0;
    for (int j = 0; j < 8; j++) {
        n0 = (double)u[j] * u[j] + (double)u[j + 8] * u[j + 8];
        n1 = (double)v[j] * v[j] + (double)v[j + 8] * v[j + 8];
        EXPECT_NEAR(n0, n1, 1e-5 * (1 + n0));
    }
    // frequency 0 rotates by exactly pos radians
    auto w = std::vector<float>(16, 0.0f);
    w[0] = 1.0f;
    cpu::rope_neox(w.data(), 16, 1, 1e7);
    EXPECT_NEAR(w[0], std::cos(1.0), 1e-6);
    EXPECT_NEAR(w[8], std::sin(1.0), 1e-6);
}

TEST(rms_norm, matches_definition) {
    const int64_t T = 3, n = 37;
    auto x = test::random_normal((size_t)(T * n), 31), w = test::random_normal((size_t)n, 32);
    std::vector<float> y((size_t)(T * n));
    cpu::rms_norm(y.data(), x.data(), T, n, w.data(), 1e-6f);
    for (int64_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[t * n + i] * x[t * n + i];
        const double r = 1.0 / std::sqrt(ss / n + 1e-6);
        for (int64_t i = 0; i < n; i++) EXPECT_NEAR(y[t * n + i], x[t * n + i] * r * w[i], 1e-5);
    }
}
