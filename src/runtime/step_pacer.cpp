#include "runtime/step_pacer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace tansy {

namespace {
double ewma(double avg, double x) { return avg > 0 ? avg + step_pacer::k_alpha * (x - avg) : x; }
}  // namespace

bool step_pacer::fresh(int64_t rows) const { return decode_s_ > 0 && std::llabs(rows - rows_) <= rows_ / 4; }

void step_pacer::decode_step(double seconds, int64_t rows) {
    if (seconds <= 0 || rows <= 0) return;
    if (fresh(rows))
        decode_s_ = ewma(decode_s_, seconds);
    else
        decode_s_ = seconds, rows_ = rows;
}

void step_pacer::mixed_step(double seconds, int64_t rows, int64_t prompt_tokens) {
    if (!fresh(rows) || prompt_tokens <= 0 || seconds <= 0) return;
    // a step no longer than a decode step says little about the tokens: counted as nearly free, never as less
    const double per = std::max(seconds - decode_s_, 1e-3 * decode_s_) / (double)prompt_tokens;
    token_s_ = ewma(token_s_, per);
}

int64_t step_pacer::budget(int64_t max_tokens, int64_t rows) const {
    if (!enabled()) return max_tokens;
    if (!fresh(rows)) return 0;
    if (token_s_ <= 0) return std::min(max_tokens, k_min_piece);
    const double n = (ratio_ - 1) * decode_s_ / token_s_;
    if (!std::isfinite(n) || n >= (double)max_tokens) return max_tokens;
    return std::min(max_tokens, std::max(k_min_piece, (int64_t)n));
}

}  // namespace tansy
