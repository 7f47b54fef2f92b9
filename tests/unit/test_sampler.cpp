#include <map>

#include "core/check.h"
#include "sampling/sampler.h"
#include "test_util.h"

using namespace tansy;

namespace {

// How often each of the n ids comes out of n_draws draws from the same logits.
std::vector<int> draw_counts(sampler& s, const std::vector<float>& logits, int n_draws) {
    std::vector<int> hits(logits.size(), 0);
    for (int i = 0; i < n_draws; i++) hits[(size_t)s.sample(logits.data(), (int64_t)logits.size())]++;
    return hits;
}

}  // namespace

TEST(sampler, greedy_and_masking) {
    std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f, 9.0f};
    EXPECT_EQ(argmax(l.data(), 5), 4);
    sampler g({}, 0);
    EXPECT_EQ(g.sample(l.data(), 5), 4);
    sampler masked({}, 4);  // id 4 is a padding row
    EXPECT_EQ(masked.sample(l.data(), 5), 1);  // first of the tied maxima
}

TEST(sampler, seeded_and_filtered) {
    auto l = test::random_normal(1000, 5, 3.0f);
    sampling_params p;
    p.temperature = 1.0f, p.seed = 42;
    sampler a(p), b(p);
    for (int i = 0; i < 50; i++) EXPECT_EQ(a.sample(l.data(), 1000), b.sample(l.data(), 1000));
    p.top_k = 1;
    sampler k1(p);
    EXPECT_EQ(k1.sample(l.data(), 1000), argmax(l.data(), 1000));
    p.top_k = 0, p.top_p = 1e-6f;
    sampler p0(p);
    EXPECT_EQ(p0.sample(l.data(), 1000), argmax(l.data(), 1000));
}

TEST(sampler, frequencies_follow_probabilities) {
    // Two tokens with logits differing by ln 3: at temperature 1, a 3:1 split.
    std::vector<float> l = {std::log(3.0f), 0.0f, -1e9f};
    sampling_params p;
    p.temperature = 1.0f, p.seed = 7;
    sampler s(p);
    int n0 = 0;
    const int N = 20000;
    for (int i = 0; i < N; i++) n0 += s.sample(l.data(), 3) == 0;
    EXPECT_NEAR((double)n0 / N, 0.75, 0.015);  // ~5 sigma for N=20000
    p.top_k = 5, p.min_p = 0.5f;  // min_p drops token 1 (p=.25 < .5*.75)
    sampler m(p);
    for (int i = 0; i < 100; i++) EXPECT_EQ(m.sample(l.data(), 3), 0);
}

TEST(sampler, rejects_bad_parameters) {
    sampling_params p;
    p.temperature = -1;
    EXPECT_THROW(sampler{p}, tansy::error);
    p = {}, p.top_p = 0;
    EXPECT_THROW(sampler{p}, tansy::error);
}

// top-p over many near-equal tokens: the descending prefix grows past its first 64 (ties: lower ids first), and
// exactly the prefix is drawn from, uniformly.
TEST(sampler, top_p_prefix_longer_than_the_first_sort) {
    std::vector<float> l(1000, 0.0f);
    sampling_params p;
    p.temperature = 1.0f, p.top_p = 0.5f, p.seed = 11;
    sampler s(p);
    const int N = 20000;
    const std::vector<int> hits = draw_counts(s, l, N);
    for (int i = 500; i < 1000; i++) ASSERT_EQ(hits[(size_t)i], 0) << "token " << i << " is outside the top-p prefix";
    int lo = N, hi = 0;
    for (int i = 0; i < 500; i++) lo = std::min(lo, hits[(size_t)i]), hi = std::max(hi, hits[(size_t)i]);
    EXPECT_GT(lo, 15);  // 40 expected each; Poisson tails over 500 tokens
    EXPECT_LT(hi, 75);
}

// The filters together on a known distribution: probabilities 0.4, 0.3, 0.2, 0.1 (and a token with none):
// top-p 0.75 keeps the first three, renormalised to 4:3:2.
TEST(sampler, filters_renormalise) {
    std::vector<float> l = {std::log(0.2f), std::log(0.4f), std::log(0.1f), std::log(0.3f), -1e30f};
    sampling_params p;
    p.temperature = 1.0f, p.top_p = 0.75f, p.seed = 5;
    sampler s(p);
    const int N = 30000;
    std::vector<int> hits = draw_counts(s, l, N);
    EXPECT_EQ(hits[2], 0);
    EXPECT_EQ(hits[4], 0);
    EXPECT_NEAR(hits[1] / (double)N, 4.0 / 9, 0.015);
    EXPECT_NEAR(hits[3] / (double)N, 3.0 / 9, 0.015);
    EXPECT_NEAR(hits[0] / (double)N, 2.0 / 9, 0.015);
    p.top_p = 1.0f, p.top_k = 2;  // top-k 2: 4:3
    sampler k2(p);
    hits = draw_counts(k2, l, N);
    EXPECT_EQ(hits[0] + hits[2] + hits[4], 0);
    EXPECT_NEAR(hits[1] / (double)N, 4.0 / 7, 0.015);
}

// min-p and top-p together: top-p's mass is measured over the survivors of top-k (not those of min-p), and the
// shorter of the two prefixes wins. Probabilities .4 .2 .2 .1 .1, min-p .3 keeps the first three (p >= .12),
// top-p .7 needs .4 + .2 + .2 of the total: {0, 1, 2} in both the top-k path and the all-tokens path.
TEST(sampler, min_p_and_top_p_together) {
    std::vector<float> l = {std::log(0.4f), std::log(0.2f), std::log(0.2f), std::log(0.1f), std::log(0.1f), -1e30f};
    for (int k : {0, 5}) {
        sampling_params p;
        p.temperature = 1.0f, p.top_k = k, p.min_p = 0.3f, p.top_p = 0.7f, p.seed = 3;
        sampler s(p);
        const int N = 30000;
        const std::vector<int> hits = draw_counts(s, l, N);
        EXPECT_EQ(hits[3] + hits[4] + hits[5], 0) << "top-k " << k;
        EXPECT_NEAR(hits[0] / (double)N, 0.5, 0.015) << "top-k " << k;
        EXPECT_NEAR(hits[1] / (double)N, 0.25, 0.015) << "top-k " << k;
    }
}

// Extreme temperatures: below ~3e-39, 1/T overflows (the limit is an even draw among the tied best); a huge one
// must not let masked (-inf) tokens in.
TEST(sampler, extreme_temperatures) {
    std::vector<float> l = {5.0f, 5.0f, 1.0f};
    sampling_params p;
    p.temperature = 1e-40f, p.seed = 8;
    sampler cold(p);
    int first = 0;
    for (int i = 0; i < 2000; i++) {
        const int32_t id = cold.sample(l.data(), 3);
        ASSERT_NE(id, 2);
        first += id == 0;
    }
    EXPECT_NEAR(first / 2000.0, 0.5, 0.06);
    std::vector<float> masked = {0.0f, -INFINITY, 1.0f};
    p.temperature = 1e37f;
    for (int k : {0, 2}) {
        p.top_k = k;
        sampler hot(p);
        for (int i = 0; i < 500; i++) ASSERT_NE(hot.sample(masked.data(), 3), 1) << "top-k " << k;
    }
}
