// scheduler: continuous batching on the embedded tiny model (CPU backend). The batched path must give a lone
// greedy request exactly engine::generate's tokens, batch rows must not leak into each other, and cancelled or
// finished sequences must free their state at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "runtime/scheduler.h"
#include "runtime/text_engine.h"
#include "scheduler_test_util.h"

namespace tansy {
namespace {

using namespace std::chrono_literals;

using test::collect_sink;
using test::cuda_tiny;
using test::tiny;

std::vector<int32_t> chat_prompt(const std::string& user) { return test::user_prompt(tiny(), user); }

std::vector<int32_t> reference_greedy(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    return test::greedy_reference(tiny(), prompt, max_tokens, tiny().eos());
}

sequence_request make_request(const std::vector<int32_t>& prompt, int64_t max_tokens,
                              const std::shared_ptr<collect_sink>& sink) {
    sequence_request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.stop_ids = tiny().eos();
    r.sink = sink;
    return r;
}

TEST(scheduler, lone_greedy_request_equals_engine_generate) {
    // a short prompt: this also runs under ASan, where prefill is ~40x slower (the e2e test `server.greedy`
    // compares the long tool prompt against `tansy run`)
    const std::vector<int32_t> prompt = chat_prompt("What does heapq.heappush do?");
    const std::vector<int32_t> ref = reference_greedy(prompt, 24);
    ASSERT_GT(ref.size(), 10u);
    scheduler s(tiny().eng(), scheduler_options{});
    auto sink = std::make_shared<collect_sink>();
    ASSERT_EQ(s.submit(1, make_request(prompt, 24, sink)), scheduler::submit_status::ok);
    const finish_event f = sink->wait();
    EXPECT_EQ(sink->ids(), ref);
    EXPECT_EQ(f.reason, ref.size() < 24 ? finish_reason::stop : finish_reason::length);
    EXPECT_EQ(f.prompt_tokens, (int64_t)prompt.size());
    EXPECT_EQ(f.generated, (int64_t)ref.size());
}

// OpenAI logit_bias: added to the logits before the choice, so greedy rows take the argmax of the biased row.
TEST(scheduler, logit_bias_moves_the_greedy_choice) {
    const std::vector<int32_t> prompt = chat_prompt("Name a colour.");
    const std::vector<int32_t> ref = reference_greedy(prompt, 3);
    ASSERT_EQ(ref.size(), 3u);
    scheduler s(tiny().eng(), scheduler_options{});
    // +100 on a token the model would not pick makes it the choice at every step
    const int32_t forced = ref[0] == 1000 ? 1001 : 1000;
    auto up = std::make_shared<collect_sink>();
    sequence_request r = make_request(prompt, 3, up);
    r.logit_bias = {{forced, 100.0f}};
    ASSERT_EQ(s.submit(1, std::move(r)), scheduler::submit_status::ok);
    up->wait();
    EXPECT_EQ(up->ids(), std::vector<int32_t>(3, forced));
    // -100 on the greedy token changes the first choice
    auto down = std::make_shared<collect_sink>();
    r = make_request(prompt, 1, down);
    r.logit_bias = {{ref[0], -100.0f}};
    ASSERT_EQ(s.submit(2, std::move(r)), scheduler::submit_status::ok);
    down->wait();
    ASSERT_EQ(down->ids().size(), 1u);
    EXPECT_NE(down->ids()[0], ref[0]);
    // a bias of 0 changes nothing
    auto zero = std::make_shared<collect_sink>();
    r = make_request(prompt, 3, zero);
    r.logit_bias = {{forced, 0.0f}};
    ASSERT_EQ(s.submit(3, std::move(r)), scheduler::submit_status::ok);
    zero->wait();
    EXPECT_EQ(zero->ids(), ref);
}

TEST(scheduler, prompts_prefilled_in_chunks_give_the_same_tokens) {
    // the engine's prefill chunk applies to the scheduler's prefill too (forward_pass::prefill)
    const std::vector<int32_t> prompt = chat_prompt("What does heapq.heappush do?");
    const std::vector<int32_t> ref = reference_greedy(prompt, 12);
    forward_pass& fw = tiny().eng().fwd();
    const int64_t saved = fw.prefill_chunk;
    fw.prefill_chunk = 5;
    ASSERT_GT(prompt.size(), 2 * 5u);
    {
        scheduler s(tiny().eng(), scheduler_options{});
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, make_request(prompt, 12, sink)), scheduler::submit_status::ok);
        sink->wait();
        EXPECT_EQ(sink->ids(), ref);
    }
    fw.prefill_chunk = saved;
}

// A long prompt is prefilled a chunk per step: the sequence already decoding gets tokens between its chunks, and
// both give the tokens they give alone.
TEST(scheduler, long_prompts_interleave_with_decoding) {
    forward_pass& fw = tiny().eng().fwd();
    const int64_t saved = fw.prefill_chunk;
    fw.prefill_chunk = 8;
    const std::vector<int32_t> pa = chat_prompt("Hi"), pb = chat_prompt(
        "Explain in detail how Python's heapq module keeps the heap invariant when items are pushed and popped, "
        "with an example, and say what happens to the heap when the same item is pushed twice or the list is sorted.");
    ASSERT_GT(pb.size(), 6 * 8u);
    const std::vector<int32_t> ra = reference_greedy(pa, 40), rb = reference_greedy(pb, 4);
    {
        scheduler_options so;
        so.prefill_budget = 8;
        scheduler s(tiny().eng(), so);
        auto a = std::make_shared<collect_sink>(), b = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, make_request(pa, 40, a)), scheduler::submit_status::ok);
        a->wait_tokens(2);
        const auto tb = sched_clock::now();
        ASSERT_EQ(s.submit(2, make_request(pb, 4, b)), scheduler::submit_status::ok);
        b->wait();
        a->wait();
        EXPECT_EQ(a->ids(), ra);
        EXPECT_EQ(b->ids(), rb);
        ASSERT_FALSE(b->events().empty());
        const auto b_first = b->events().front().t;
        int between = 0, a_after = 0;
        for (const token_event& e : a->events()) between += e.t > tb && e.t < b_first, a_after += e.t > tb;
        // B takes >= 6 prefill steps; A decodes in each (unless it ran out of tokens first)
        EXPECT_GE(between, std::min(a_after, 4)) << "the running sequence waited for the whole prompt";
        printf("[ interleave ] A: %zu tokens, %d after B arrived, %d of them before B's first token\n", ra.size(), a_after,
               between);
    }
    fw.prefill_chunk = saved;
}

// A sequence being prefilled a chunk at a time holds less state than it will (the CPU's KV cache grows on
// demand): admission still charges what it was admitted on, so two prompts that do not fit together in the state
// budget never run together.
TEST(scheduler, admission_charges_prompts_still_being_prefilled_in_full) {
    forward_pass& fw = tiny().eng().fwd();
    const int64_t saved = fw.prefill_chunk;
    fw.prefill_chunk = 8;
    std::vector<int32_t> prompt;
    for (int i = 0; i < 600; i++) prompt.push_back(100 + (i * 37) % 3000);
    {
        scheduler_options so;
        so.prefill_budget = 8;
        scheduler probe(tiny().eng(), so);
        const size_t one = probe.state_estimate((int64_t)prompt.size(), (int64_t)prompt.size() + 4);
        so.state_budget = one + one / 2;  // room for one such sequence, not two
        scheduler s(tiny().eng(), so);
        auto a = std::make_shared<collect_sink>(), b = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, make_request(prompt, 4, a)), scheduler::submit_status::ok);
        ASSERT_EQ(s.submit(2, make_request(prompt, 4, b)), scheduler::submit_status::ok);
        int most = 0;
        while (a->finishes() == 0 || b->finishes() == 0) {
            most = std::max(most, s.stats().active);
            std::this_thread::sleep_for(1ms);
        }
        EXPECT_EQ(most, 1) << "the second prompt was admitted while the first was still being prefilled";
        EXPECT_EQ(a->ids(), b->ids());
    }
    fw.prefill_chunk = saved;
}

TEST(scheduler, batched_sequences_do_not_mix) {
    // Different prompts and lengths, submitted together so they decode in shared steps. Each must produce the
    // tokens it produces alone (the CPU backend computes every batch row independently).
    const std::vector<std::string> users = {"What is 2+2?", "Write a haiku about the sea.", "Hello!",
                                            "Explain recursion briefly.", "List three colours."};
    const std::vector<int64_t> lens = {10, 16, 4, 14, 12};
    std::vector<std::vector<int32_t>> prompts, refs;
    for (size_t i = 0; i < users.size(); i++) {
        prompts.push_back(chat_prompt(users[i]));
        refs.push_back(reference_greedy(prompts.back(), lens[i]));
    }
    scheduler_options o;
    o.max_batch = 4;  // one waits for a slot
    scheduler s(tiny().eng(), o);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < users.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        ASSERT_EQ(s.submit(10 + i, make_request(prompts[i], lens[i], sinks.back())), scheduler::submit_status::ok);
    }
    for (size_t i = 0; i < users.size(); i++) {
        sinks[i]->wait();
        EXPECT_EQ(sinks[i]->ids(), refs[i]) << "sequence " << i;
        EXPECT_EQ(sinks[i]->finishes(), 1);
    }
    // stats are published at the end of the engine thread's iteration, just after the last finish event
    for (int i = 0; i < 100 && s.stats().active != 0; i++) std::this_thread::sleep_for(10ms);
    const scheduler_stats st = s.stats();
    EXPECT_GT(st.decode_rows, st.steps) << "some steps must have decoded several sequences together";
    EXPECT_EQ(st.active, 0);
    EXPECT_EQ(st.state_bytes, 0u);
}

TEST(scheduler, cancel_frees_the_state_at_once) {
    scheduler s(tiny().eng(), scheduler_options{});
    auto sink = std::make_shared<collect_sink>();
    sequence_request r = make_request(chat_prompt("Tell me a long story."), 100000, sink);
    r.stop_ids.clear();  // would run for a long time
    ASSERT_EQ(s.submit(1, std::move(r)), scheduler::submit_status::ok);
    sink->wait_tokens(5);
    EXPECT_GT(s.stats().state_bytes, 0u);
    s.cancel(1);
    const finish_event f = sink->wait();
    EXPECT_EQ(f.reason, finish_reason::cancelled);
    // the finish event comes after the state is gone; stats follow within the same iteration
    for (int i = 0; i < 100 && s.stats().active != 0; i++) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(s.stats().active, 0);
    EXPECT_EQ(s.stats().state_bytes, 0u);
    EXPECT_EQ(sink->finishes(), 1);
}

TEST(scheduler, a_full_queue_is_refused) {
    scheduler_options o;
    o.max_batch = 1;
    o.max_queue = 1;
    scheduler s(tiny().eng(), o);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    int ok = 0, full = 0;
    for (int i = 0; i < 6; i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        sequence_request r = make_request(chat_prompt("Hello!"), 2000, sinks.back());
        r.stop_ids.clear();
        auto st = s.submit(100 + i, std::move(r));
        if (st == scheduler::submit_status::ok) ok++;
        if (st == scheduler::submit_status::queue_full) full++;
    }
    EXPECT_GE(full, 3) << "one runs, one waits; the rest must be refused";
    EXPECT_EQ(ok + full, 6);
    for (int i = 0; i < 6; i++) s.cancel(100 + i);
    s.shutdown(0ms);
}

TEST(scheduler, seeded_sampling_is_reproducible_and_logprobs_are_consistent) {
    const std::vector<int32_t> prompt = chat_prompt("Write a haiku about the sea.");
    std::vector<std::vector<token_event>> runs;
    for (int rep = 0; rep < 2; rep++) {
        scheduler s(tiny().eng(), scheduler_options{});
        auto sink = std::make_shared<collect_sink>();
        sequence_request r = make_request(prompt, 12, sink);
        r.sampling.temperature = 0.8f;
        r.sampling.top_p = 0.95f;
        r.sampling.seed = 1234;
        r.logprobs = 3;
        ASSERT_EQ(s.submit(1, std::move(r)), scheduler::submit_status::ok);
        sink->wait();
        runs.push_back(sink->events());
    }
    ASSERT_EQ(runs[0].size(), runs[1].size());
    for (size_t i = 0; i < runs[0].size(); i++) {
        const token_event& e = runs[0][i];
        EXPECT_EQ(e.id, runs[1][i].id);
        EXPECT_LE(e.logprob, 0.0f);
        ASSERT_EQ(e.top.size(), 3u);
        EXPECT_GE(e.top[0].second, e.top[1].second);
        EXPECT_GE(e.top[1].second, e.top[2].second);
        EXPECT_LE(e.logprob, e.top[0].second + 1e-6f);
        for (const auto& [id, lp] : e.top) {
            if (id == e.id) {
                EXPECT_FLOAT_EQ(lp, e.logprob);
            }
        }
    }
}

TEST(scheduler, sampled_sequences_in_one_batch_draw_as_they_do_alone) {
    // Sampled rows of a batch are chosen in parallel; each must still draw exactly what it draws alone (its own
    // sampler and seed, the CPU backend's batch rows computed independently), penalties included.
    const std::vector<std::string> users = {"What is 2+2?", "Write a haiku about the sea.", "Hello!", "List three colours."};
    auto request = [&](size_t i, const std::shared_ptr<collect_sink>& sink) {
        sequence_request r = make_request(chat_prompt(users[i]), 10, sink);
        r.sampling.temperature = 0.9f;
        r.sampling.top_p = i % 2 ? 0.9f : 1.0f;
        r.sampling.top_k = i == 2 ? 40 : 0;
        r.sampling.seed = 77 + i;
        if (i == 3) r.penalties.presence = 0.5f;
        return r;
    };
    std::vector<std::vector<int32_t>> alone;
    for (size_t i = 0; i < users.size(); i++) {
        scheduler s(tiny().eng(), scheduler_options{});
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(i, sink)), scheduler::submit_status::ok);
        sink->wait();
        alone.push_back(sink->ids());
    }
    scheduler s(tiny().eng(), scheduler_options{});
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < users.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        ASSERT_EQ(s.submit(20 + i, request(i, sinks.back())), scheduler::submit_status::ok);
    }
    for (size_t i = 0; i < users.size(); i++) {
        sinks[i]->wait();
        EXPECT_EQ(sinks[i]->ids(), alone[i]) << "sequence " << i;
    }
}

TEST(scheduler, max_tokens_and_shutdown_end_sequences) {
    scheduler s(tiny().eng(), scheduler_options{});
    auto a = std::make_shared<collect_sink>(), b = std::make_shared<collect_sink>();
    sequence_request ra = make_request(chat_prompt("Hello!"), 5, a);
    ra.stop_ids.clear();
    ASSERT_EQ(s.submit(1, std::move(ra)), scheduler::submit_status::ok);
    EXPECT_EQ(a->wait().reason, finish_reason::length);
    EXPECT_EQ(a->ids().size(), 5u);
    sequence_request rb = make_request(chat_prompt("Hello!"), 100000, b);
    rb.stop_ids.clear();
    ASSERT_EQ(s.submit(2, std::move(rb)), scheduler::submit_status::ok);
    b->wait_tokens(2);
    s.shutdown(0ms);
    EXPECT_EQ(b->wait().reason, finish_reason::shutdown);
    auto c = std::make_shared<collect_sink>();
    EXPECT_EQ(s.submit(3, make_request(chat_prompt("Hello!"), 5, c)), scheduler::submit_status::shutting_down);
    EXPECT_EQ(c->finishes(), 0);
}

// The same on the CUDA backend, where one is usable: a lone greedy request must give engine::generate's tokens
// (which decodes through CUDA graphs), and a batch must decode every sequence to completion.
TEST(scheduler, cuda_lone_request_equals_generate_and_batches_run) {
    std::string why;
    std::unique_ptr<text_engine> te = cuda_tiny(&why);
    if (!te) GTEST_SKIP() << "no CUDA backend: " << why;
    auto prompt_of = [&](const std::string& user) { return test::user_prompt(*te, user); };
    auto reference = [&](const std::vector<int32_t>& prompt, int64_t n) {
        return test::greedy_reference(*te, prompt, n, te->eos());
    };
    const std::vector<std::string> users = {"What does heapq.heappush do?", "Write a haiku about the sea.", "Hello!",
                                            "Explain recursion briefly."};
    std::vector<std::vector<int32_t>> refs;
    for (const std::string& u : users) refs.push_back(reference(prompt_of(u), 40));
    // the sampled reference below is computed before the scheduler exists: the backend has one owner at a time
    sampling_params sp;
    sp.temperature = 0.7f, sp.top_k = 20, sp.top_p = 0.8f, sp.seed = 99;
    generation_request g;
    g.prompt = prompt_of(users[1]);
    g.max_tokens = 40;
    g.sampling = sp;
    auto gst = te->eng().new_sequence(512);
    std::vector<int32_t> drawn;
    te->eng().generate(*gst, g, [&](int32_t id) {
        drawn.push_back(id);
        return true;
    });
    ASSERT_EQ(drawn.size(), 40u);
    scheduler_options so;
    so.seq_capacity = 512;  // the CUDA backend batches sequences of one capacity only
    scheduler s(te->eng(), so);
    auto lone = std::make_shared<collect_sink>();
    sequence_request r;
    r.prompt = prompt_of(users[0]);
    r.max_tokens = 40;
    r.stop_ids = te->eos();
    r.sink = lone;
    ASSERT_EQ(s.submit(1, std::move(r)), scheduler::submit_status::ok);
    lone->wait();
    EXPECT_EQ(lone->ids(), refs[0]);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < users.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        sequence_request q;
        q.prompt = prompt_of(users[i]);
        q.max_tokens = 40;
        q.stop_ids = te->eos();
        q.sink = sinks.back();
        ASSERT_EQ(s.submit(10 + i, std::move(q)), scheduler::submit_status::ok);
    }
    int same = 0;
    for (size_t i = 0; i < users.size(); i++) {
        const finish_event f = sinks[i]->wait();
        EXPECT_TRUE(f.reason == finish_reason::stop || f.reason == finish_reason::length);
        EXPECT_FALSE(sinks[i]->ids().empty());
        same += sinks[i]->ids() == refs[i];
    }
    // batched bf16 kernels may round differently from single-row ones; report how many matched exactly
    printf("cuda: %d of %zu batched sequences equal their lone greedy output\n", same, users.size());

    // A sampled request drawn on the device (Qwen's non-thinking defaults, seeded) gives engine::generate's
    // tokens, the same ones twice, and a stop id ends it where the id is.
    for (int rep = 0; rep < 2; rep++) {
        auto sink = std::make_shared<collect_sink>();
        sequence_request q;
        q.prompt = g.prompt;
        q.max_tokens = 40;
        q.sampling = sp;
        q.stop_ids = {drawn[25]};
        q.sink = sink;
        ASSERT_EQ(s.submit(100 + rep, std::move(q)), scheduler::submit_status::ok);
        EXPECT_EQ(sink->wait().reason, finish_reason::stop);
        const size_t end = (size_t)(std::find(drawn.begin(), drawn.end(), drawn[25]) - drawn.begin()) + 1;
        EXPECT_EQ(sink->ids(), std::vector<int32_t>(drawn.begin(), drawn.begin() + (ptrdiff_t)end)) << "run " << rep;
    }
}

// Steps are queued ahead of the host (decode_step): a stop id must still end a sequence at that id, a sequence must
// get exactly max_tokens tokens, and the others in the batch must be unaffected.
TEST(scheduler, queued_steps_end_sequences_exactly) {
    const std::vector<int32_t> prompt = chat_prompt("What does heapq.heappush do?");
    const std::vector<int32_t> ref = reference_greedy(prompt, 20);
    ASSERT_GE(ref.size(), 12u);
    scheduler s(tiny().eng(), scheduler_options{});
    auto stopped = std::make_shared<collect_sink>(), full = std::make_shared<collect_sink>(),
         short_one = std::make_shared<collect_sink>();
    sequence_request a = make_request(prompt, 20, stopped);
    a.stop_ids = {ref[6]};
    sequence_request b = make_request(prompt, 20, full);
    sequence_request c = make_request(prompt, 3, short_one);
    ASSERT_EQ(s.submit(1, std::move(a)), scheduler::submit_status::ok);
    ASSERT_EQ(s.submit(2, std::move(b)), scheduler::submit_status::ok);
    ASSERT_EQ(s.submit(3, std::move(c)), scheduler::submit_status::ok);
    EXPECT_EQ(stopped->wait().reason, finish_reason::stop);
    const size_t end = (size_t)(std::find(ref.begin(), ref.end(), ref[6]) - ref.begin()) + 1;
    EXPECT_EQ(stopped->ids(), std::vector<int32_t>(ref.begin(), ref.begin() + (ptrdiff_t)end));
    full->wait();
    EXPECT_EQ(full->ids(), ref);
    EXPECT_EQ(short_one->wait().reason, finish_reason::length);
    EXPECT_EQ(short_one->ids(), std::vector<int32_t>(ref.begin(), ref.begin() + 3));
}

// A request drawn on the device (top-k within k_device_max_top_k: its slot draws; the CPU backend's draw is the
// host sampler's, the twin of the CUDA one) gives what engine::generate gives with the host sampler.
TEST(scheduler, device_drawn_requests_equal_the_host_sampler) {
    const std::vector<int32_t> prompt = chat_prompt("Write a haiku about the sea.");
    sampling_params sp;
    sp.temperature = 0.7f, sp.top_k = 20, sp.top_p = 0.8f, sp.seed = 5;
    ASSERT_TRUE(row_samples_on_device(sp, tiny().eng().n_valid_tokens()));
    generation_request g;
    g.prompt = prompt;
    g.max_tokens = 16;
    g.sampling = sp;
    g.device_sampling = false;
    auto st = tiny().eng().new_sequence((int64_t)prompt.size() + 16);
    std::vector<int32_t> host;
    tiny().eng().generate(*st, g, [&](int32_t id) {
        host.push_back(id);
        return true;
    });
    scheduler s(tiny().eng(), scheduler_options{});
    auto sink = std::make_shared<collect_sink>();
    sequence_request r = make_request(prompt, 16, sink);
    r.stop_ids.clear();
    r.sampling = sp;
    ASSERT_EQ(s.submit(1, std::move(r)), scheduler::submit_status::ok);
    sink->wait();
    EXPECT_EQ(sink->ids(), host);
}

// Penalties and logit_bias are applied on the device before the device's pick; a request with device_pick off is
// picked on the host, which applies them there (scheduler::choose). Both must choose the same tokens, greedy and
// seeded, alone and in one batch with rows that have none.
void expect_device_adjust_equals_host(text_engine& te) {
    auto prompt_of = [&](const std::string& user) { return test::user_prompt(te, user); };
    const std::vector<int32_t> p0 = prompt_of("Write a haiku about the sea."), p1 = prompt_of("List three colours.");
    const int32_t banned = reference_greedy(p0, 1).at(0);
    struct variant {
        std::vector<int32_t> prompt;
        penalty_params pen;
        std::vector<std::pair<int32_t, float>> bias;
        float temperature;
    };
    const std::vector<variant> variants = {
        {p0, {0.0f, 0.0f, 1.3f}, {}, 0.0f},                        // repetition: the prompt's ids count
        {p0, {0.6f, 0.4f, 1.0f}, {{banned, -100.0f}}, 0.0f},      // presence + frequency, the first pick banned
        {p1, {0.3f, 0.7f, 1.1f}, {{banned, 2.5f}, {11, -1.0f}}, 0.9f},  // all together, sampled
        {p1, {}, {{banned, -100.0f}, {banned, 50.0f}}, 0.0f},     // duplicate ids add up, as on the host
    };
    auto request = [&](const variant& v, bool host, const std::shared_ptr<collect_sink>& sink) {
        sequence_request r;
        r.prompt = v.prompt;
        r.max_tokens = 24;
        r.sink = sink;
        r.penalties = v.pen;
        r.logit_bias = v.bias;
        r.sampling.temperature = v.temperature;
        r.sampling.top_k = v.temperature > 0 ? 40 : 0;
        r.sampling.seed = 99;
        r.device_pick = !host;  // a host pick: the penalties and bias are applied there
        return r;
    };
    scheduler_options same_capacity;  // the CUDA backend batches only states of one capacity
    same_capacity.seq_capacity = 256;
    std::vector<std::vector<int32_t>> host_ids;
    for (const variant& v : variants) {
        scheduler s(te.eng(), same_capacity);
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(v, true, sink)), scheduler::submit_status::ok);
        sink->wait();
        host_ids.push_back(sink->ids());
    }
    EXPECT_NE(host_ids[1].at(0), banned);
    // on the device: each alone, then all in one batch beside a plain greedy row
    for (size_t i = 0; i < variants.size(); i++) {
        scheduler s(te.eng(), same_capacity);
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(variants[i], false, sink)), scheduler::submit_status::ok);
        sink->wait();
        EXPECT_EQ(sink->ids(), host_ids[i]) << "variant " << i << " alone";
    }
    scheduler s(te.eng(), same_capacity);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < variants.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        ASSERT_EQ(s.submit(10 + i, request(variants[i], false, sinks.back())), scheduler::submit_status::ok);
    }
    auto plain = std::make_shared<collect_sink>();
    sequence_request r = request(variants[0], false, plain);
    r.penalties = {};
    ASSERT_EQ(s.submit(99, std::move(r)), scheduler::submit_status::ok);
    for (size_t i = 0; i < variants.size(); i++) {
        sinks[i]->wait();
        EXPECT_EQ(sinks[i]->ids(), host_ids[i]) << "variant " << i << " in a batch";
    }
    plain->wait();
}

// A constrained row picks on the device after its mask (set by the scheduler before each step); with device_pick
// off it picks on the host from the masked row instead. Both must choose the same tokens, greedy and seeded, with
// penalties on top, alone and batched.
void expect_device_masks_equal_host(text_engine& te) {
    const std::vector<int32_t> prompt = test::user_prompt(te, "Write a haiku about the sea.");
    auto request = [&](bool host, float temperature, bool penalties, const std::shared_ptr<collect_sink>& sink) {
        sequence_request r;
        r.prompt = prompt;
        r.max_tokens = 20;
        r.sink = sink;
        r.sampling.temperature = temperature;
        r.sampling.top_k = temperature > 0 ? 30 : 0;
        r.sampling.seed = 4242;
        if (penalties) r.penalties.frequency = 0.8f, r.logit_bias = {{13, 3.0f}};
        r.constraint = std::make_unique<test::rotating_constraint>(3);
        r.device_pick = !host;
        return r;
    };
    const std::vector<std::pair<float, bool>> variants = {{0.0f, false}, {0.9f, false}, {0.7f, true}};
    std::vector<std::vector<int32_t>> host_ids;
    for (const auto& [t, pen] : variants) {
        scheduler s(te.eng(), scheduler_options{});
        auto sink = std::make_shared<collect_sink>();
        ASSERT_EQ(s.submit(1, request(true, t, pen, sink)), scheduler::submit_status::ok);
        sink->wait();
        host_ids.push_back(sink->ids());
        ASSERT_EQ(host_ids.back().size(), 20u);
    }
    scheduler s(te.eng(), scheduler_options{});
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (size_t i = 0; i < variants.size(); i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        ASSERT_EQ(s.submit(10 + i, request(false, variants[i].first, variants[i].second, sinks.back())),
                  scheduler::submit_status::ok);
    }
    for (size_t i = 0; i < variants.size(); i++) {
        sinks[i]->wait();
        EXPECT_EQ(sinks[i]->ids(), host_ids[i]) << "variant " << i;
    }
}

TEST(scheduler, device_grammar_masks_equal_the_host_path) { expect_device_masks_equal_host(tiny()); }

TEST(scheduler, cuda_device_grammar_masks_equal_the_host_path) {
    std::string why;
    std::unique_ptr<text_engine> te = cuda_tiny(&why);
    if (!te) GTEST_SKIP() << "no CUDA backend: " << why;
    expect_device_masks_equal_host(*te);
}

TEST(scheduler, device_penalties_and_bias_equal_the_host_path) { expect_device_adjust_equals_host(tiny()); }

TEST(scheduler, cuda_device_penalties_and_bias_equal_the_host_path) {
    std::string why;
    std::unique_ptr<text_engine> te = cuda_tiny(&why);
    if (!te) GTEST_SKIP() << "no CUDA backend: " << why;
    expect_device_adjust_equals_host(*te);
}

}  // namespace
}  // namespace tansy
