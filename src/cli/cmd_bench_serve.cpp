// tansy bench --serve: served speed. Starts the server in this process on a free loopback port and drives it
// over HTTP with streaming clients (server/load_client.h); beside each row, the engine's own decode rate at the
// same batch size (runtime/bench.h bench_decode on the server's engine, measured while the server is idle), so
// the cost of serving (HTTP, scheduling, detokenising, SSE) shows as the gap between the two. Those are the
// rounds; --scenario adds the prefix cache's and mixed steps' scenarios (cli/bench_scenarios.h).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <memory>
#include <sstream>

#include "cli/bench_prompts.h"
#include "cli/bench_scenarios.h"
#include "cli/commands.h"
#include "core/check.h"
#include "runtime/bench.h"
#include "runtime/metrics.h"
#include "server/http.h"
#include "server/http_client.h"
#include "server/load_client.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

namespace {

std::vector<int64_t> positive_list(const std::string& s, const char* what) {
    std::vector<int64_t> v;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        char* end = nullptr;
        const long long x = strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end || x <= 0) fail("bench --serve: %s must be a comma-separated list of positive integers", what);
        v.push_back(x);
    }
    if (v.empty()) fail("bench --serve: %s is empty", what);
    return v;
}

struct sampling_mode {
    std::string name;
    double temperature = 0, top_p = 1;
    int top_k = 0;
};

// greedy: temperature 0. sampled: Qwen's recommended non-thinking defaults (temperature 0.7, top_p 0.8, top_k 20).
std::vector<sampling_mode> sampling_modes(const std::string& s) {
    std::vector<sampling_mode> v;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item == "greedy") v.push_back({"greedy", 0.0, 1.0, 0});
        else if (item == "sampled") v.push_back({"sampled", 0.7, 0.8, 20});
        else fail("bench --serve: --sampling takes greedy and/or sampled, got '%s'", item.c_str());
    }
    if (v.empty()) fail("bench --serve: --sampling is empty");
    return v;
}

std::string request_body(const std::string& content, const sampling_mode& m, int64_t max_tokens, uint64_t seed) {
    nlohmann::ordered_json j = {
        {"messages", nlohmann::ordered_json::array({{{"role", "user"}, {"content", content}}})},
        {"stream", true},
        {"stream_options", {{"include_usage", true}}},
        {"max_tokens", max_tokens},
        {"ignore_eos", true},  // every stream runs to max_tokens (server/openai.h)
        {"temperature", m.temperature},
        {"seed", seed}};
    if (m.temperature > 0) {
        j["top_p"] = m.top_p;
        j["top_k"] = m.top_k;
    }
    return j.dump();
}

struct serve_row {
    int64_t concurrency = 0;
    std::string sampling;
    double agg_tok_s = 0, per_stream_tok_s = 0;
    double itl_ms_p50 = 0, itl_ms_p99 = 0, ttft_ms_p50 = 0, ttft_ms_p99 = 0;
    double engine_tok_s = 0;
    double round_tok_s = 0;  // the engine's own figures composed for this round's work (round_tok_s below)
    int64_t tokens = 0, prompt_tokens = 0;  // completion tokens of the round; mean prompt tokens per stream
    double wall_s = 0;
    // the server's side of the TTFT (its /metrics over the round): mean wait for admission, mean time of the
    // steps that processed a stream's prompt, and mean time from a request's arrival to its first generated token
    // (the rest of that is HTTP, templating and tokenizing; ttft beyond it: text held back, SSE, the client)
    double queue_ms_mean = 0, prefill_ms_mean = 0, server_ttft_ms_mean = 0;
};

// What the engine alone does with a round's work, from its measured rates: C prompts of P tokens prefilled at
// its prefill rate, then N decode steps at batch C, nothing overlapped. (The scheduler may overlap the two a
// little in mixed steps.) A served aggregate near it means the server costs nothing on top of the engine.
double round_tok_s(int64_t C, int64_t P, int64_t N, double prefill_tok_s, double engine_tok_s) {
    if (prefill_tok_s <= 0 || engine_tok_s <= 0) return 0;
    return (double)(C * N) / ((double)(C * P) / prefill_tok_s + (double)(C * N) / engine_tok_s);
}

serve_row summarise(const round_result& r, int64_t C, const std::string& sampling, double engine_tok_s) {
    serve_row row;
    row.concurrency = C;
    row.sampling = sampling;
    row.tokens = r.tokens();
    row.wall_s = r.wall_s;
    row.agg_tok_s = r.wall_s > 0 ? (double)row.tokens / r.wall_s : 0.0;
    std::vector<double> rates, itl, ttft;
    int64_t prompt = 0;
    for (const stream_timing& s : r.streams) {
        rates.push_back(s.tok_s());
        ttft.push_back(s.ttft_s * 1e3);
        for (double g : s.itl_s) itl.push_back(g * 1e3);
        prompt += s.prompt_tokens;
    }
    row.prompt_tokens = r.streams.empty() ? 0 : prompt / (int64_t)r.streams.size();
    row.per_stream_tok_s = percentile(rates, 50);
    row.itl_ms_p50 = percentile(itl, 50);
    row.itl_ms_p99 = percentile(itl, 99);
    row.ttft_ms_p50 = percentile(ttft, 50);
    row.ttft_ms_p99 = percentile(ttft, 99);
    row.engine_tok_s = engine_tok_s;
    return row;
}

// A failed stream makes the figures meaningless: stop with the first error.
void check_round(const round_result& r, int64_t max_tokens, const char* what) {
    for (size_t i = 0; i < r.streams.size(); i++) {
        const stream_timing& s = r.streams[i];
        if (!s.ok) fail("bench --serve: %s: stream %zu of %zu failed: %s", what, i + 1, r.streams.size(), s.error.c_str());
        if (s.completion_tokens != max_tokens)
            fprintf(stderr, "tansy bench --serve: warning: %s: stream %zu got %lld tokens, not %lld (finish %s)\n", what,
                    i + 1, (long long)s.completion_tokens, (long long)max_tokens, s.finish_reason.c_str());
    }
}

// C streams at once per concurrency and sampling mode, each prompt its own text.
std::vector<serve_row> run_rounds(int port, const prompt_maker& prompts, const std::vector<int64_t>& concurrency,
                                  const std::vector<sampling_mode>& modes, int64_t prompt_tokens, int64_t max_tokens,
                                  const std::map<std::pair<int64_t, std::string>, double>& engine_tok_s,
                                  double prefill_tok_s) {
    std::vector<serve_row> rows;
    uint64_t round_no = 0;
    for (int64_t C : concurrency) {
        for (const sampling_mode& m : modes) {
            round_no++;
            std::vector<std::string> bodies;
            for (int64_t i = 0; i < C; i++) {
                const uint64_t seed = round_no * 1000003u + (uint64_t)i;
                const std::string tag = strprintf("Request %lld of round %llu:", (long long)i + 1, (unsigned long long)round_no);
                bodies.push_back(request_body(prompts.make(tag, seed, prompt_tokens), m, max_tokens, seed));
            }
            const std::string label = strprintf("concurrency %lld %s", (long long)C, m.name.c_str());
            const prompt_sums before = read_prompt_sums(port);
            const round_result r = run_round("127.0.0.1", port, "/v1/chat/completions", bodies);
            check_round(r, max_tokens, label.c_str());
            const prompt_sums after = read_prompt_sums(port);
            rows.push_back(summarise(r, C, m.name, engine_tok_s.at({C, m.name})));
            serve_row& x = rows.back();
            x.round_tok_s = round_tok_s(C, x.prompt_tokens, max_tokens, prefill_tok_s, x.engine_tok_s);
            if (const double n = after.n - before.n; n > 0) {
                x.queue_ms_mean = 1e3 * (after.queue_s - before.queue_s) / n;
                x.prefill_ms_mean = 1e3 * (after.prefill_s - before.prefill_s) / n;
            }
            if (const double n = after.ttft_n - before.ttft_n; n > 0)
                x.server_ttft_ms_mean = 1e3 * (after.ttft_s - before.ttft_s) / n;
            fprintf(stderr,
                    "  %-24s %9.1f tok/s (engine %9.1f, round %9.1f)  stream %7.1f tok/s  itl p50 %7.2f ms p99 %7.2f ms  "
                    "ttft p50 %8.1f ms p99 %8.1f ms (server: queue %.1f ms, prompt steps %.1f ms, first token %.1f ms, "
                    "means)  (%lld tokens in %.2f s, prompts %lld tokens)\n",
                    label.c_str(), x.agg_tok_s, x.engine_tok_s, x.round_tok_s, x.per_stream_tok_s, x.itl_ms_p50,
                    x.itl_ms_p99, x.ttft_ms_p50, x.ttft_ms_p99, x.queue_ms_mean, x.prefill_ms_mean, x.server_ttft_ms_mean,
                    (long long)x.tokens, x.wall_s, (long long)x.prompt_tokens);
        }
    }
    return rows;
}

std::vector<std::string> scenario_list(const std::string& s) {
    std::vector<std::string> v;
    std::stringstream ss(s);
    std::string item;
    const std::vector<std::string>& known = scenario_names();
    while (std::getline(ss, item, ',')) {
        if (std::find(known.begin(), known.end(), item) == known.end())
            fail("bench --serve: --scenario takes rounds, second-turn, agent, burst, cache-decode (a list), got '%s'",
                 item.c_str());
        if (std::find(v.begin(), v.end(), item) == v.end()) v.push_back(item);
    }
    if (v.empty()) fail("bench --serve: --scenario is empty");
    return v;
}

int64_t positive(const arg_parser& p, const char* name, int64_t dflt) {
    const int64_t x = p.integer(name, dflt);
    if (x < 1) fail("bench --serve: %s must be >= 1", name);
    return x;
}

std::string rounds_table(const std::vector<serve_row>& rows, int64_t prompt_tokens, int64_t max_tokens) {
    auto pct = [](double a, double b) { return b > 0 ? 100 * a / b : 0.0; };
    std::string t = strprintf("%11s %8s %10s %16s %10s %10s %11s %11s %12s %8s %11s %7s\n", "concurrency", "sampling",
                              "agg_tok_s", "per_stream_tok_s", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99",
                              "engine_tok_s", "%engine", "round_tok_s", "%round");
    for (const serve_row& r : rows)
        t += strprintf("%11lld %8s %10.1f %16.1f %10.2f %10.2f %11.1f %11.1f %12.1f %7.1f%% %11.1f %6.1f%%\n",
                       (long long)r.concurrency, r.sampling.c_str(), r.agg_tok_s, r.per_stream_tok_s, r.itl_ms_p50,
                       r.itl_ms_p99, r.ttft_ms_p50, r.ttft_ms_p99, r.engine_tok_s, pct(r.agg_tok_s, r.engine_tok_s),
                       r.round_tok_s, pct(r.agg_tok_s, r.round_tok_s));
    t += strprintf("prompts of %lld tokens, %lld completion tokens per stream; engine_tok_s: tansy bench's decode at batch "
                   "C and context %lld; round_tok_s: the engine's prefill and decode rates composed for the round's work\n",
                   (long long)prompt_tokens, (long long)max_tokens, (long long)prompt_tokens);
    return t;
}

nlohmann::ordered_json rounds_json(const std::vector<serve_row>& rows) {
    nlohmann::ordered_json a = nlohmann::ordered_json::array();
    for (const serve_row& r : rows)
        a.push_back({{"concurrency", r.concurrency},
                     {"sampling", r.sampling},
                     {"agg_tok_s", r.agg_tok_s},
                     {"per_stream_tok_s", r.per_stream_tok_s},
                     {"itl_ms_p50", r.itl_ms_p50},
                     {"itl_ms_p99", r.itl_ms_p99},
                     {"ttft_ms_p50", r.ttft_ms_p50},
                     {"ttft_ms_p99", r.ttft_ms_p99},
                     {"engine_tok_s", r.engine_tok_s},
                     {"round_tok_s", r.round_tok_s},
                     {"queue_ms_mean", r.queue_ms_mean},
                     {"prefill_ms_mean", r.prefill_ms_mean},
                     {"server_ttft_ms_mean", r.server_ttft_ms_mean},
                     {"completion_tokens", r.tokens},
                     {"wall_s", r.wall_s}});
    return a;
}

// One warm-up request: the first request's one-time costs (graph captures, first allocations) stay out of
// every figure.
void warm_up(int port, const prompt_maker& prompts, int64_t prompt_tokens, int64_t max_tokens, const sampling_mode& m) {
    const int64_t n = std::min<int64_t>(max_tokens, 16);
    const round_result w = run_round("127.0.0.1", port, "/v1/chat/completions",
                                     {request_body(prompts.make("Warm-up:", 0, prompt_tokens), m, n, 0)});
    check_round(w, n, "warm-up");
    fprintf(stderr, "  warm-up: %lld prompt tokens, ttft %.1f ms\n", (long long)w.streams[0].prompt_tokens,
            w.streams[0].ttft_s * 1e3);
}

}  // namespace

int cmd_bench_serve(int argc, char** argv) {
    arg_parser p("bench --serve", "[--synthetic CONFIG.json | --model DIR] [options]",
                 "Served speed: starts `tansy serve` in this process on a free loopback port and, for each concurrency\n"
                 "C and sampling mode, sends C streamed chat completions at once (distinct prompts of about\n"
                 "--prompt-tokens tokens after the chat template, each running to exactly --max-tokens tokens with\n"
                 "\"ignore_eos\"; one warm-up request first). Per row:\n"
                 "  agg_tok_s         completion tokens of all C streams / wall time of the round\n"
                 "  per_stream_tok_s  median over streams of (tokens - 1) / (last token - first token)\n"
                 "  itl_ms_p50/p99    gaps between streamed text events per token, over all streams\n"
                 "  ttft_ms_p50/p99   request sent -> first text event (includes waiting and prefill)\n"
                 "  engine_tok_s      tansy bench's decode rate of the server's engine at batch C and context\n"
                 "                    --prompt-tokens with the round's sampling, measured before serving: the\n"
                 "                    ceiling agg_tok_s tends to in decode\n"
                 "  round_tok_s       the engine's own figures composed for the round's work: C prompts at its\n"
                 "                    prefill rate for --prompt-tokens (measured before serving), then\n"
                 "                    --max-tokens steps at engine_tok_s: C x N / (C x P / prefill + C x N /\n"
                 "                    engine_tok_s); what the server would give if it cost nothing on top\n"
                 "  queue_ms_mean,    the server's share of the TTFT over the round (its /metrics): a stream's mean\n"
                 "  prefill_ms_mean,  wait for admission, the mean time of the steps that processed its prompt, and\n"
                 "  server_ttft_ms_mean  the mean time from its arrival to its first generated token (ttft beyond\n"
                 "                    that: text held back by the detokenizer or parsers, the SSE write, the client)\n"
                 "Token counts come from the usage chunk (stream_options.include_usage). Progress goes to stderr.\n"
                 "\n"
                 "Those are the rounds (--scenario rounds, the default). Other scenarios, in the order listed, on the\n"
                 "same server (greedy, thinking off, \"ignore_eos\"; cached_tokens from usage.prompt_tokens_details):\n"
                 "  second-turn   a conversation of --conversation-tokens (system + user), a reply of 64 tokens, then\n"
                 "                turn 2 (+ the reply as an assistant message + a ~100-token question): its TTFT with\n"
                 "                the cache and cold (the same request with \"cache_prompt\": false); a new\n"
                 "                conversation per --repeats, medians reported\n"
                 "  agent         --turns turns, each adding the last reply (32 tokens) and a tool result of\n"
                 "                --turn-tokens: the sum of the TTFTs (prefill time) with the cache vs a replay of\n"
                 "                other text with \"cache_prompt\": false (run first)\n"
                 "  burst         --decoders streams decode (prompts of --prompt-tokens); after --steady-tokens\n"
                 "                tokens each, --burst prompts of --burst-tokens arrive at once: the streams'\n"
                 "                inter-token p50 before vs p99 during the burst (until the last prompt's first\n"
                 "                token), the prompts' TTFTs vs the ideal (the i-th to start: the tokens of the\n"
                 "                first i at the engine's prefill rate for --burst-tokens, measured before serving)\n"
                 "  cache-decode  decode rate of --decoders streams (--prompt-tokens, --max-tokens) while all decode,\n"
                 "                median of --repeats rounds, on this server and then, after every other\n"
                 "                scenario, on a second server started without the prefix cache\n"
                 "The server's context per sequence is the largest any chosen scenario needs (on cuda every state\n"
                 "has that capacity): measure the rounds on their own for figures comparable between runs.");
    p.option("--serve", "", "benchmark the server (this mode)");
    add_engine_options(p);
    add_synthetic_options(p);
    p.option("--scenario", "LIST", "rounds, second-turn, agent, burst, cache-decode (default rounds)")
        .option("--concurrency", "LIST", "rounds: concurrent streams per round (default 1,4,16,64,256)")
        .option("--sampling", "LIST", "rounds: greedy, sampled (temperature 0.7, top_p 0.8, top_k 20) or both (default\n"
                                      "                            greedy,sampled)")
        .option("--prompt-tokens", "N", "tokens of each prompt after the chat template (default 2048)")
        .option("--max-tokens", "N", "completion tokens per stream (default 256; caps the replies of second-turn, agent)")
        .option("--conversation-tokens", "N", "second-turn: tokens of turn 1 (default 16384)")
        .option("--repeats", "N", "second-turn: conversations; cache-decode: rounds per server (default 3)")
        .option("--turns", "N", "agent: turns (default 20)")
        .option("--turn-tokens", "N", "agent: tokens each turn adds (default 1024)")
        .option("--decoders", "N", "burst, cache-decode: decoding streams (default 16)")
        .option("--steady-tokens", "N", "burst: tokens per decoding stream timed before the burst (default 64)")
        .option("--burst", "N", "burst: prompts sent at once (default 16)")
        .option("--burst-tokens", "N", "burst: tokens of each burst prompt (default 8192)");
    // the server's (as serve's); --state-memory's cuda default holds 256 sequences of 2K tokens of the real model
    add_batch_options(p, "the most streams a chosen scenario runs", "half of available memory on cpu, 65536 on cuda");
    p.option("--engine-steps", "N", "decode steps per timed run of engine_tok_s (default 32)")
        .option("--engine-runs", "N", "timed runs of engine_tok_s and of burst's prefill rate, median reported (default 5,\n"
                                      "                            after 3 warm-up steps)")
        .option("--json", "", "print {\"serve\": [rows]} (and the setup) as JSON; other scenarios add a key each\n"
                              "                            (second_turn, agent, burst, cache_decode)");
    if (!p.parse(argc, argv)) return 0;

    const std::vector<std::string> scenarios = scenario_list(p.str("--scenario", "rounds"));
    auto chosen = [&](const char* name) { return std::find(scenarios.begin(), scenarios.end(), name) != scenarios.end(); };
    const bool rounds = chosen("rounds");
    const std::vector<int64_t> concurrency = positive_list(p.str("--concurrency", "1,4,16,64,256"), "--concurrency");
    const std::vector<sampling_mode> modes = sampling_modes(p.str("--sampling", "greedy,sampled"));
    const int64_t prompt_tokens = p.integer("--prompt-tokens", 2048), max_tokens = p.integer("--max-tokens", 256);
    if (prompt_tokens < 16) fail("bench --serve: --prompt-tokens must be >= 16 (the chat template alone takes some)");
    if (max_tokens < 1) fail("bench --serve: --max-tokens must be >= 1");
    scenario_options sc;
    sc.max_tokens = max_tokens;
    sc.prompt_tokens = prompt_tokens;
    sc.repeats = (int)positive(p, "--repeats", 3);
    sc.conversation_tokens = positive(p, "--conversation-tokens", 16384);
    sc.turns = positive(p, "--turns", 20);
    sc.turn_tokens = positive(p, "--turn-tokens", 1024);
    sc.decoders = positive(p, "--decoders", 16);
    sc.steady_tokens = positive(p, "--steady-tokens", 64);
    sc.burst = positive(p, "--burst", 16);
    sc.burst_tokens = positive(p, "--burst-tokens", 8192);
    if (sc.conversation_tokens < 64 || sc.turn_tokens < 32 || sc.burst_tokens < 16)
        fail("bench --serve: --conversation-tokens must be >= 64, --turn-tokens >= 32, --burst-tokens >= 16");

    // the context and batch that every chosen scenario fits in
    int64_t ctx = 0, most = 1;
    for (const std::string& s : scenarios) {
        ctx = std::max(ctx, scenario_context(s, sc));
        most = std::max(most, s == "rounds" ? *std::max_element(concurrency.begin(), concurrency.end())
                                            : scenario_batch(s, sc));
    }
    sc.context_tokens = ctx;

    serve_options so;
    so.engine = engine_options_from(p);
    so.synthetic = synthetic_from(p, so.engine);
    so.http.host = "127.0.0.1";
    so.http.port = 0;
    batch_options_from(p, "bench --serve", (int)most,
                       so.engine.backend == "cpu" ? default_state_budget("cpu") : size_t(64) << 30, so);
    so.sched.max_queue = (int)std::max<int64_t>(most, 1);  // a round beyond the batch waits, never 429
    if (chosen("cache-decode") && so.cache.budget == 0)
        fail("bench --serve: cache-decode compares a server with the prefix cache to one without: the cache must be on");
    // every state gets this capacity on cuda: no more than a stream needs
    so.ctx_size = ctx;
    so.http.threads = std::max(64, 2 * (so.sched.max_batch + so.sched.max_queue));
    so.log_requests = false;
    bench_options bo;
    bo.steps = (int)p.integer("--engine-steps", 32);
    bo.runs = (int)p.integer("--engine-runs", 5);
    if (bo.steps < 1 || bo.runs < 1) fail("bench --serve: --engine-steps and --engine-runs must be >= 1");
    bo.kv_fp8 = so.engine.backend_opt.kv_fp8;
    bo.state_bf16 = so.engine.backend_opt.state_bf16;
    if (!http_available())
        fail("bench --serve: this tansy was built without its HTTP server (install libasio-dev and rebuild)");

    const std::string tok_dir = so.engine.model_dir.empty() ? default_model_dir() : so.engine.model_dir;
    const tokenizer tok = tokenizer::load(tok_dir + "/tokenizer.json");
    const prompt_maker prompts(tok);

    signal(SIGPIPE, SIG_IGN);  // a write to a closed socket must fail, not kill the process
    auto srv = std::make_unique<server>(so);
    srv->start();
    srv->load();
    engine& eng = srv->eng();
    const std::string what = so.synthetic.config.empty() ? eng.mdl().dir : "synthetic " + so.synthetic.config;
    const std::string device = eng.be().device_name();
    fprintf(stderr, "tansy bench --serve: %s on %s, http://127.0.0.1:%d\n  %s\n", what.c_str(), device.c_str(),
            srv->port(), eng.cfg().summary().c_str());

    // The engine's figures first, while no request has run: the scheduler's thread is idle. Each sampling mode's
    // own (a sampled engine step draws on the device, as the served one does).
    std::map<std::pair<int64_t, std::string>, double> engine_tok_s;
    for (int64_t C : rounds ? concurrency : std::vector<int64_t>{})
        for (const sampling_mode& m : modes) {
            if (engine_tok_s.count({C, m.name})) continue;
            bo.sampling.temperature = (float)m.temperature, bo.sampling.top_p = (float)m.top_p, bo.sampling.top_k = m.top_k;
            bo.sampling.seed = 12345;
            const bench_point b = bench_decode(eng, C, prompt_tokens, bo);
            engine_tok_s[{C, m.name}] = b.tok_s;
            fprintf(stderr, "  engine: batch %4lld context %6lld %-8s %9.1f tok/s\n", (long long)C, (long long)prompt_tokens,
                    m.name.c_str(), b.tok_s);
        }
    bo.sampling = sampling_params{};
    double prefill_tok_s = 0, round_prefill_tok_s = 0;
    if (chosen("burst")) {
        const prefill_point pp = bench_prefill(eng, sc.burst_tokens, bo);
        prefill_tok_s = pp.tok_s;
        fprintf(stderr, "  engine: prefill of %lld tokens: %9.1f tok/s\n", (long long)sc.burst_tokens, pp.tok_s);
    }
    if (rounds) {
        const prefill_point pp = bench_prefill(eng, prompt_tokens, bo);
        round_prefill_tok_s = pp.tok_s;
        fprintf(stderr, "  engine: prefill of %lld tokens: %9.1f tok/s\n", (long long)prompt_tokens, pp.tok_s);
    }

    warm_up(srv->port(), prompts, prompt_tokens, max_tokens, modes[0]);

    std::vector<serve_row> rows;
    std::vector<scenario_report> reports;
    decode_rate cache_on;
    scenario_target target{"127.0.0.1", srv->port(), "/v1/chat/completions", &prompts};
    for (const std::string& s : scenarios) {
        if (s == "second-turn") reports.push_back(run_second_turn(target, sc));
        if (s == "agent") reports.push_back(run_agent(target, sc));
        if (s == "burst") reports.push_back(run_burst(target, sc, prefill_tok_s));
        if (s == "cache-decode") cache_on = measure_decode(target, sc, "cache on");
        if (s == "rounds")
            rows = run_rounds(srv->port(), prompts, concurrency, modes, prompt_tokens, max_tokens, engine_tok_s,
                              round_prefill_tok_s);
    }
    srv->request_stop();
    srv->wait();
    srv.reset();
    if (chosen("cache-decode")) {
        // the same measurement on a second server, started without the prefix cache once the first is gone
        serve_options off = so;
        off.cache.budget = 0;
        fprintf(stderr, "tansy bench --serve: cache-decode: a second server, without the prefix cache\n");
        srv = std::make_unique<server>(off);
        srv->start();
        srv->load();
        warm_up(srv->port(), prompts, prompt_tokens, max_tokens, modes[0]);
        target.port = srv->port();
        const decode_rate cache_off = measure_decode(target, sc, "cache off");
        srv->request_stop();
        srv->wait();
        srv.reset();
        reports.push_back(cache_decode_report(cache_on, cache_off, sc));
    }

    if (p.has("--json")) {
        nlohmann::ordered_json j = {{"model", what},
                                    {"device", device},
                                    {"prompt_tokens", prompt_tokens},
                                    {"max_tokens", max_tokens},
                                    {"max_batch", so.sched.max_batch}};
        if (rounds) j["serve"] = rounds_json(rows);
        if (!reports.empty()) {
            j["context_tokens"] = ctx;
            j["prefix_cache_mib"] = (double)so.cache.budget / (1 << 20);
            j["prefill_budget"] = so.sched.prefill_budget;
            j["prefill_pace"] = so.sched.prefill_pace;
        }
        for (const scenario_report& r : reports) j[r.key] = r.json;
        printf("%s\n", j.dump(2).c_str());
        return 0;
    }
    std::string out = rounds ? rounds_table(rows, prompt_tokens, max_tokens) : "";
    for (const scenario_report& r : reports) out += (out.empty() ? "" : "\n") + r.table;
    fputs(out.c_str(), stdout);
    return 0;
}

}  // namespace tansy
