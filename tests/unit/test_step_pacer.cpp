// step_pacer (runtime/step_pacer.h): the prompt tokens of a step beside decoding streams, sized from measured
// step times; and the scheduler with --prefill-pace: a long prompt arriving beside a decoding stream is
// prefilled in many short pieces, each in a step that also decodes the stream, with outputs unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "runtime/scheduler.h"
#include "runtime/step_pacer.h"
#include "scheduler_test_util.h"

namespace tansy {
namespace {

using test::collect_sink;
using test::tiny;

// A step of `rows` decode rows and n prompt tokens lasts d + a + b n seconds (a piece's fixed cost a, b per
// token): what the pacer is fed in place of a device.
struct step_model {
    double d, a, b;
    double operator()(int64_t n) const { return n > 0 ? d + a + b * (double)n : d; }
};

// Runs the pacer against the model as the scheduler would: a probe where it asks for one, else its budget.
int64_t settle(step_pacer& p, const step_model& m, int64_t rows, int steps, int64_t max_tokens) {
    int64_t n = 0;
    for (int i = 0; i < steps; i++) {
        n = p.budget(max_tokens, rows);
        if (n == 0)
            p.decode_step(m(0), rows);
        else
            p.mixed_step(m(n), rows, n);
    }
    return n;
}

// Without the pacer a step beside decoding streams is filled to the budget's rows: decode rows count against it,
// down to a quarter of it left for prompts, never less than one token.
TEST(step_pacer, prompt_tokens_fill_the_step_to_the_budget) {
    EXPECT_EQ(prompt_tokens_beside(2048, 1), 2047);
    EXPECT_EQ(prompt_tokens_beside(2048, 64), 1984);
    EXPECT_EQ(prompt_tokens_beside(2048, 256), 1792);
    EXPECT_EQ(prompt_tokens_beside(2048, 1536), 512);
    EXPECT_EQ(prompt_tokens_beside(2048, 5000), 512);  // more streams than the budget: a quarter still
    EXPECT_EQ(prompt_tokens_beside(8, 1), 7);
    EXPECT_EQ(prompt_tokens_beside(3, 3), 1);
    EXPECT_EQ(prompt_tokens_beside(1, 40), 1);
}

TEST(step_pacer, off_or_unmeasured_gives_the_budget_or_a_probe) {
    step_pacer off;
    EXPECT_EQ(off.budget(2048, 4), 2048);
    step_pacer p(3);
    EXPECT_EQ(p.budget(2048, 4), 0) << "no decode step measured: a probe";
    p.decode_step(0.010, 4);
    EXPECT_EQ(p.budget(2048, 4), step_pacer::k_min_piece) << "no prompt token measured: start small";
    EXPECT_EQ(p.budget(32, 4), 32);
    EXPECT_EQ(p.budget(2048, 5), step_pacer::k_min_piece) << "a quarter more rows: still fresh";
    EXPECT_EQ(p.budget(2048, 6), 0) << "half as many rows again: measure them first";
}

TEST(step_pacer, converges_to_steps_of_the_ratio) {
    for (const double ratio : {1.5, 2.0, 3.0, 5.0}) {
        const step_model m{0.010, 0.002, 20e-6};  // 10 ms decode, 2 ms a piece, 20 us a token
        step_pacer p(ratio);
        const int64_t n = settle(p, m, 16, 60, 1 << 20);
        // the piece whose step lasts ratio x d: a + b n = (ratio - 1) d
        const double want = ((ratio - 1) * m.d - m.a) / m.b;
        EXPECT_NEAR((double)n, want, 0.05 * want + 1) << "ratio " << ratio;
        EXPECT_NEAR(m(n) / m.d, ratio, 0.05 * ratio) << "ratio " << ratio;
    }
}

TEST(step_pacer, bounds_and_a_new_batch_size) {
    // a piece's fixed cost far above the allowance and tokens nearly free: the ratio is out of reach, and pieces
    // as long as their fixed cost (here past the scheduler's budget) keep the prompts at their rate
    step_pacer slow(2);
    EXPECT_EQ(settle(slow, {0.010, 0.050, 1e-6}, 8, 30, 2048), 2048);
    // cheap tokens: the scheduler's budget caps it
    step_pacer fast(3);
    EXPECT_EQ(settle(fast, {0.010, 0.0, 1e-9}, 8, 30, 2048), 2048);
    // the batch grows from 8 to 64 rows, whose steps take 4x as long: a probe, then pieces ~4x as large
    step_pacer p(3);
    const int64_t n8 = settle(p, {0.010, 0.001, 20e-6}, 8, 60, 1 << 20);
    EXPECT_EQ(p.budget(1 << 20, 64), 0);
    const int64_t n64 = settle(p, {0.040, 0.001, 20e-6}, 64, 60, 1 << 20);
    EXPECT_NEAR((double)n64 / (double)n8, (0.080 - 0.001) / (0.020 - 0.001), 0.3);
}

// As measured on the H100 beside 16 decoding streams (7.9 ms steps): a prompt piece adds ~21 ms of fixed cost
// (the experts the decode rows do not touch) and ~42 us a token. At ratio 3 the allowance (15.8 ms) is below the
// fixed cost: the pacer must not shrink the pieces to k_min_piece (each step then spends 21 ms for 64 tokens:
// prompts at a tenth of their rate), but keep them as long as their fixed cost (~500 tokens). At ratio 12 the
// target is in reach: (11 x 7.9 - 21) / 0.042 = 1,569 tokens.
TEST(step_pacer, a_large_fixed_cost_per_piece) {
    const step_model m{0.0079, 0.021, 42e-6};
    step_pacer p3(3);
    const int64_t n3 = settle(p3, m, 16, 40, 2048);
    EXPECT_NEAR((double)n3, m.a / m.b, 0.05 * m.a / m.b);
    EXPECT_NEAR(p3.fixed_s(), m.a, 1e-3 * m.a);
    EXPECT_NEAR(p3.token_s(), m.b, 1e-3 * m.b);
    step_pacer p12(12);
    const double want = (11 * m.d - m.a) / m.b;
    EXPECT_NEAR((double)settle(p12, m, 16, 40, 2048), want, 0.05 * want);
    // step times off by up to 5% either way (a device's jitter): the pieces stay near the noise-free size
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> jitter(0.95, 1.05);
    step_pacer pn(3);
    int64_t lo = 1 << 30, hi = 0;
    for (int i = 0; i < 200; i++) {
        const int64_t n = pn.budget(2048, 16);
        if (n == 0)
            pn.decode_step(m(0) * jitter(rng), 16);
        else
            pn.mixed_step(m(n) * jitter(rng), 16, n);
        if (i >= 20) lo = std::min(lo, n), hi = std::max(hi, n);
    }
    EXPECT_GE((double)lo, 0.6 * m.a / m.b) << "never near the k_min_piece collapse";
    EXPECT_LE((double)hi, 1.6 * m.a / m.b);
}

TEST(step_pacer, odd_measurements_keep_it_finite) {
    step_pacer p(3);
    p.decode_step(0.0, 4);  // ignored
    p.decode_step(-1.0, 4);
    EXPECT_EQ(p.budget(2048, 4), 0);
    p.decode_step(0.010, 4);
    p.mixed_step(0.005, 4, 100);  // shorter than a decode step: tokens counted as nearly free
    const int64_t n = p.budget(2048, 4);
    EXPECT_GE(n, step_pacer::k_min_piece);
    EXPECT_LE(n, 2048);
    p.mixed_step(1e9, 4, 1);  // a huge step: the floor
    EXPECT_EQ(p.budget(2048, 4), step_pacer::k_min_piece);
}

// The scheduler with prefill_pace: a 600-token prompt arriving beside a decoding stream goes in pieces of about
// k_min_piece tokens on the CPU (a prompt token costs there about what a decode step does), each step decoding
// the stream too; without pacing it goes in one step (prefill_budget 2048). Outputs are those of generate().
TEST(step_pacer, scheduler_paces_a_long_prompt_beside_a_stream) {
    std::vector<int32_t> pb;
    for (int i = 0; i < 600; i++) pb.push_back(100 + (i * 37) % 3000);
    const std::vector<int32_t> pa = test::user_prompt(tiny(), "Hi");
    // the requests below set no stop ids: neither does the reference
    const std::vector<int32_t> ra = test::greedy_reference(tiny(), pa, 60, {}),
                               rb = test::greedy_reference(tiny(), pb, 3, {});
    for (const double pace : {0.0, 3.0}) {
        scheduler_options so;
        so.prefill_pace = pace;
        scheduler s(tiny().eng(), so);
        auto a = std::make_shared<collect_sink>(), b = std::make_shared<collect_sink>();
        sequence_request ra_req, rb_req;
        ra_req.prompt = pa, ra_req.max_tokens = 60, ra_req.sink = a;
        rb_req.prompt = pb, rb_req.max_tokens = 3, rb_req.sink = b;
        ASSERT_EQ(s.submit(1, std::move(ra_req)), scheduler::submit_status::ok);
        a->wait_tokens(4);  // decode-only steps measured
        const auto tb = sched_clock::now();
        ASSERT_EQ(s.submit(2, std::move(rb_req)), scheduler::submit_status::ok);
        b->wait();
        a->wait();
        EXPECT_EQ(a->ids(), ra) << "pace " << pace;
        EXPECT_EQ(b->ids(), rb) << "pace " << pace;
        ASSERT_FALSE(b->events().empty());
        const auto b_first = b->events().front().t;
        int between = 0;
        for (const token_event& e : a->events()) between += e.t > tb && e.t < b_first;
        printf("[ pace %.0f ] %d of the stream's tokens came while the 600-token prompt was prefilled\n", pace, between);
        if (pace == 0) EXPECT_LE(between, 3) << "one step carries the whole prompt";
        else EXPECT_GE(between, 5) << "the prompt in pieces, the stream decoding beside each";
    }
}

}  // namespace
}  // namespace tansy
