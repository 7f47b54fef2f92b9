// tansy bench --serve scenarios: second-turn, agent and cache-decode (the prefix cache), and what they share.
// burst is in bench_burst.cpp.
#include "cli/bench_scenarios.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/check.h"
#include "runtime/metrics.h"

namespace tansy {

using ojson = nlohmann::ordered_json;
using steady = std::chrono::steady_clock;

const std::vector<std::string>& scenario_names() {
    static const std::vector<std::string> names = {"rounds", "second-turn", "agent", "burst", "cache-decode"};
    return names;
}

// note: a reply re-rendered as an assistant message may take more tokens than were generated (ids beyond the
// tokenizer come back as U+FFFD, up to 3 byte tokens each), hence 4 per reply token.
int64_t scenario_context(const std::string& name, const scenario_options& o) {
    const int64_t margin = 256;
    if (name == "second-turn")
        return o.conversation_tokens + 5 * SECOND_TURN_REPLY + SECOND_TURN_FOLLOW_UP + margin;
    if (name == "agent") return o.turns * (o.turn_tokens + 5 * AGENT_REPLY + 32) + margin;
    if (name == "burst") return std::max(o.burst_tokens + BURST_REPLY, o.prompt_tokens + 4096) + margin;
    if (name == "cache-decode" || name == "rounds") return o.prompt_tokens + o.max_tokens + 64;
    TANSY_ABORT("unknown scenario '%s'", name.c_str());
}

int64_t scenario_batch(const std::string& name, const scenario_options& o) {
    if (name == "burst") return o.decoders + o.burst;
    if (name == "cache-decode") return o.decoders;
    return 1;
}

std::string scenario_body(const ojson& messages, int64_t max_tokens, bool cache_prompt, uint64_t seed) {
    ojson j = {{"messages", messages},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"max_tokens", max_tokens},
               {"ignore_eos", true},
               {"temperature", 0},
               {"seed", seed},
               {"chat_template_kwargs", {{"enable_thinking", false}}}};
    if (!cache_prompt) j["cache_prompt"] = false;
    return j.dump();
}

void check_stream(const stream_timing& s, const std::string& what) {
    if (!s.ok) fail("bench --serve: %s failed: %s", what.c_str(), s.error.c_str());
}

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

namespace {

ojson message(const char* role, const std::string& content) { return {{"role", role}, {"content", content}}; }

stream_timing send(http_client& c, const scenario_target& t, const std::string& body, const std::string& what) {
    stream_timing s = timed_stream(c, t.path, body, steady::now());
    check_stream(s, what);
    return s;
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

}  // namespace

// ---- second-turn

// Each repeat is a new conversation: turn 1 (stored by the cache), then turn 2 with the cache (restores turn 1),
// then the same turn 2 cold. The cold request neither restores nor stores, so it cannot change what the next
// cached request finds; a new conversation per repeat keeps every cached request a true second turn (a repeat of
// the same turn 2 would find its own first run's entry).
scenario_report run_second_turn(const scenario_target& t, const scenario_options& o) {
    const int64_t reply = std::min(o.max_tokens, SECOND_TURN_REPLY);
    const int64_t sys_tokens = o.conversation_tokens / 4, user_tokens = o.conversation_tokens - sys_tokens;
    http_client client(t.host, t.port);
    struct run {
        int64_t turn1_prompt = 0, turn1_cached = 0, turn2_prompt = 0, cached = 0, cold_cached = 0;
        double turn1_ttft = 0, ttft_cached = 0, ttft_cold = 0;
    };
    std::vector<run> runs;
    for (int r = 1; r <= o.repeats; r++) {
        const uint64_t seed = 0x5ec0dULL * 1000 + (uint64_t)r * 16;
        ojson messages = ojson::array(
            {message("system", t.prompts->make(strprintf("System prompt of conversation %d:", r), seed, sys_tokens)),
             message("user", t.prompts->make(strprintf("First question of conversation %d:", r), seed + 1, user_tokens))});
        const std::string what = strprintf("second-turn: conversation %d", r);
        const stream_timing t1 = send(client, t, scenario_body(messages, reply, true, seed), what + " turn 1");
        messages.push_back(message("assistant", t1.content));
        messages.push_back(message("user", t.prompts->make(strprintf("Follow-up of conversation %d:", r), seed + 2,
                                                           SECOND_TURN_FOLLOW_UP)));
        const stream_timing cached = send(client, t, scenario_body(messages, reply, true, seed + 3), what + " turn 2");
        const stream_timing cold =
            send(client, t, scenario_body(messages, reply, false, seed + 3), what + " turn 2 (cold)");
        run x;
        x.turn1_prompt = t1.prompt_tokens, x.turn1_cached = t1.cached_tokens, x.turn1_ttft = t1.ttft_s * 1e3;
        x.turn2_prompt = cached.prompt_tokens, x.cached = cached.cached_tokens, x.ttft_cached = cached.ttft_s * 1e3;
        x.cold_cached = cold.cached_tokens, x.ttft_cold = cold.ttft_s * 1e3;
        runs.push_back(x);
        fprintf(stderr,
                "  second-turn %d: turn 1 %lld tokens ttft %.1f ms; turn 2 %lld tokens: cached %lld tokens ttft %.1f ms, "
                "cold ttft %.1f ms (%.1f%%)\n",
                r, (long long)x.turn1_prompt, x.turn1_ttft, (long long)x.turn2_prompt, (long long)x.cached,
                x.ttft_cached, x.ttft_cold, 100 * ratio(x.ttft_cached, x.ttft_cold));
    }

    std::vector<double> cached_ms, cold_ms, turn1_ms, cached_tokens, prompt_tokens;
    int64_t cold_cached = 0;
    ojson jruns = ojson::array();
    std::string table = strprintf("second-turn: conversations of ~%lld tokens (system + user), a reply of %lld tokens, a "
                                  "follow-up of ~%lld tokens; turn 2 with the cache vs cold (\"cache_prompt\": false)\n",
                                  (long long)o.conversation_tokens, (long long)reply, (long long)SECOND_TURN_FOLLOW_UP);
    table += strprintf("%4s %12s %13s %12s %13s %14s %12s %11s\n", "run", "turn1_prompt", "turn1_ttft_ms", "turn2_prompt",
                       "cached_tokens", "ttft_cached_ms", "ttft_cold_ms", "cached/cold");
    for (size_t i = 0; i < runs.size(); i++) {
        const run& x = runs[i];
        cached_ms.push_back(x.ttft_cached), cold_ms.push_back(x.ttft_cold), turn1_ms.push_back(x.turn1_ttft);
        cached_tokens.push_back((double)x.cached), prompt_tokens.push_back((double)x.turn2_prompt);
        cold_cached = std::max(cold_cached, x.cold_cached);
        table += strprintf("%4zu %12lld %13.1f %12lld %13lld %14.1f %12.1f %10.1f%%\n", i + 1, (long long)x.turn1_prompt,
                           x.turn1_ttft, (long long)x.turn2_prompt, (long long)x.cached, x.ttft_cached, x.ttft_cold,
                           100 * ratio(x.ttft_cached, x.ttft_cold));
        jruns.push_back({{"turn1_prompt_tokens", x.turn1_prompt},
                         {"turn1_cached_tokens", x.turn1_cached},
                         {"turn1_ttft_ms", x.turn1_ttft},
                         {"prompt_tokens", x.turn2_prompt},
                         {"cached_tokens", x.cached},
                         {"cold_cached_tokens", x.cold_cached},
                         {"ttft_cached_ms", x.ttft_cached},
                         {"ttft_cold_ms", x.ttft_cold}});
    }
    const double mc = median(cached_ms), md = median(cold_ms);
    table += strprintf("%4s %12s %13.1f %12.0f %13.0f %14.1f %12.1f %10.1f%%\n", "med", "", median(turn1_ms),
                       median(prompt_tokens), median(cached_tokens), mc, md, 100 * ratio(mc, md));

    scenario_report rep;
    rep.key = "second_turn";
    rep.json = {{"conversation_tokens", o.conversation_tokens},
                {"reply_tokens", reply},
                {"repeats", o.repeats},
                {"prompt_tokens", median(prompt_tokens)},
                {"cached_tokens", median(cached_tokens)},
                {"cold_cached_tokens", cold_cached},
                {"turn1_ttft_ms", median(turn1_ms)},
                {"ttft_cached_ms", mc},
                {"ttft_cold_ms", md},
                {"ratio", ratio(mc, md)},
                {"runs", jruns}};
    rep.table = table;
    return rep;
}

prompt_sums read_prompt_sums(int port) {
    http_client c("127.0.0.1", port, 30);
    std::string body, err;
    if (c.get("/metrics", &body, &err) != 200) fail("bench --serve: GET /metrics: %s", err.c_str());
    prompt_sums s;
    std::istringstream in(body);
    std::string name;
    double v = 0;
    for (std::string line; std::getline(in, line);) {
        std::istringstream l(line);
        if (!(l >> name >> v)) continue;
        if (name == "tansy_queue_wait_seconds_sum") s.queue_s = v;
        if (name == "tansy_prefill_seconds_sum") s.prefill_s = v;
        if (name == "tansy_prefill_seconds_count") s.n = v;
        if (name == "tansy_time_to_first_token_seconds_sum") s.ttft_s = v;
        if (name == "tansy_time_to_first_token_seconds_count") s.ttft_n = v;
    }
    return s;
}

// ---- agent

namespace {

struct agent_turn {
    int64_t prompt_tokens = 0, cached_tokens = 0;
    double ttft_ms = 0;
};
struct agent_run {
    std::vector<agent_turn> turns;
    double queue_ms = 0, steps_ms = 0;  // the server's side of the TTFTs (prompt_sums), in all
};

// One replay: turn 1 is a system prompt and a task (~turn_tokens together); every later turn adds the previous
// reply as an assistant message and a tool result of ~turn_tokens.
agent_run agent_replay(const scenario_target& t, const scenario_options& o, bool cache, const char* run) {
    const int64_t reply = std::min(o.max_tokens, AGENT_REPLY);
    const uint64_t seed = (cache ? 0xa9e47ULL : 0xa9e48ULL) * 100000;
    http_client client(t.host, t.port);
    ojson messages = ojson::array(
        {message("system", t.prompts->make(strprintf("Agent instructions (%s run):", run), seed, o.turn_tokens / 2)),
         message("user", t.prompts->make(strprintf("Task (%s run):", run), seed + 1, o.turn_tokens - o.turn_tokens / 2))});
    std::vector<agent_turn> turns;
    const prompt_sums before = read_prompt_sums(t.port);
    for (int64_t k = 1; k <= o.turns; k++) {
        const std::string what = strprintf("agent: %s run, turn %lld", run, (long long)k);
        const stream_timing s = send(client, t, scenario_body(messages, reply, cache, seed + 2 * (uint64_t)k), what);
        turns.push_back({s.prompt_tokens, s.cached_tokens, s.ttft_s * 1e3});
        if (k == o.turns) break;
        messages.push_back(message("assistant", s.content));
        messages.push_back(message("tool", t.prompts->make(strprintf("Tool result %lld (%s run):", (long long)k, run),
                                                           seed + 2 * (uint64_t)k + 1, o.turn_tokens)));
    }
    const prompt_sums after = read_prompt_sums(t.port);
    agent_run r{turns, 1e3 * (after.queue_s - before.queue_s), 1e3 * (after.prefill_s - before.prefill_s)};
    double total = 0;
    int64_t cached = 0;
    for (const agent_turn& x : turns) total += x.ttft_ms, cached += x.cached_tokens;
    fprintf(stderr, "  agent, %s: %lld turns, last prompt %lld tokens, prefill %.1f ms in all (server: queue %.1f ms, "
            "prompt steps %.1f ms), %lld cached tokens\n", run, (long long)o.turns, (long long)turns.back().prompt_tokens,
            total, r.queue_ms, r.steps_ms, (long long)cached);
    return r;
}

}  // namespace

// The run without the cache goes first, with text of its own: nothing it does can help the cached run.
scenario_report run_agent(const scenario_target& t, const scenario_options& o) {
    const agent_run cold_run = agent_replay(t, o, false, "uncached");
    const agent_run warm_run = agent_replay(t, o, true, "cached");
    const std::vector<agent_turn>&cold = cold_run.turns, &warm = warm_run.turns;
    struct sums {
        double prefill_ms = 0;
        int64_t cached = 0, prompt = 0;
        std::vector<double> ttft;
    };
    auto sum = [](const std::vector<agent_turn>& v) {
        sums s;
        for (const agent_turn& x : v) {
            s.prefill_ms += x.ttft_ms, s.cached += x.cached_tokens, s.prompt += x.prompt_tokens;
            s.ttft.push_back(x.ttft_ms);
        }
        return s;
    };
    const sums c = sum(cold), w = sum(warm);

    std::string table = strprintf("agent: %lld turns, each adding a reply of %lld tokens and a tool result of ~%lld "
                                  "tokens; the replay with the cache vs without (\"cache_prompt\": false)\n",
                                  (long long)o.turns, (long long)std::min(o.max_tokens, AGENT_REPLY),
                                  (long long)o.turn_tokens);
    table += strprintf("%4s %13s %13s %14s %16s\n", "turn", "prompt_tokens", "cached_tokens", "ttft_cached_ms",
                       "ttft_uncached_ms");
    ojson jturns = ojson::array();
    for (size_t k = 0; k < warm.size(); k++) {
        table += strprintf("%4zu %13lld %13lld %14.1f %16.1f\n", k + 1, (long long)warm[k].prompt_tokens,
                           (long long)warm[k].cached_tokens, warm[k].ttft_ms, cold[k].ttft_ms);
        jturns.push_back({{"prompt_tokens", warm[k].prompt_tokens},
                          {"cached_tokens", warm[k].cached_tokens},
                          {"ttft_cached_ms", warm[k].ttft_ms},
                          {"uncached_prompt_tokens", cold[k].prompt_tokens},
                          {"uncached_cached_tokens", cold[k].cached_tokens},
                          {"ttft_uncached_ms", cold[k].ttft_ms}});
    }
    table += strprintf("prefill (sum of TTFTs): cached %.1f ms, uncached %.1f ms (%.1f%%); cached tokens %lld of %lld "
                       "prompt tokens (uncached run: %lld); TTFT p50 cached %.1f ms, uncached %.1f ms\n",
                       w.prefill_ms, c.prefill_ms, 100 * ratio(w.prefill_ms, c.prefill_ms), (long long)w.cached,
                       (long long)w.prompt, (long long)c.cached, percentile(w.ttft, 50), percentile(c.ttft, 50));
    table += strprintf("the server's side of them: prompt steps cached %.1f ms, uncached %.1f ms (%.1f%%); admission "
                       "waits %.1f / %.1f ms; the rest is HTTP, templating, tokenizing and the first token's delivery\n",
                       warm_run.steps_ms, cold_run.steps_ms, 100 * ratio(warm_run.steps_ms, cold_run.steps_ms),
                       warm_run.queue_ms, cold_run.queue_ms);

    scenario_report rep;
    rep.key = "agent";
    rep.json = {{"turns", o.turns},
                {"turn_tokens", o.turn_tokens},
                {"reply_tokens", std::min(o.max_tokens, AGENT_REPLY)},
                {"last_prompt_tokens", warm.back().prompt_tokens},
                {"prefill_ms_cached", w.prefill_ms},
                {"prefill_ms_uncached", c.prefill_ms},
                {"ratio", ratio(w.prefill_ms, c.prefill_ms)},
                {"cached_tokens", w.cached},
                {"uncached_cached_tokens", c.cached},
                {"prompt_tokens", w.prompt},
                {"ttft_ms_p50_cached", percentile(w.ttft, 50)},
                {"ttft_ms_p50_uncached", percentile(c.ttft, 50)},
                {"steps_ms_cached", warm_run.steps_ms},
                {"steps_ms_uncached", cold_run.steps_ms},
                {"queue_ms_cached", warm_run.queue_ms},
                {"queue_ms_uncached", cold_run.queue_ms},
                {"per_turn", jturns}};
    rep.table = table;
    return rep;
}

// ---- cache-decode

// Rounds of `decoders` streams started together. The rate counts each stream's tokens while every stream is
// decoding: from the last stream's first token to the first stream's last one (prefill and stragglers left out).
decode_rate measure_decode(const scenario_target& t, const scenario_options& o, const std::string& label) {
    std::vector<double> rates, per_stream, itl;
    for (int r = 1; r <= o.repeats; r++) {
        std::vector<std::string> bodies;
        for (int64_t i = 0; i < o.decoders; i++) {
            const uint64_t seed = 0xdec0ULL * 1000000 + (uint64_t)r * 10000 + (uint64_t)i;
            const std::string tag = strprintf("Stream %lld of round %d (%s):", (long long)i + 1, r, label.c_str());
            bodies.push_back(scenario_body(ojson::array({message("user", t.prompts->make(tag, seed, o.prompt_tokens))}),
                                           o.max_tokens, true, seed));
        }
        const round_result res = run_round(t.host, t.port, t.path, bodies);
        double w0 = 0, w1 = 1e300;
        std::vector<double> rs;
        for (size_t i = 0; i < res.streams.size(); i++) {
            const stream_timing& s = res.streams[i];
            check_stream(s, strprintf("cache-decode (%s): stream %zu", label.c_str(), i + 1));
            w0 = std::max(w0, s.first_s), w1 = std::min(w1, s.last_s);
            rs.push_back(s.tok_s());
            for (double g : s.itl_s) itl.push_back(g * 1e3);
        }
        double tokens = 0;
        for (const stream_timing& s : res.streams) {
            const double per_event =
                s.text_events > 1 ? (double)(s.completion_tokens - 1) / (double)(s.text_events - 1) : 1.0;
            for (double e : s.event_s) tokens += e > w0 && e <= w1 ? per_event : 0.0;
        }
        if (w1 <= w0) {
            fprintf(stderr, "tansy bench --serve: warning: cache-decode (%s): round %d: the streams never all decoded "
                            "at once (raise --max-tokens)\n", label.c_str(), r);
            continue;
        }
        rates.push_back(tokens / (w1 - w0));
        per_stream.push_back(median(rs));
        fprintf(stderr, "  cache-decode (%s) round %d: %.1f tok/s over %.2f s with all %lld streams decoding\n",
                label.c_str(), r, rates.back(), w1 - w0, (long long)o.decoders);
    }
    decode_rate d;
    d.rounds = (int)rates.size();
    d.tok_s = median(rates);
    d.per_stream_tok_s = median(per_stream);
    d.itl_ms_p50 = percentile(itl, 50);
    d.itl_ms_p99 = percentile(itl, 99);
    return d;
}

scenario_report cache_decode_report(const decode_rate& on, const decode_rate& off, const scenario_options& o) {
    auto row = [](const char* name, const decode_rate& d) {
        return strprintf("%-14s %10.1f %16.1f %10.2f %10.2f %6d\n", name, d.tok_s, d.per_stream_tok_s, d.itl_ms_p50,
                         d.itl_ms_p99, d.rounds);
    };
    std::string table = strprintf("cache-decode: %lld streams (prompts of %lld tokens, %lld tokens each), decode rate "
                                  "while all decode; a server with the prefix cache vs one without\n",
                                  (long long)o.decoders, (long long)o.prompt_tokens, (long long)o.max_tokens);
    table += strprintf("%-14s %10s %16s %10s %10s %6s\n", "server", "tok_s", "per_stream_tok_s", "itl_ms_p50",
                       "itl_ms_p99", "rounds");
    table += row("cache on", on) + row("cache off", off);
    table += strprintf("cache on / off: %.1f%%\n", 100 * ratio(on.tok_s, off.tok_s));
    auto j = [](const decode_rate& d) {
        return ojson{{"tok_s", d.tok_s},
                     {"per_stream_tok_s", d.per_stream_tok_s},
                     {"itl_ms_p50", d.itl_ms_p50},
                     {"itl_ms_p99", d.itl_ms_p99},
                     {"rounds", d.rounds}};
    };
    scenario_report rep;
    rep.key = "cache_decode";
    rep.json = {{"streams", o.decoders},
                {"prompt_tokens", o.prompt_tokens},
                {"max_tokens", o.max_tokens},
                {"cache_on", j(on)},
                {"cache_off", j(off)},
                {"ratio", ratio(on.tok_s, off.tok_s)}};
    rep.table = table;
    return rep;
}

}  // namespace tansy
