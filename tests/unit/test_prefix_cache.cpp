// prefix cache (runtime/prefix_cache.h) on the embedded tiny model, CPU backend: a state restored from a snapshot
// continues exactly as the state it was taken from, and greedy outputs through the scheduler are token-exact with
// and without the cache (second chat turn, shared system prompt, prefix ending mid-block, divergence inside a
// cached block, eviction under a small budget, concurrent requests on one prefix).
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "runtime/prefix_cache.h"
#include "runtime/scheduler.h"
#include "runtime/text_engine.h"
#include "scheduler_test_util.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"

namespace tansy {
namespace {

using namespace std::chrono_literals;
using ojson = nlohmann::ordered_json;

using test::collect_sink;
using test::tiny;

const std::string k_system =
    "You are a careful assistant for a team that maintains a small Python library for parsing calendar files. "
    "Answer briefly, cite the function you mean by its full name, prefer standard-library solutions, and say so "
    "when you are not sure. The library has modules for reading, writing, validating and converting events, and "
    "each module has tests that run on every commit.";

std::vector<int32_t> render(const ojson& msgs) { return tiny().tok().encode(render_chat(msgs, nullptr, chat_options{})); }

ojson conversation(const std::string& user) {
    return ojson::array({{{"role", "system"}, {"content", k_system}}, {{"role", "user"}, {"content", user}}});
}

std::vector<int32_t> reference_greedy(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    return test::greedy_reference(tiny(), prompt, max_tokens, tiny().eos());
}

prefix_cache_options small_blocks(size_t budget = size_t(256) << 20) {
    prefix_cache_options o;
    o.budget = budget;
    o.snapshot_interval = 64;  // several blocks in the test prompts (~100-200 tokens)
    o.min_tokens = 8;
    o.min_mark_gap = 1;  // marks wherever they fall: the tests' prompts are shorter than the default gap
    o.turn_token = tiny().tok().find("<|im_start|>");
    return o;
}

struct outcome {
    std::vector<int32_t> ids;
    finish_event fin;
};

// Waits until the scheduler holds no sequence (an ended one is stored in the cache when it is swept).
void wait_idle(scheduler& s) {
    for (int i = 0; i < 6000; i++) {
        const scheduler_stats st = s.stats();
        if (st.active == 0 && st.queued == 0) return;
        std::this_thread::sleep_for(1ms);
    }
    ADD_FAILURE() << "scheduler not idle";
}

outcome run(scheduler& s, uint64_t id, const std::vector<int32_t>& prompt, int64_t max_tokens, bool cache = true) {
    auto sink = std::make_shared<collect_sink>();
    sequence_request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.stop_ids = tiny().eos();
    r.sink = sink;
    r.cache_prompt = cache;
    EXPECT_EQ(s.submit(id, std::move(r)), scheduler::submit_status::ok);
    outcome o{{}, sink->wait()};
    o.ids = sink->ids();
    wait_idle(s);
    return o;
}

// ---- backend level: snapshot + restore

void continue_exactly(bool kv_fp8) {
    engine_options eo;
    eo.backend = "cpu";
    eo.threads = 1;
    eo.backend_opt.kv_fp8 = kv_fp8;
    engine eng(eo);
    backend& be = eng.be();
    const std::vector<int32_t> prompt = render(conversation("How do I read an .ics file?"));
    const int64_t n = (int64_t)prompt.size(), cut = n / 2;
    const std::vector<int32_t> head(prompt.begin(), prompt.begin() + cut), tail(prompt.begin() + cut, prompt.end());
    auto a = eng.new_sequence(n + 8);
    eng.step(*a, head, logits_rows::none);
    auto full = be.snapshot(*a, cut);  // KV rows + recurrent part, capacity cut
    auto rec = be.snapshot(*a, 0);     // recurrent part only
    EXPECT_EQ(full->capacity(), cut);
    EXPECT_EQ(rec->n_past(), cut);
    EXPECT_LT(rec->bytes(), full->bytes());
    const std::vector<float> ref = eng.step(*a, tail, logits_rows::all);
    for (const seq_state* r : {full.get(), rec.get()}) {
        auto b = eng.new_sequence(n + 8);  // another capacity than the snapshot's
        be.restore(*b, *r, *full, cut);
        EXPECT_EQ(b->n_past(), cut);
        const std::vector<float> got = eng.step(*b, tail, logits_rows::all);
        ASSERT_EQ(got.size(), ref.size());
        EXPECT_EQ(got, ref) << "a restored state must continue bit for bit (kv_fp8 " << kv_fp8 << ")";
        for (int64_t l = 0; l < eng.cfg().n_full_attention(); l++) {
            std::vector<float> k1(eng.cfg().kv_dim()), v1(k1.size()), k2(k1.size()), v2(k1.size());
            be.read_kv(*a, (int)l, cut - 1, k1.data(), v1.data());
            be.read_kv(*b, (int)l, cut - 1, k2.data(), v2.data());
            EXPECT_EQ(k1, k2);
            EXPECT_EQ(v1, v2);
        }
    }
}

TEST(prefix_cache, restored_state_continues_exactly) { continue_exactly(false); }
TEST(prefix_cache, restored_state_continues_exactly_fp8_kv) { continue_exactly(true); }

// A step cut at a mark sums in other groups (the chunked DeltaNet form's chunks, matrix products over other row
// counts): fp32 rounding, ~1e-6 relative on the logits.
constexpr double TOL_MARK_SPLIT = 1e-5;

// A checkpoint taken inside a step (seq_span::mark) is the state of a piece that ends there, up to rounding, for
// a mark inside the conv window of the step's start, at the chunked form's first chunk boundary, and one row
// before the step's end; the marked step's own logits are unchanged.
// state_bf16: the carried state is rounded at the mark as at a step's end, so the checkpoint, a restore from it and
// the piece cut there still agree; only an unmarked step (rounded at its end alone) differs, by the rounding.
void mark_inside_a_step(bool state_bf16) {
    engine_options eo;
    eo.backend = "cpu";
    eo.threads = 1;
    eo.backend_opt.state_bf16 = state_bf16;
    engine eng(eo);
    backend& be = eng.be();
    const std::vector<int32_t> prompt = render(conversation(
        "Which function expands an RRULE into dates, which one validates an event's time zone, and which one writes "
        "a calendar back to a file? Name each in full and say in one sentence what it returns."));
    const int64_t n = (int64_t)prompt.size(), pre = 9, len = 80;
    ASSERT_GT(n, pre + len + 8);
    const std::vector<int32_t> head(prompt.begin(), prompt.begin() + pre), piece(prompt.begin() + pre, prompt.begin() + pre + len),
        tail(prompt.begin() + pre + len, prompt.begin() + pre + len + 8);
    auto unmarked = eng.new_sequence(n);
    eng.step(*unmarked, head, logits_rows::none);
    const std::vector<float> want_piece = eng.step(*unmarked, piece, logits_rows::all);
    for (int64_t mark : {int64_t(2), int64_t(64), len - 1}) {
        SCOPED_TRACE("mark " + std::to_string(mark));
        auto a = eng.new_sequence(n), b = eng.new_sequence(n);
        eng.step(*a, head, logits_rows::none);
        eng.step(*b, head, logits_rows::none);
        std::unique_ptr<seq_state> ms = be.new_state(0);
        const std::vector<float> got_piece = eng.fwd().run_host(piece, *a, logits_rows::all, span_mark{ms.get(), mark});
        EXPECT_EQ(ms->n_past(), pre + mark);
        EXPECT_EQ(a->n_past(), pre + len);
        // the piece cut at the mark instead
        eng.step(*b, {piece.begin(), piece.begin() + mark}, logits_rows::none);
        eng.step(*b, {piece.begin() + mark, piece.end()}, logits_rows::none);
        const std::vector<float> tail_ref = eng.step(*b, tail, logits_rows::all);
        // restored from the mark (KV rows from a), the rest of the piece and the tail continue as b did
        auto c = eng.new_sequence(n);
        be.restore(*c, *ms, *a, pre + mark);
        eng.step(*c, {piece.begin() + mark, piece.end()}, logits_rows::none);
        EXPECT_LT(test::rel_error(eng.step(*c, tail, logits_rows::all), tail_ref), TOL_MARK_SPLIT);
        // the marked step's logits: its rows after the mark as the cut piece's second part computed them, and
        // the same tail after it
        EXPECT_LT(test::rel_error(eng.step(*a, tail, logits_rows::all), tail_ref), TOL_MARK_SPLIT);
        ASSERT_EQ(got_piece.size(), want_piece.size());
        if (!state_bf16) {
            EXPECT_LT(test::rel_error(got_piece, want_piece), TOL_MARK_SPLIT) << "the mark leaves the step's output";
        }
    }
}

TEST(prefix_cache, a_mark_inside_a_step_is_the_state_of_a_piece_ending_there) { mark_inside_a_step(false); }
TEST(prefix_cache, a_mark_inside_a_step_is_the_state_of_a_piece_ending_there_bf16_state) { mark_inside_a_step(true); }

// ---- store level

TEST(prefix_cache, lookup_leaves_a_token_and_absorbs_extended_entries) {
    engine& eng = tiny().eng();
    prefix_cache pc(eng.be(), small_blocks());
    const std::vector<int32_t> p = render(conversation("What is an RRULE?"));
    const int64_t n = (int64_t)p.size();
    auto st = eng.new_sequence(n + 8);
    eng.step(*st, {p.begin(), p.begin() + 40}, logits_rows::none);
    prefix_cache::checkpoints cps;
    cps.push_back(pc.checkpoint(*st));
    eng.step(*st, {p.begin() + 40, p.end()}, logits_rows::none);
    pc.insert(p.data(), n, *st, std::move(cps));
    EXPECT_EQ(pc.stats().entries, 1);
    EXPECT_EQ(pc.stats().checkpoints, 1);
    // the same prompt: all but its last token
    EXPECT_EQ(pc.lookup(p).tokens(), 40) << "no checkpoint at n-1: the best is the one at 40";
    std::vector<int32_t> longer = p;
    longer.push_back(p[3]);
    EXPECT_EQ(pc.lookup(longer).tokens(), n);
    std::vector<int32_t> diverge(p.begin(), p.begin() + 50);
    diverge.push_back(7);
    EXPECT_EQ(pc.lookup(diverge).tokens(), 40);
    EXPECT_FALSE(pc.lookup({p.begin(), p.begin() + 30}));
    // an entry extending it absorbs it: one entry, its end a checkpoint
    auto st2 = st->clone();
    eng.step(*st2, {5, 6, 7}, logits_rows::none);
    std::vector<int32_t> ext = p;
    ext.insert(ext.end(), {5, 6, 7});
    pc.insert(ext.data(), n + 3, *st2);
    EXPECT_EQ(pc.stats().entries, 1);
    EXPECT_EQ(pc.stats().checkpoints, 2);
    EXPECT_EQ(pc.lookup(longer).tokens(), n);
    // a pinned entry is not evicted
    prefix_cache::lease l = pc.lookup(longer);
    pc.evict_to(0);
    EXPECT_EQ(pc.stats().entries, 1);
    l.release();
    pc.evict_to(0);
    EXPECT_EQ(pc.stats().entries, 0);
    EXPECT_EQ(pc.bytes(), 0u);
}

// plan(): the divergence point and the first and last turn marks, none closer than min_mark_gap to where the
// prefill starts (a piece that short costs a step and saves less).
TEST(prefix_cache, marks_keep_their_distance_from_the_restored_prefix) {
    engine& eng = tiny().eng();
    prefix_cache_options o = small_blocks();
    const std::vector<int32_t> p = render(conversation("What is an RRULE? Answer in one line, then give an example."));
    const int64_t n = (int64_t)p.size();
    std::vector<int64_t> turns;
    for (int64_t i = 1; i < n; i++)
        if (p[(size_t)i] == o.turn_token) turns.push_back(i);
    ASSERT_GE(turns.size(), 2u) << "the system message, the user's and the assistant header each start a turn";
    const int64_t first = turns.front(), last = turns.back();
    ASSERT_GT(last - first, 20);
    {
        prefix_cache pc(eng.be(), o);
        EXPECT_EQ(pc.plan(p, 0), (std::vector<int64_t>{first, last}));
        EXPECT_EQ(pc.plan(p, first), (std::vector<int64_t>{last}));  // at or before `from`: none
    }
    o.min_mark_gap = last - first;  // the last mark exactly that far from a start at the first
    {
        prefix_cache pc(eng.be(), o);
        EXPECT_EQ(pc.plan(p, first), (std::vector<int64_t>{last}));
        EXPECT_EQ(pc.plan(p, first + 1), (std::vector<int64_t>{})) << "one token closer: dropped";
    }
    o.min_mark_gap = first + 1;
    {
        prefix_cache pc(eng.be(), o);
        EXPECT_EQ(pc.plan(p, 0), (std::vector<int64_t>{last})) << "the first mark is too close to 0";
    }
    // the divergence point from a cached entry: kept far from the start, dropped near it
    o.min_mark_gap = 1;
    prefix_cache pc(eng.be(), o);
    auto st = eng.new_sequence(n + 8);
    const int64_t d = first + 10;
    std::vector<int32_t> other(p.begin(), p.begin() + d);
    other.push_back(p[(size_t)d] + 1);  // leaves p at d
    eng.step(*st, other, logits_rows::none);
    pc.insert(other.data(), (int64_t)other.size(), *st);
    const std::vector<int64_t> with_d = pc.plan(p, 0);
    EXPECT_TRUE(std::binary_search(with_d.begin(), with_d.end(), d)) << "divergence point " << d;
    prefix_cache_options far = o;
    far.min_mark_gap = d + 1;
    prefix_cache pc2(eng.be(), far);
    pc2.insert(other.data(), (int64_t)other.size(), *st);
    const std::vector<int64_t> without_d = pc2.plan(p, 0);
    EXPECT_FALSE(std::binary_search(without_d.begin(), without_d.end(), d));
}

TEST(prefix_cache, next_piece_takes_a_mark_inside_or_ends_there) {
    using pc = prefix_cache;
    const int64_t L = k_marked_span_min_rows;
    auto piece = [](const std::vector<int64_t>& marks, int64_t at, int64_t max_n, int64_t T) {
        const pc::piece k = pc::next_piece(marks, at, max_n, T);
        return std::make_pair(k.end, k.mark);
    };
    using P = std::pair<int64_t, int64_t>;
    EXPECT_EQ(piece({}, 0, 100, 1000), P(100, 0));
    EXPECT_EQ(piece({}, 950, 100, 1000), P(1000, 0));
    EXPECT_EQ(piece({500}, 0, 100, 1000), P(100, 0)) << "a mark past the budget";
    EXPECT_EQ(piece({100}, 0, 100, 1000), P(100, 0)) << "a mark at the piece's end is its end";
    EXPECT_EQ(piece({995}, 900, 200, 1000), P(1000, 995)) << "a chat turn's last <|im_start|>: taken in the step";
    EXPECT_EQ(piece({300, 700}, 200, 2048, 1000), P(700, 300)) << "one mark a piece: it ends at the next";
    EXPECT_EQ(piece({210}, 200, 2048, 200 + L - 1), P(210, 0)) << "too short to carry it";
    EXPECT_EQ(piece({210}, 200, 2048, 200 + L), P(200 + L, 210));
    EXPECT_EQ(piece({210, 220}, 200, 2048, 1000), P(210, 0)) << "the next mark too close";
    EXPECT_EQ(piece({100, 200}, 150, 2048, 1000), P(1000, 200)) << "marks at or before `at` are behind";
}

// ---- scheduler: token-exact with and without the cache

// A chat turn runs in one forward step: the checkpoint before its last <|im_start|> (where the next turn leaves
// this one) is taken inside the step, and the next turn restores it and runs in one step too.
TEST(prefix_cache, a_chat_turn_runs_in_one_step_with_its_turn_checkpoint) {
    prefix_cache_options po = small_blocks();
    po.min_mark_gap = 128;  // the server's default: no mark right after where the prefill starts (nor at the end
                            // of this system prompt, ~80 tokens: one mark a turn)
    po.snapshot_interval = 0;
    prefix_cache pc(tiny().eng().be(), po);
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const int32_t im_start = tiny().tok().find("<|im_start|>");
    auto last_turn = [&](const std::vector<int32_t>& p) {
        return (int64_t)(std::find(p.rbegin(), p.rend(), im_start).base() - 1 - p.begin());
    };
    std::string question = "How do I find all events on a given day?";
    for (int i = 0; i < 5; i++) question += " The calendar has recurring events, exceptions and several time zones.";
    ojson msgs = conversation(question);
    int64_t restored = 0;  // where the turn's checkpoint is: the next turn restores it
    for (int turn = 1; turn <= 2; turn++) {
        const std::vector<int32_t> p = render(msgs);
        const int64_t mark = last_turn(p);
        ASSERT_GE(mark - restored, po.min_mark_gap) << "turn " << turn << ": its mark is planned";
        const uint64_t steps = s.stats().steps;
        const outcome o = run(s, (uint64_t)turn, p, 1);
        for (int i = 0; i < 2000 && s.stats().steps == steps; i++) std::this_thread::sleep_for(1ms);
        if (turn == 2) {
            EXPECT_EQ(o.ids, reference_greedy(p, 1)) << "the restored turn's token";
        }
        EXPECT_EQ(o.fin.cached_tokens, restored) << "turn " << turn;
        EXPECT_EQ(s.stats().steps - steps, 1u) << "turn " << turn << ": one forward pass";
        // a prompt that leaves this one right after its last <|im_start|> restores exactly the checkpoint there
        std::vector<int32_t> other(p.begin(), p.begin() + mark + 1);
        other.push_back(p[(size_t)mark + 1] + 1);
        other.push_back(p[(size_t)mark + 1] + 2);
        EXPECT_EQ(pc.lookup(other).tokens(), mark) << "turn " << turn;
        restored = mark;
        std::string answer;
        for (int i = 0; i < 9; i++) answer += "Call rules.expand(start, end) and keep the events of that day. ";
        msgs.push_back({{"role", "assistant"}, {"content", answer}});
        msgs.push_back({{"role", "user"}, {"content", "And for a whole week?"}});
    }
}

TEST(prefix_cache, second_chat_turn_is_exact_and_cached) {
    prefix_cache pc(tiny().eng().be(), small_blocks());
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    ojson msgs = conversation("How do I find all events on a given day?");
    const std::vector<int32_t> p1 = render(msgs);
    const outcome t1 = run(s, 1, p1, 24);
    EXPECT_EQ(t1.ids, reference_greedy(p1, 24));
    EXPECT_EQ(t1.fin.cached_tokens, 0);
    // the next turn re-renders the answer (the template may differ from the generated tokens)
    std::vector<int32_t> answer = t1.ids;
    if (!answer.empty() && answer.back() == tiny().eos()[0]) answer.pop_back();
    msgs.push_back({{"role", "assistant"}, {"content", tiny().tok().decode(answer, true)}});
    msgs.push_back({{"role", "user"}, {"content", "And for a whole week?"}});
    const std::vector<int32_t> p2 = render(msgs);
    const outcome t2 = run(s, 2, p2, 24);
    const outcome cold = run(s, 3, p2, 24, /*cache=*/false);
    EXPECT_EQ(t2.ids, reference_greedy(p2, 24));
    EXPECT_EQ(t2.ids, cold.ids);
    EXPECT_GT(t2.fin.cached_tokens, (int64_t)p1.size() / 2) << "turn 2 restores (most of) turn 1";
    EXPECT_EQ(cold.fin.cached_tokens, 0);
    printf("second turn: %zu prompt tokens, %lld cached; prefill %.1f ms cached vs %.1f ms cold\n", p2.size(),
           (long long)t2.fin.cached_tokens, t2.fin.prefill_s * 1e3, cold.fin.prefill_s * 1e3);
    const prefix_cache_stats st = pc.stats();
    EXPECT_GE(st.hits, 1u);
    EXPECT_GE(st.cached_tokens, (uint64_t)t2.fin.cached_tokens);
}

// Issue 30's measurement: a ~1,500-token system prompt, then a second turn, with the server's defaults (a
// checkpoint every 2048 tokens, none below 256 tokens, turn checkpoints). Time to first token cold vs cached.
TEST(prefix_cache, second_turn_of_a_long_conversation) {
    prefix_cache_options po;
    po.budget = size_t(512) << 20;
    po.turn_token = tiny().tok().find("<|im_start|>");
    prefix_cache pc(tiny().eng().be(), po);
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    std::string sys;
    for (int i = 0; sys.size() < 5200; i++)
        sys += "Rule " + std::to_string(i) + ": keep answers short, name functions in full, and prefer the standard library. ";
    ojson msgs = ojson::array({{{"role", "system"}, {"content", sys}}, {{"role", "user"}, {"content", "What is a heap?"}}});
    const std::vector<int32_t> p1 = render(msgs);
    ASSERT_GT(p1.size(), 1300u);
    const outcome t1 = run(s, 1, p1, 16);
    std::vector<int32_t> answer = t1.ids;
    if (!answer.empty() && answer.back() == tiny().eos()[0]) answer.pop_back();
    msgs.push_back({{"role", "assistant"}, {"content", tiny().tok().decode(answer, true)}});
    msgs.push_back({{"role", "user"}, {"content", "And a stack?"}});
    const std::vector<int32_t> p2 = render(msgs);
    const outcome cold = run(s, 2, p2, 16, /*cache=*/false);
    const outcome warm = run(s, 3, p2, 16);
    EXPECT_EQ(warm.ids, cold.ids);
    EXPECT_GE(warm.fin.cached_tokens, (int64_t)p1.size() - 8);
    EXPECT_LT(warm.fin.prefill_s, cold.fin.prefill_s);
    printf("second turn of %zu tokens (first turn %zu): %lld cached; time to first token %.1f ms cached vs %.1f ms cold\n",
           p2.size(), p1.size(), (long long)warm.fin.cached_tokens, warm.fin.prefill_s * 1e3, cold.fin.prefill_s * 1e3);
}

TEST(prefix_cache, shared_system_prompt_mid_block_and_divergence) {
    prefix_cache pc(tiny().eng().be(), small_blocks());
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const std::vector<int32_t> a = render(conversation("Which module validates events?"));
    const std::vector<int32_t> b = render(conversation("How are time zones converted?"));
    const std::vector<int32_t> c = render(conversation("Where do the tests live?"));
    const int64_t shared = std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin();
    ASSERT_GT(shared, 64) << "the system prompt spans a checkpoint interval";
    EXPECT_EQ(run(s, 1, a, 16).ids, reference_greedy(a, 16));
    const outcome ob = run(s, 2, b, 16);
    EXPECT_EQ(ob.ids, reference_greedy(b, 16));
    // b leaves a's path after its system message: a's prompt ran in one piece per mark (no interval checkpoint
    // inside: pieces are not cut for those), so b restores the end of the system message (a checkpoint before the
    // first <|im_start|> after 0), and checkpoints where it left
    const int32_t im_start = tiny().tok().find("<|im_start|>");
    const int64_t sys_end = std::find(a.begin() + 1, a.end(), im_start) - a.begin();
    ASSERT_LE(sys_end, shared);
    EXPECT_EQ(ob.fin.cached_tokens, sys_end);
    // c shares the same system prompt: it restores exactly the divergence point b left there
    const int64_t shared_c = std::mismatch(c.begin(), c.end(), b.begin()).first - c.begin();
    const outcome oc = run(s, 3, c, 16);
    EXPECT_EQ(oc.ids, reference_greedy(c, 16));
    EXPECT_EQ(oc.fin.cached_tokens, std::min(shared, shared_c));
    // a prefix of a that ends mid-block, and one that diverges inside a cached block
    const std::vector<int32_t> mid(a.begin(), a.begin() + sys_end + 20);
    const outcome om = run(s, 4, mid, 12);
    EXPECT_EQ(om.ids, reference_greedy(mid, 12));
    EXPECT_GE(om.fin.cached_tokens, sys_end);
    std::vector<int32_t> div(a.begin(), a.begin() + sys_end + 6);
    const std::vector<int32_t> other = render(conversation("Can I write events to a file?"));
    div.insert(div.end(), other.end() - 20, other.end());
    const outcome od = run(s, 5, div, 12);
    EXPECT_EQ(od.ids, reference_greedy(div, 12));
    EXPECT_GE(od.fin.cached_tokens, sys_end);
    EXPECT_LE(od.fin.cached_tokens, sys_end + 6);
}

// Plain text (no turn token): the prefix cache places no mark in it.
std::vector<int32_t> plain_text(int words) {
    std::string t;
    for (int i = 0; i < words; i++) t += " event " + std::to_string(i * 7 % 13) + (i % 5 == 4 ? "." : ",");
    return tiny().tok().encode(t);
}

// An agent's next call: the whole conversation again plus a tool result. The rest fits one prefill piece, so it
// runs as one forward pass even where it crosses interval positions (a cut there costs a forward pass).
TEST(prefix_cache, a_next_call_that_fits_one_piece_runs_in_one_step) {
    prefix_cache pc(tiny().eng().be(), small_blocks());
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const std::vector<int32_t> p1 = render(conversation("Which module validates events?"));
    run(s, 1, p1, 8);
    std::vector<int32_t> p2 = p1;
    const std::vector<int32_t> result = plain_text(60);
    p2.insert(p2.end(), result.begin(), result.end());
    ASSERT_GT((int64_t)result.size(), 2 * small_blocks().snapshot_interval) << "the rest crosses interval positions";
    const uint64_t steps = s.stats().steps;
    const outcome o = run(s, 2, p2, 1);
    // (the finish event comes from inside the step, before the step is counted)
    for (int i = 0; i < 2000 && s.stats().steps == steps; i++) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(o.fin.cached_tokens, (int64_t)p1.size());
    EXPECT_EQ(s.stats().steps - steps, 1u) << "one forward pass for the whole rest";
    EXPECT_EQ(o.ids, reference_greedy(p2, 1));
}

// A long prompt in many pieces takes a checkpoint at the first piece end an interval after the last one, so a
// divergence inside it restores from there.
TEST(prefix_cache, interval_checkpoints_at_piece_ends) {
    struct chunk_guard {  // smaller prefill chunks for this test: many pieces on a short prompt
        int64_t saved = tiny().eng().fwd().prefill_chunk;
        chunk_guard() { tiny().eng().fwd().prefill_chunk = 48; }
        ~chunk_guard() { tiny().eng().fwd().prefill_chunk = saved; }
    } guard;
    const prefix_cache_options po = small_blocks();
    prefix_cache pc(tiny().eng().be(), po);
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const std::vector<int32_t> a = plain_text(120);
    ASSERT_GT(a.size(), 300u);
    EXPECT_EQ(run(s, 1, a, 4).ids, reference_greedy(a, 4));
    // pieces end at 48, 96, 144, ...: a checkpoint is due at 96, 192, 288, ... (64 tokens after the last one)
    const int64_t expect_cps = ((int64_t)a.size() - 1) / 96;
    EXPECT_EQ(pc.stats().checkpoints, expect_cps);
    std::vector<int32_t> b(a.begin(), a.begin() + 250);
    const std::vector<int32_t> tail = plain_text(9);
    b.insert(b.end(), tail.rbegin(), tail.rend());
    const outcome ob = run(s, 2, b, 4);
    EXPECT_EQ(ob.fin.cached_tokens, 192);
    EXPECT_EQ(ob.ids, reference_greedy(b, 4));
    // the same pieces without the scheduler: tansy run --chat's path
    prefix_cache pc2(tiny().eng().be(), po);
    auto st = tiny().eng().new_sequence((int64_t)a.size() + 8);
    generation_request req;
    req.prompt = a;
    req.max_tokens = 4;
    req.stop_ids = tiny().eos();
    std::vector<int32_t> out;
    tiny().eng().generate_cached(pc2, *st, req, [&](int32_t id) { return out.push_back(id), true; });
    EXPECT_EQ(out, reference_greedy(a, 4));
    EXPECT_EQ(pc2.stats().checkpoints, expect_cps);
}

TEST(prefix_cache, eviction_under_a_small_budget_keeps_outputs_exact) {
    // room for about one entry of these prompts (the tiny model's state is ~100 KB + ~8 KB per token)
    engine& eng = tiny().eng();
    auto probe = eng.new_sequence(1);
    const size_t one = probe->bytes() * 3 + 200 * 2 * 2 * (size_t)eng.cfg().kv_dim() * 4;
    prefix_cache pc(eng.be(), small_blocks(one));
    scheduler_options so;
    so.cache = &pc;
    scheduler s(eng, so);
    const char* questions[] = {"Name the reader module.", "Name the writer module.", "What does validate() check?",
                               "Name the reader module."};
    uint64_t id = 1;
    for (const char* q : questions) {
        const std::vector<int32_t> p = render(conversation(q));
        const outcome o = run(s, id++, p, 12);
        EXPECT_EQ(o.ids, reference_greedy(p, 12)) << q;
        EXPECT_LE(pc.bytes(), one);
    }
    const prefix_cache_stats st = pc.stats();
    EXPECT_GT(st.evictions, 0u);
    EXPECT_LE(st.bytes, one);
    s.shutdown(0ms);
    pc.clear();
    EXPECT_EQ(pc.bytes(), 0u);
    EXPECT_EQ(pc.stats().entries, 0);
}

TEST(prefix_cache, concurrent_requests_on_one_prefix) {
    const char* qs[] = {"Explain the reader.", "Explain the writer.", "Explain the converter.", "Explain the tests."};
    // the references first: the engine is single-threaded, and the scheduler's thread drives it from here on
    std::vector<std::vector<int32_t>> prompts, want;
    for (const char* q : qs) {
        prompts.push_back(render(conversation(q)));
        want.push_back(reference_greedy(prompts.back(), 12));
    }
    prefix_cache pc(tiny().eng().be(), small_blocks());
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const std::vector<int32_t> warm = render(conversation("Explain the converter."));
    run(s, 1, warm, 4);
    std::vector<std::shared_ptr<collect_sink>> sinks;
    for (int i = 0; i < 4; i++) {
        sinks.push_back(std::make_shared<collect_sink>());
        sequence_request r;
        r.prompt = prompts[(size_t)i];
        r.max_tokens = 12;
        r.stop_ids = tiny().eos();
        r.sink = sinks.back();
        ASSERT_EQ(s.submit(10 + i, std::move(r)), scheduler::submit_status::ok);
    }
    for (int i = 0; i < 4; i++) {
        const finish_event f = sinks[(size_t)i]->wait();
        EXPECT_GT(f.cached_tokens, 0) << qs[i];
        EXPECT_EQ(sinks[(size_t)i]->ids(), want[(size_t)i]) << qs[i];
    }
}

TEST(prefix_cache, opt_out_and_disabled) {
    prefix_cache pc(tiny().eng().be(), small_blocks());
    scheduler_options so;
    so.cache = &pc;
    scheduler s(tiny().eng(), so);
    const std::vector<int32_t> p = render(conversation("Say hello."));
    run(s, 1, p, 4, /*cache=*/false);
    EXPECT_EQ(pc.stats().entries, 0) << "cache_prompt false stores nothing";
    run(s, 2, p, 4);
    EXPECT_EQ(run(s, 3, p, 4, /*cache=*/false).fin.cached_tokens, 0);
    EXPECT_GT(run(s, 4, p, 4).fin.cached_tokens, 0);
    prefix_cache off(tiny().eng().be(), prefix_cache_options{});
    EXPECT_FALSE(off.enabled());
    EXPECT_FALSE(off.lookup(p));
}

}  // namespace
}  // namespace tansy
