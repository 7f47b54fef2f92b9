#include "sampling/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/dtype.h"

namespace tansy {

double log_sum_exp(const float* row, int64_t n) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; i++) mx = std::max(mx, (double)row[i]);
    if (mx == -std::numeric_limits<double>::infinity()) return mx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += std::exp((double)row[i] - mx);
    return mx + std::log(sum);
}

std::vector<std::pair<int32_t, float>> top_logits(const float* row, int64_t n, int k) {
    std::vector<std::pair<int32_t, float>> top;
    const size_t want = (size_t)std::max<int64_t>(0, std::min<int64_t>(k, n));
    if (want == 0) return top;
    top.reserve(want + 1);
    // ids come in ascending order, so an id equal to the last kept one ranks after it: only a larger logit enters
    // a full list, and it goes after every kept logit that is at least as large
    for (int64_t i = 0; i < n; i++) {
        const float x = row[i];
        if (top.size() == want && !(x > top.back().second)) continue;
        auto at = std::find_if(top.begin(), top.end(), [&](const auto& e) { return x > e.second; });
        top.insert(at, {(int32_t)i, x});
        if (top.size() > want) top.pop_back();
    }
    return top;
}

void read_logprob_record(const int32_t* rec, int n, float* logprob, std::vector<std::pair<int32_t, float>>* top) {
    const double lse = f32_from_bits((uint32_t)rec[0]);
    *logprob = (float)((double)f32_from_bits((uint32_t)rec[1]) - lse);
    top->clear();
    for (int i = 0; i < std::min(n, k_max_top_logprobs); i++) {
        const int32_t id = rec[2 + 2 * i];
        if (id < 0) break;
        top->emplace_back(id, (float)((double)f32_from_bits((uint32_t)rec[3 + 2 * i]) - lse));
    }
}

}  // namespace tansy
