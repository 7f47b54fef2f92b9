#include "runtime/step_pacer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace tansy {

namespace {
double ewma(double avg, double x) { return avg + step_pacer::k_alpha * (x - avg); }
}  // namespace

bool step_pacer::fresh(int64_t rows) const { return decode_s_ > 0 && std::llabs(rows - rows_) <= rows_ / 4; }

void step_pacer::decode_step(double seconds, int64_t rows) {
    if (seconds <= 0 || rows <= 0) return;
    if (fresh(rows)) {
        decode_s_ = ewma(decode_s_, seconds);
        return;
    }
    // another batch size: its pieces cost differently too
    *this = step_pacer(ratio_);
    decode_s_ = seconds, rows_ = rows;
}

void step_pacer::mixed_step(double seconds, int64_t rows, int64_t prompt_tokens) {
    if (!fresh(rows) || prompt_tokens <= 0 || seconds <= 0) return;
    // a step no longer than a decode step says little about the tokens: counted as nearly free, never as less
    const double n = (double)prompt_tokens, e = std::max(seconds - decode_s_, 1e-3 * decode_s_);
    if (samples_++ == 0) {
        mn_ = n, me_ = e, mnn_ = n * n, mne_ = n * e;
    } else {
        mn_ = ewma(mn_, n), me_ = ewma(me_, e), mnn_ = ewma(mnn_, n * n), mne_ = ewma(mne_, n * e);
    }
    last_n_ = n, last_e_ = e;
    const double var = mnn_ - mn_ * mn_;
    if (samples_ < 2 || !(var >= k_min_spread * k_min_spread * mn_ * mn_)) return;  // no spread: keep the fit
    const double slope = (mne_ - mn_ * me_) / var;
    if (!(slope > 0) || !std::isfinite(slope)) return;  // noise, or tokens that cost nothing: no fit from these
    token_s_ = slope, fixed_s_ = std::max(0.0, me_ - slope * mn_);
}

int64_t step_pacer::budget(int64_t max_tokens, int64_t rows) const {
    if (!enabled()) return max_tokens;
    if (!fresh(rows)) return 0;
    if (samples_ == 0) return std::min(max_tokens, k_min_piece);
    const double allowance = (ratio_ - 1) * decode_s_;
    double n;
    if (token_s_ > 0) {
        n = std::max((allowance - fixed_s_) / token_s_, fixed_s_ / token_s_);
    } else {
        n = last_n_ * allowance / last_e_;
        if (!(n >= (double)k_min_piece)) n = 2 * last_n_;  // out of reach at the smallest pieces: a second size
    }
    if (!std::isfinite(n) || n >= (double)max_tokens) return max_tokens;
    return std::min(max_tokens, std::max(k_min_piece, (int64_t)n));
}

}  // namespace tansy
