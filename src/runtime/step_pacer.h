// Paces prompt pieces beside decoding streams: a step that carries decode rows and prompt tokens lasts longer
// than a decode-only step, and that step is a running stream's gap between two tokens. With a ratio R, the
// prompt tokens of such a step are sized so that it lasts about R decode-only steps, from the measured
// durations of recent steps:
//   decode_s   EWMA of decode-only steps at about the current number of decode rows (a quarter more or less;
//              otherwise stale, and the next step carries no prompt tokens: a probe that measures it)
//   piece      what n prompt tokens add to such a step, fitted as fixed_s + token_s n over recent steps of
//              different n (least squares on EWMA moments): on a GPU a piece's fixed cost is large (a prompt
//              piece beside a decode batch reads the experts the batch does not)
//   budget     n with fixed_s + token_s n = (R - 1) decode_s, but never below fixed_s / token_s (a piece's
//              tokens take at least as long as its fixed cost: smaller pieces would halve the prompts' rate for a
//              gap the ratio cannot reach anyway) nor k_min_piece; at most the scheduler's prefill budget
// Before a fit: k_min_piece, then the per-token rule n (R - 1) decode_s / added, or twice the last size when that
// asks for less than k_min_piece (a second size for the fit).
#pragma once
#include <cstdint>

namespace tansy {

class step_pacer {
  public:
    // Fewer prompt tokens than this per step cost a forward pass each for little progress: the floor of a budget.
    static constexpr int64_t k_min_piece = 64;
    // Weight of the newest step in the averages: a few steps follow a change of batch size.
    static constexpr double k_alpha = 0.25;
    // The sizes of recent pieces must spread by this share of their mean for a fit (else timing noise would be
    // fitted).
    static constexpr double k_min_spread = 0.25;

    explicit step_pacer(double ratio = 0) : ratio_(ratio) {}
    bool enabled() const { return ratio_ > 1; }
    void decode_step(double seconds, int64_t rows);                          // `rows` decode rows only
    void mixed_step(double seconds, int64_t rows, int64_t prompt_tokens);  // decode rows and prompt tokens
    // Prompt tokens for the next step that carries `rows` decode rows: at most max_tokens (0: a probe).
    int64_t budget(int64_t max_tokens, int64_t rows) const;
    double decode_s() const { return decode_s_; }
    double fixed_s() const { return fixed_s_; }  // the fit (token_s() == 0: none yet)
    double token_s() const { return token_s_; }

  private:
    bool fresh(int64_t rows) const;  // decode_s_ was measured at about this many rows
    double ratio_;
    double decode_s_ = 0;  // 0: not measured yet
    int64_t rows_ = 0;     // the decode rows decode_s_ was measured at
    // mixed steps since then: EWMA moments of (prompt tokens n, seconds added e), the last one, and the fit
    int samples_ = 0;
    double mn_ = 0, me_ = 0, mnn_ = 0, mne_ = 0, last_n_ = 0, last_e_ = 0;
    double fixed_s_ = 0, token_s_ = 0;
};

}  // namespace tansy
