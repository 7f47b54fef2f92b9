// Paces prompt pieces beside decoding streams: a step that carries decode rows and prompt tokens lasts longer
// than a decode-only step, and that step is a running stream's gap between two tokens. With a ratio R, the
// prompt tokens of such a step are sized so that it lasts about R decode-only steps, from the measured
// durations of recent steps:
//   decode_s   EWMA of decode-only steps at about the current number of decode rows (a quarter more or less;
//              otherwise stale, and the next step carries no prompt tokens: a probe that measures it)
//   token_s    EWMA of the time a prompt token adds to a step that also decodes: (step - decode_s) / tokens
//   budget     (R - 1) x decode_s / token_s, between k_min_piece and the scheduler's prefill budget; k_min_piece
//              until token_s is measured
// The per-token time includes a piece's fixed costs, which weigh more on short pieces; sizing from it converges
// to the piece whose step lasts R decode steps, from below.
#pragma once
#include <cstdint>

namespace tansy {

class step_pacer {
  public:
    // Fewer prompt tokens than this per step cost a forward pass each for little progress: the floor of a budget.
    static constexpr int64_t k_min_piece = 64;
    // Weight of the newest step in the averages: a few steps follow a change of batch size.
    static constexpr double k_alpha = 0.25;

    explicit step_pacer(double ratio = 0) : ratio_(ratio) {}
    bool enabled() const { return ratio_ > 1; }
    void decode_step(double seconds, int64_t rows);                          // `rows` decode rows only
    void mixed_step(double seconds, int64_t rows, int64_t prompt_tokens);  // decode rows and prompt tokens
    // Prompt tokens for the next step that carries `rows` decode rows: at most max_tokens (0: a probe).
    int64_t budget(int64_t max_tokens, int64_t rows) const;
    double decode_s() const { return decode_s_; }
    double token_s() const { return token_s_; }

  private:
    bool fresh(int64_t rows) const;  // decode_s_ was measured at about this many rows
    double ratio_;
    double decode_s_ = 0, token_s_ = 0;  // 0: not measured yet
    int64_t rows_ = 0;                   // the decode rows decode_s_ was measured at
};

}  // namespace tansy
