// CPU reference: MoE routing (softmax, top-k, renormalise). The expert loop is in cpu_backend.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace tansy::cpu {

// MODEL.md §5: p = softmax(logits) in fp32 over all E; top-k by p; w_i = p_i / sum_topk p.
void moe_route(int32_t* idx, float* w, const float* logits, int64_t T, int64_t E, int64_t k) {
    std::vector<float> p((size_t)E);
    std::vector<int32_t> order((size_t)E);
    for (int64_t t = 0; t < T; t++) {
        const float* l = logits + t * E;
        const float mx = *std::max_element(l, l + E);
        float sum = 0;
        for (int64_t e = 0; e < E; e++) sum += p[e] = std::exp(l[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        std::iota(order.begin(), order.end(), 0);
        // Descending probability; ties go to the lower expert id.
        std::partial_sort(order.begin(), order.begin() + k, order.end(),
                          [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        float top = 0;
        for (int64_t j = 0; j < k; j++) top += p[order[j]];
        for (int64_t j = 0; j < k; j++) {
            idx[t * k + j] = order[j];
            w[t * k + j] = p[order[j]] / top;
        }
    }
}

}  // namespace tansy::cpu
