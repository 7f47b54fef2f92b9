// Log-probs of the rows the device picks (decode_step's records of their raw logits, backend::logprob_rows)
// against the host path's (scheduler::choose over the downloaded row), through the scheduler on the tiny model.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "runtime/scheduler.h"
#include "runtime/text_engine.h"
#include "scheduler_test_util.h"

namespace tansy {
namespace {

using namespace std::chrono_literals;
using test::collect_sink;
using test::cuda_tiny;
using test::tiny;

// Log-probs of the rows the device picks come from its records of their raw logits (decode_step,
// backend::logprob_rows): the same tokens, log-probs and top log-probs as the host path (device_pick off:
// scheduler::choose over the downloaded row), greedy and seeded, with penalties, bias and a grammar's mask on top
// (the raw logits are kept aside before those adjust them in place), alone and batched, and no logits row comes
// down for them. With `pieces`, the batch prefills its prompts in pieces beside the decoding rows, so first tokens
// are picked from a prompt's last piece in mixed steps.
void expect_device_logprobs_equal_host(text_engine& te, float tol, bool pieces) {
    auto prompt_of = [&](const std::string& user) { return test::user_prompt(te, user); };
    const std::vector<int32_t> p0 = prompt_of("Write a haiku about the sea."), p1 = prompt_of("List three colours.");
    struct variant {
        const std::vector<int32_t>* prompt;
        int logprobs;
        float temperature;
        bool adjust, mask;
    };
    const std::vector<variant> variants = {
        {&p0, 5, 0.0f, false, false},   // greedy: the pick is the top entry
        {&p1, 20, 0.8f, false, false},  // drawn on the device; the most top entries
        {&p0, 0, 0.0f, true, false},    // penalties and bias move the pick, not the log-probs
        {&p1, 3, 0.7f, true, true},     // all of it under a grammar's mask
    };
    auto request = [&](const variant& v, bool device, const std::shared_ptr<collect_sink>& sink) {
        sequence_request r;
        r.prompt = *v.prompt;
        r.max_tokens = 12;
        r.sink = sink;
        r.logprobs = v.logprobs;
        r.sampling.temperature = v.temperature;
        r.sampling.top_k = v.temperature > 0 ? 40 : 0;
        r.sampling.seed = 31;
        if (v.adjust) r.penalties = {0.4f, 0.6f, 1.2f}, r.logit_bias = {{13, 4.0f}, {11, -2.0f}};
        if (v.mask) r.constraint = std::make_unique<test::rotating_constraint>(4);
        r.device_pick = device;
        return r;
    };
    auto expect_same = [&](const std::vector<token_event>& got, const std::vector<token_event>& want,
                           const std::string& what) {
        ASSERT_EQ(got.size(), want.size()) << what;
        for (size_t i = 0; i < got.size(); i++) {
            ASSERT_EQ(got[i].id, want[i].id) << what << ", token " << i;
            EXPECT_NEAR(got[i].logprob, want[i].logprob, tol) << what << ", token " << i;
            ASSERT_EQ(got[i].top.size(), want[i].top.size()) << what << ", token " << i;
            for (size_t j = 0; j < got[i].top.size(); j++) {
                EXPECT_EQ(got[i].top[j].first, want[i].top[j].first) << what << ", token " << i << ", entry " << j;
                EXPECT_NEAR(got[i].top[j].second, want[i].top[j].second, tol) << what << ", token " << i;
            }
        }
    };
    scheduler_options so;
    so.seq_capacity = 256;  // the CUDA backend batches only states of one capacity
    std::vector<std::vector<token_event>> host;
    for (const variant& v : variants) {
        scheduler s(te.eng(), so);
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(v, false, sink)), scheduler::submit_status::ok);
        sink->wait();
        host.push_back(sink->events());
        ASSERT_EQ(host.back().size(), 12u);
        EXPECT_EQ(host.back()[0].top.size(), (size_t)v.logprobs);
        s.shutdown(0ms);
        EXPECT_EQ(s.stats().host_picks, 12u) << "the host path downloads every row";
    }
    EXPECT_FLOAT_EQ(host[0][0].logprob, host[0][0].top[0].second) << "greedy picks the top entry";
    for (size_t i = 0; i < variants.size(); i++) {
        scheduler s(te.eng(), so);
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(variants[i], true, sink)), scheduler::submit_status::ok);
        sink->wait();
        expect_same(sink->events(), host[i], "variant " + std::to_string(i) + " alone");
        s.shutdown(0ms);
        EXPECT_EQ(s.stats().host_picks, 0u) << "variant " << i << ": a logits row came down";
    }
    scheduler_options batched = so;
    if (pieces) batched.prefill_budget = 16;
    scheduler s(te.eng(), batched);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < variants.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        ASSERT_EQ(s.submit(10 + i, request(variants[i], true, sinks.back())), scheduler::submit_status::ok);
    }
    auto plain = std::make_shared<collect_sink>();  // a row without log-probs among them
    sequence_request r = request(variants[0], true, plain);
    r.logprobs = -1;
    ASSERT_EQ(s.submit(99, std::move(r)), scheduler::submit_status::ok);
    for (size_t i = 0; i < variants.size(); i++) {
        sinks[i]->wait();
        expect_same(sinks[i]->events(), host[i], "variant " + std::to_string(i) + " in a batch");
    }
    plain->wait();
    for (const token_event& e : plain->events()) EXPECT_TRUE(e.top.empty());
    s.shutdown(0ms);
    EXPECT_EQ(s.stats().host_picks, 0u) << "a logits row came down in the batch";
}

// The CPU backend's records round a double log-sum-exp to float, where the host path keeps the double: ~1 ulp of
// the log-sum-exp (~1e-6 at the tiny model's magnitudes), with margin.
constexpr float LOGPROB_TOL_CPU = 1e-5f;
// The CUDA records sum e^x in fp32 over the whole vocabulary (~1e-6 relative in the sum, hence in the log-prob),
// where the host path sums the downloaded row in double.
constexpr float LOGPROB_TOL_CUDA = 5e-5f;

TEST(scheduler, device_logprobs_equal_the_host_path) {
    expect_device_logprobs_equal_host(tiny(), LOGPROB_TOL_CPU, true);
}

TEST(scheduler, cuda_device_logprobs_equal_the_host_path) {
    std::string why;
    std::unique_ptr<text_engine> te = cuda_tiny(&why);
    if (!te) GTEST_SKIP() << "no CUDA backend: " << why;
    expect_device_logprobs_equal_host(*te, LOGPROB_TOL_CUDA, false);
}

}  // namespace
}  // namespace tansy
