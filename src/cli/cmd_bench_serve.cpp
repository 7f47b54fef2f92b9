// tansy bench --serve: served speed. Starts the server in this process on a free loopback port and drives it
// over HTTP with streaming clients (server/load_client.h); beside each row, the engine's own decode rate at the
// same batch size (runtime/bench.h bench_decode on the server's engine, measured while the server is idle), so
// the cost of serving (HTTP, scheduling, detokenising, SSE) shows as the gap between the two.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "cli/commands.h"
#include "core/check.h"
#include "runtime/bench.h"
#include "runtime/metrics.h"
#include "server/http.h"
#include "server/load_client.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"
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

// User messages whose chat prompts are about n tokens (never more): a tag, then seeded random words, so no
// two prompts share more than a few tokens of prefix. Counting a word's tokens alone is exact because the
// pre-tokenizer splits " word" pieces on their own.
class prompt_maker {
  public:
    prompt_maker(const tokenizer& tok, int64_t n) : tok_(tok), n_(n) {
        static const char* const words[] = {
            "apple", "river", "stone", "cloud", "garden", "music", "window", "forest", "silver", "harbor",
            "lantern", "meadow", "engine", "pepper", "candle", "thunder", "valley", "mirror", "orange", "planet",
            "rocket", "saddle", "ticket", "violet", "wander", "yellow", "zebra", "anchor", "bridge", "copper",
            "desert", "feather", "glacier", "hammer", "island", "jungle", "kettle", "ladder", "marble", "needle",
            "ocean", "pillow", "quartz", "ribbon", "shadow", "tunnel", "umbrella", "velvet", "walnut", "basket",
            "castle", "dragon", "falcon", "ginger", "hollow", "insect", "jacket", "kitten", "lemon", "mango",
            "number", "office", "parrot", "rabbit"};
        for (const char* w : words) {
            const std::string piece = std::string(" ") + w;
            pieces_.push_back({piece, (int64_t)tok_.encode(piece).size()});
        }
    }

    std::string make(const std::string& tag, uint64_t seed) const {
        const int64_t overhead = count(tag);
        std::mt19937_64 rng(seed);
        std::string text = tag;
        int64_t n = overhead;
        for (;;) {
            const auto& [piece, k] = pieces_[rng() % pieces_.size()];
            if (n + k > n_) break;
            text += piece;
            n += k;
        }
        return text;
    }

    // Tokens of the chat prompt of one user message with this content.
    int64_t count(const std::string& content) const {
        const nlohmann::ordered_json messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", content}}});
        return (int64_t)tok_.encode(render_chat(messages, nullptr, chat_options{})).size();
    }

  private:
    const tokenizer& tok_;
    int64_t n_;
    std::vector<std::pair<std::string, int64_t>> pieces_;
};

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
    int64_t tokens = 0, prompt_tokens = 0;  // completion tokens of the round; mean prompt tokens per stream
    double wall_s = 0;
};

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
                 "                    ceiling agg_tok_s tends to\n"
                 "Token counts come from the usage chunk (stream_options.include_usage). Progress goes to stderr.");
    p.option("--serve", "", "benchmark the server (this mode)");
    add_engine_options(p);
    add_synthetic_options(p);
    p.option("--concurrency", "LIST", "concurrent streams per round (default 1,4,16,64,256)")
        .option("--sampling", "LIST", "greedy, sampled (temperature 0.7, top_p 0.8, top_k 20) or both (default greedy,sampled)")
        .option("--prompt-tokens", "N", "tokens of each prompt after the chat template (default 2048)")
        .option("--max-tokens", "N", "completion tokens per stream (default 256)")
        .option("--max-batch", "N", "the server's --max-batch (default: the largest concurrency)")
        .option("--state-memory", "MIB", "the server's --state-memory (default: half of available memory on cpu,\n"
                                         "                            65536 on cuda)")
        .option("--prefill-budget", "N", "the server's --prefill-budget (default 2048)")
        .option("--engine-steps", "N", "decode steps per timed run of engine_tok_s (default 32)")
        .option("--engine-runs", "N", "timed runs of engine_tok_s, median reported (default 5, after 3 warm-up steps)")
        .option("--json", "", "print {\"serve\": [rows]} (and the setup) as JSON");
    if (!p.parse(argc, argv)) return 0;

    const std::vector<int64_t> concurrency = positive_list(p.str("--concurrency", "1,4,16,64,256"), "--concurrency");
    const std::vector<sampling_mode> modes = sampling_modes(p.str("--sampling", "greedy,sampled"));
    const int64_t prompt_tokens = p.integer("--prompt-tokens", 2048), max_tokens = p.integer("--max-tokens", 256);
    if (prompt_tokens < 16) fail("bench --serve: --prompt-tokens must be >= 16 (the chat template alone takes some)");
    if (max_tokens < 1) fail("bench --serve: --max-tokens must be >= 1");
    const int64_t most = *std::max_element(concurrency.begin(), concurrency.end());

    serve_options so;
    so.engine = engine_options_from(p);
    so.synthetic = synthetic_from(p, so.engine);
    so.http.host = "127.0.0.1";
    so.http.port = 0;
    so.sched.max_batch = (int)p.integer("--max-batch", most);
    if (so.sched.max_batch < 1 || so.sched.max_batch > 4096) fail("bench --serve: --max-batch must be in [1, 4096]");
    so.sched.max_queue = (int)std::max<int64_t>(most, 1);  // a round beyond the batch waits, never 429
    const int64_t mib = p.integer("--state-memory", 0);
    if (mib < 0) fail("bench --serve: --state-memory must be >= 0");
    // note: the server's 16 GiB cuda default would not hold 256 sequences of 2K tokens of the real model
    so.sched.state_budget = mib > 0 ? (size_t)mib << 20
                            : so.engine.backend == "cpu" ? default_state_budget("cpu") : size_t(64) << 30;
    so.sched.prefill_budget = p.integer("--prefill-budget", 2048);
    if (so.sched.prefill_budget < 1) fail("bench --serve: --prefill-budget must be >= 1");
    // every state gets this capacity on cuda: no more than a stream needs
    so.ctx_size = prompt_tokens + max_tokens + 64;
    so.http.threads = std::max(64, 2 * (so.sched.max_batch + so.sched.max_queue));
    so.log_requests = false;
    bench_options bo;
    bo.steps = (int)p.integer("--engine-steps", 32);
    bo.runs = (int)p.integer("--engine-runs", 5);
    if (bo.steps < 1 || bo.runs < 1) fail("bench --serve: --engine-steps and --engine-runs must be >= 1");
    bo.kv_fp8 = so.engine.backend_opt.kv_fp8;
    if (!http_available())
        fail("bench --serve: this tansy was built without its HTTP server (install libasio-dev and rebuild)");

    const std::string tok_dir = so.engine.model_dir.empty() ? default_model_dir() : so.engine.model_dir;
    const tokenizer tok = tokenizer::load(tok_dir + "/tokenizer.json");
    const prompt_maker prompts(tok, prompt_tokens);

    signal(SIGPIPE, SIG_IGN);  // a write to a closed socket must fail, not kill the process
    server srv(so);
    srv.start();
    srv.load();
    engine& eng = srv.eng();
    const std::string what = so.synthetic.config.empty() ? eng.mdl().dir : "synthetic " + so.synthetic.config;
    fprintf(stderr, "tansy bench --serve: %s on %s, http://127.0.0.1:%d\n  %s\n", what.c_str(),
            eng.be().device_name().c_str(), srv.port(), eng.cfg().summary().c_str());

    // The engine's figures first, while no request has run: the scheduler's thread is idle. Each sampling mode's
    // own (a sampled engine step draws on the device, as the served one does).
    std::map<std::pair<int64_t, std::string>, double> engine_tok_s;
    for (int64_t C : concurrency)
        for (const sampling_mode& m : modes) {
            if (engine_tok_s.count({C, m.name})) continue;
            bo.sampling.temperature = (float)m.temperature, bo.sampling.top_p = (float)m.top_p, bo.sampling.top_k = m.top_k;
            bo.sampling.seed = 12345;
            const bench_point b = bench_decode(eng, C, prompt_tokens, bo);
            engine_tok_s[{C, m.name}] = b.tok_s;
            fprintf(stderr, "  engine: batch %4lld context %6lld %-8s %9.1f tok/s\n", (long long)C, (long long)prompt_tokens,
                    m.name.c_str(), b.tok_s);
        }

    const std::string path = "/v1/chat/completions";
    {
        const round_result w = run_round("127.0.0.1", srv.port(), path,
                                         {request_body(prompts.make("Warm-up:", 0), modes[0], std::min<int64_t>(max_tokens, 16), 0)});
        check_round(w, std::min<int64_t>(max_tokens, 16), "warm-up");
        fprintf(stderr, "  warm-up: %lld prompt tokens, ttft %.1f ms\n", (long long)w.streams[0].prompt_tokens,
                w.streams[0].ttft_s * 1e3);
    }

    std::vector<serve_row> rows;
    uint64_t round_no = 0;
    for (int64_t C : concurrency) {
        for (const sampling_mode& m : modes) {
            round_no++;
            std::vector<std::string> bodies;
            for (int64_t i = 0; i < C; i++) {
                const uint64_t seed = round_no * 1000003u + (uint64_t)i;
                const std::string tag = strprintf("Request %lld of round %llu:", (long long)i + 1, (unsigned long long)round_no);
                bodies.push_back(request_body(prompts.make(tag, seed), m, max_tokens, seed));
            }
            const std::string label = strprintf("concurrency %lld %s", (long long)C, m.name.c_str());
            const round_result r = run_round("127.0.0.1", srv.port(), path, bodies);
            check_round(r, max_tokens, label.c_str());
            rows.push_back(summarise(r, C, m.name, engine_tok_s[{C, m.name}]));
            const serve_row& x = rows.back();
            fprintf(stderr,
                    "  %-24s %9.1f tok/s (engine %9.1f)  stream %7.1f tok/s  itl p50 %7.2f ms p99 %7.2f ms  ttft p50 %8.1f ms "
                    "p99 %8.1f ms  (%lld tokens in %.2f s, prompts %lld tokens)\n",
                    label.c_str(), x.agg_tok_s, x.engine_tok_s, x.per_stream_tok_s, x.itl_ms_p50, x.itl_ms_p99, x.ttft_ms_p50,
                    x.ttft_ms_p99, (long long)x.tokens, x.wall_s, (long long)x.prompt_tokens);
        }
    }
    srv.request_stop();
    srv.wait();

    if (p.has("--json")) {
        nlohmann::ordered_json j = {{"model", what},
                                    {"device", eng.be().device_name()},
                                    {"prompt_tokens", prompt_tokens},
                                    {"max_tokens", max_tokens},
                                    {"max_batch", so.sched.max_batch},
                                    {"serve", nlohmann::ordered_json::array()}};
        for (const serve_row& r : rows)
            j["serve"].push_back({{"concurrency", r.concurrency},
                                  {"sampling", r.sampling},
                                  {"agg_tok_s", r.agg_tok_s},
                                  {"per_stream_tok_s", r.per_stream_tok_s},
                                  {"itl_ms_p50", r.itl_ms_p50},
                                  {"itl_ms_p99", r.itl_ms_p99},
                                  {"ttft_ms_p50", r.ttft_ms_p50},
                                  {"ttft_ms_p99", r.ttft_ms_p99},
                                  {"engine_tok_s", r.engine_tok_s},
                                  {"completion_tokens", r.tokens},
                                  {"wall_s", r.wall_s}});
        printf("%s\n", j.dump(2).c_str());
        return 0;
    }
    printf("%11s %8s %10s %16s %10s %10s %11s %11s %12s %8s\n", "concurrency", "sampling", "agg_tok_s", "per_stream_tok_s",
           "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "engine_tok_s", "%engine");
    for (const serve_row& r : rows)
        printf("%11lld %8s %10.1f %16.1f %10.2f %10.2f %11.1f %11.1f %12.1f %7.1f%%\n", (long long)r.concurrency,
               r.sampling.c_str(), r.agg_tok_s, r.per_stream_tok_s, r.itl_ms_p50, r.itl_ms_p99, r.ttft_ms_p50,
               r.ttft_ms_p99, r.engine_tok_s, r.engine_tok_s > 0 ? 100 * r.agg_tok_s / r.engine_tok_s : 0.0);
    printf("prompts of %lld tokens, %lld completion tokens per stream; engine_tok_s: tansy bench's decode at batch C and "
           "context %lld\n", (long long)prompt_tokens, (long long)max_tokens, (long long)prompt_tokens);
    return 0;
}

}  // namespace tansy
