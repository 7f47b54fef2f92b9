// Logits rows for the log-prob record tests (CPU op and CUDA twin): kinds of rows whose ties, signs, masks and
// magnitudes a record's top list and log-sum-exp must get right.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace tansy::test {

constexpr int k_logprob_row_kinds = 7;

inline std::vector<float> logprob_row(int64_t n, int kind, std::mt19937& rng) {
    std::normal_distribution<float> body(0.0f, 3.0f);
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> l((size_t)n);
    switch (kind) {
        case 0:  // trained-model-like: broad body, a peaked head
            for (float& x : l) x = body(rng);
            for (int i = 0; i < 8; i++) l[rng() % (uint64_t)n] += 12.0f;
            break;
        case 1: {  // 30 ids tied at the top, spread over the row (wider than any list: the lower ids win), then ties
            for (float& x : l) x = body(rng) - 30.0f;
            const int64_t step = std::max<int64_t>(1, n / 31);
            for (int i = 0; i < 30; i++) l[(size_t)((7 + step * i) % n)] = 4.0f;
            for (int i = 0; i < 10; i++) l[(size_t)((5 + 11 * i) % n)] = 2.5f;
            break;
        }
        case 2:  // the top is zeros of both signs: -0 == +0, so they tie and go by id
            for (float& x : l) x = -std::fabs(body(rng)) - 1.0f;
            for (int i = 0; i < 25; i++) l[(size_t)((3 + 4099 * (int64_t)i) % n)] = i % 2 ? -0.0f : 0.0f;
            break;
        case 3:  // -inf (a mask) but for 7 ids: the list ends in -inf entries, by id
            for (float& x : l) x = -inf;
            for (int i = 0; i < 7; i++) l[rng() % (uint64_t)n] = body(rng);
            break;
        case 4:  // every id -inf: log-sum-exp -inf
            for (float& x : l) x = -inf;
            break;
        case 5:  // huge magnitudes (near the float range's end)
            for (float& x : l) x = body(rng) * 1e37f;
            l[(size_t)(n / 2)] = 3e38f;
            l[(size_t)(n / 3)] = -3e38f;
            break;
        case 6:  // tiny magnitudes, subnormals among them: a near-flat distribution
            for (float& x : l) x = body(rng) * 1e-30f;
            for (int i = 0; i < 5; i++) l[rng() % (uint64_t)n] = 1e-40f * (float)(i + 1);
            break;
    }
    return l;
}

}  // namespace tansy::test
