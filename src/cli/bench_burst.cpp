// tansy bench --serve --scenario burst: long prompts arriving at once while other streams decode.
//   1. `decoders` streams start (prompts of --prompt-tokens, completions long enough to outlive the burst);
//   2. once every one has its first token, each decodes steady_tokens more: the steady window;
//   3. `burst` prompts of burst_tokens are sent at once; the burst window lasts until the last of them has its
//      first token; then the decoders are stopped (their connections closed: the server cancels them).
// Decoders: inter-token gaps (as load_client.h computes them) ending in each window. Burst prompts: TTFT against
// the ideal of a server that prefills at the engine's rate one prompt after another: the i-th prompt to get its
// first token ideally waits for the tokens of the first i, ideal_i = (their prompt tokens) / prefill_tok_s.
#include <algorithm>
#include <cstdio>
#include <thread>

#include "cli/bench_scenarios.h"
#include "core/check.h"
#include "runtime/metrics.h"

namespace tansy {

namespace {

using ojson = nlohmann::ordered_json;
using steady = std::chrono::steady_clock;

double secs_since(steady::time_point t0) { return std::chrono::duration<double>(steady::now() - t0).count(); }

// Polls until every stream of the set satisfies pred(i); stops with an error when one ends first (its error
// named) or after `limit_s`.
template <typename pred_t>
void wait_for_all(stream_set& set, pred_t pred, const char* what, double limit_s = 600) {
    const auto t0 = steady::now();
    for (;;) {
        bool all = true;
        for (size_t i = 0; i < set.size(); i++) {
            if (pred(i)) continue;
            all = false;
            if (set.done(i)) {
                set.stop();
                const round_result r = set.wait();
                const stream_timing& s = r.streams[i];
                fail("bench --serve: burst: decoding stream %zu ended before %s (%lld tokens%s%s)", i + 1, what,
                     (long long)s.completion_tokens, s.ok ? "" : ": ", s.error.c_str());
            }
        }
        if (all) return;
        if (secs_since(t0) > limit_s) {
            set.stop();
            fail("bench --serve: burst: no %s after %.0f s", what, limit_s);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
}

struct gap_stats {
    double p50 = 0, p99 = 0, max = 0, window_s = 0;
    int64_t gaps = 0;
};

// Inter-token gaps of the streams that end in (from, to].
gap_stats gaps_in(const round_result& r, double from, double to) {
    std::vector<double> g;
    for (const stream_timing& s : r.streams)
        for (size_t k = 0; k < s.itl_s.size() && k + 1 < s.event_s.size(); k++)
            if (s.event_s[k + 1] > from && s.event_s[k + 1] <= to) g.push_back(s.itl_s[k] * 1e3);
    gap_stats st;
    st.gaps = (int64_t)g.size();
    st.window_s = to - from;
    st.p50 = percentile(g, 50);
    st.p99 = percentile(g, 99);
    st.max = g.empty() ? 0 : *std::max_element(g.begin(), g.end());
    return st;
}

ojson gap_json(const gap_stats& g) {
    return {{"itl_ms_p50", g.p50}, {"itl_ms_p99", g.p99}, {"itl_ms_max", g.max}, {"window_s", g.window_s},
            {"gaps", g.gaps}};
}

ojson user_message(const std::string& content) {
    return ojson::array({{{"role", "user"}, {"content", content}}});
}

}  // namespace

scenario_report run_burst(const scenario_target& t, const scenario_options& o, double prefill_tok_s) {
    // long enough to outlive any burst; stopped once it is over
    const int64_t decode_tokens = o.context_tokens - o.prompt_tokens - 64;
    if (decode_tokens < 4 * o.steady_tokens)
        fail("bench --serve: burst: the context (%lld) leaves the decoders too few tokens", (long long)o.context_tokens);
    const auto t0 = steady::now();
    std::vector<std::string> bodies;
    for (int64_t i = 0; i < o.decoders; i++) {
        const uint64_t seed = 0xb0257ULL * 100000 + (uint64_t)i;
        bodies.push_back(scenario_body(
            user_message(t.prompts->make(strprintf("Decoding stream %lld:", (long long)i + 1), seed, o.prompt_tokens)),
            decode_tokens, true, seed));
    }
    stream_set decoders(t.host, t.port, t.path, std::move(bodies), t0);
    wait_for_all(decoders, [&](size_t i) { return decoders.text_events(i) >= 1; }, "its first token");
    const double steady_from = secs_since(t0);
    std::vector<int64_t> base(decoders.size());
    for (size_t i = 0; i < base.size(); i++) base[i] = decoders.text_events(i);
    wait_for_all(decoders, [&](size_t i) { return decoders.text_events(i) >= base[i] + o.steady_tokens; },
                 "the end of the steady window");

    bodies.clear();
    for (int64_t i = 0; i < o.burst; i++) {
        const uint64_t seed = 0xb0258ULL * 100000 + (uint64_t)i;
        bodies.push_back(scenario_body(
            user_message(t.prompts->make(strprintf("Burst prompt %lld:", (long long)i + 1), seed, o.burst_tokens)),
            BURST_REPLY, true, seed));
    }
    round_result burst;
    double burst_from = 0;
    {
        stream_set b(t.host, t.port, t.path, std::move(bodies), t0);
        burst_from = b.sent_s();
        burst = b.wait();
    }
    double burst_to = burst_from;
    for (size_t i = 0; i < burst.streams.size(); i++) {
        check_stream(burst.streams[i], strprintf("burst: prompt %zu", i + 1));
        burst_to = std::max(burst_to, burst.streams[i].first_s);
    }
    decoders.stop();
    const round_result dec = decoders.wait();
    for (size_t i = 0; i < dec.streams.size(); i++) {
        const stream_timing& s = dec.streams[i];
        check_stream(s, strprintf("burst: decoding stream %zu", i + 1));
        if (!s.stopped || s.last_s < burst_to)
            fail("bench --serve: burst: decoding stream %zu finished (%lld tokens) before the burst was over",
                 i + 1, (long long)s.completion_tokens);
    }
    const gap_stats before = gaps_in(dec, steady_from, burst_from), during = gaps_in(dec, burst_from, burst_to);

    // burst prompts in the order their first tokens came
    std::vector<const stream_timing*> order;
    for (const stream_timing& s : burst.streams) order.push_back(&s);
    std::sort(order.begin(), order.end(), [](const stream_timing* a, const stream_timing* b) { return a->ttft_s < b->ttft_s; });
    std::vector<double> ttft;
    int64_t cum = 0;
    double worst = 0;
    ojson prompts = ojson::array();
    std::string rows;
    for (size_t i = 0; i < order.size(); i++) {
        cum += order[i]->prompt_tokens;
        const double ms = order[i]->ttft_s * 1e3, ideal = prefill_tok_s > 0 ? 1e3 * (double)cum / prefill_tok_s : 0;
        const double r = ideal > 0 ? ms / ideal : 0;
        worst = std::max(worst, r);
        ttft.push_back(ms);
        prompts.push_back({{"prompt_tokens", order[i]->prompt_tokens}, {"ttft_ms", ms}, {"ideal_ms", ideal}, {"ratio", r}});
        rows += strprintf("%6zu %13lld %10.1f %10.1f %7.2fx\n", i + 1, (long long)order[i]->prompt_tokens, ms, ideal, r);
    }
    const double ideal_max = prefill_tok_s > 0 ? 1e3 * (double)cum / prefill_tok_s : 0;
    const double ttft_max = ttft.empty() ? 0 : ttft.back();
    const double itl_ratio = before.p50 > 0 ? during.p99 / before.p50 : 0;
    fprintf(stderr, "  burst: itl p50 %.2f ms before, p99 %.2f ms during (%.1fx); ttft p50 %.1f max %.1f ms, ideal max "
                    "%.1f ms\n", before.p50, during.p99, itl_ratio, percentile(ttft, 50), ttft_max, ideal_max);

    std::string table = strprintf("burst: %lld streams decode (prompts of %lld tokens), then %lld prompts of %lld tokens "
                                  "at once; engine prefill %.0f tok/s\n",
                                  (long long)o.decoders, (long long)o.prompt_tokens, (long long)o.burst,
                                  (long long)o.burst_tokens, prefill_tok_s);
    table += strprintf("%-16s %10s %10s %10s %9s %6s\n", "decoding streams", "itl_ms_p50", "itl_ms_p99", "itl_ms_max",
                       "window_s", "gaps");
    for (const auto& [name, g] : {std::pair<const char*, gap_stats>{"steady", before}, {"during burst", during}})
        table += strprintf("%-16s %10.2f %10.2f %10.2f %9.2f %6lld\n", name, g.p50, g.p99, g.max, g.window_s,
                           (long long)g.gaps);
    table += strprintf("itl p99 during the burst / steady p50: %.1fx\n", itl_ratio);
    table += strprintf("%6s %13s %10s %10s %8s\n", "prompt", "prompt_tokens", "ttft_ms", "ideal_ms", "ratio");
    table += rows;
    table += strprintf("burst prompts: ttft p50 %.1f ms, max %.1f ms; ideal max %.1f ms (max / ideal %.2fx, worst "
                       "prompt %.2fx); burst prefill %.2f s (first sent -> last first token)\n",
                       percentile(ttft, 50), ttft_max, ideal_max, ideal_max > 0 ? ttft_max / ideal_max : 0.0, worst,
                       burst_to - burst_from);

    scenario_report rep;
    rep.key = "burst";
    rep.json = {{"decoders", o.decoders},
                {"decoder_prompt_tokens", o.prompt_tokens},
                {"burst", o.burst},
                {"burst_tokens", o.burst_tokens},
                {"prefill_tok_s", prefill_tok_s},
                {"steady", gap_json(before)},
                {"during_burst", gap_json(during)},
                {"itl_ratio", itl_ratio},
                {"ttft_ms_p50", percentile(ttft, 50)},
                {"ttft_ms_max", ttft_max},
                {"ideal_ttft_ms_max", ideal_max},
                {"ttft_max_over_ideal", ideal_max > 0 ? ttft_max / ideal_max : 0.0},
                {"worst_ttft_over_ideal", worst},
                {"burst_prefill_s", burst_to - burst_from},
                {"prompts", prompts}};
    rep.table = table;
    return rep;
}

}  // namespace tansy
