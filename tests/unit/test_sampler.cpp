#include <map>

#include "core/check.h"
#include "sampling/sampler.h"
#include "test_util.h"

using namespace tansy;

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
