// CPU reference: a row's log-prob record (the CPU twin of backend/cuda/logprobs.cu).
#include <cmath>
#include <limits>

#include "backend/cpu/cpu_ops.h"
#include "core/check.h"
#include "core/dtype.h"
#include "sampling/logprobs.h"

namespace tansy::cpu {

void logprob_record(int32_t* rec, const float* row, int64_t n_valid, int32_t chosen, int top) {
    TANSY_CHECK(top >= 0 && top <= k_max_top_logprobs && chosen >= 0 && chosen < n_valid,
                "logprob_record: top %d, pick %d of %lld ids", top, chosen, (long long)n_valid);
    rec[0] = (int32_t)f32_bits((float)log_sum_exp(row, n_valid));
    rec[1] = (int32_t)f32_bits(row[chosen]);
    const auto best = top_logits(row, n_valid, top);
    for (int i = 0; i < k_max_top_logprobs; i++) {
        const bool has = i < (int)best.size();
        rec[2 + 2 * i] = has ? best[(size_t)i].first : -1;
        rec[3 + 2 * i] = (int32_t)f32_bits(has ? best[(size_t)i].second : -std::numeric_limits<float>::infinity());
    }
}

}  // namespace tansy::cpu
