// Served speed measurement: `tansy serve --synthetic` (random weights of a config.json behind the bundled
// tokenizer, sampling over the whole vocabulary) and `tansy bench --serve` (the streaming load generator),
// on the CPU backend with tiny configs. Skipped when tansy is built without its HTTP server (no Asio headers).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "server/http.h"
#include "server/http_client.h"
#include "server/load_client.h"
#include "server/openai.h"
#include "server/server.h"
#include "server/text_stream.h"
#include "test_util.h"

namespace tansy {
namespace {

const std::string TINY_CONFIG = std::string(TANSY_SOURCE_DIR) + "/models/tiny-chat-q4/config.json";
const std::string U_FFFD = "\xEF\xBF\xBD";
// The server's times and the client's come from separate clock reads around the same events.
constexpr double k_clock_slack_ms = 0.5;

// The tiny model's config with a vocabulary of 65536: ~94% of the ids lie beyond its 4073-id tokenizer.
std::string big_vocab_config() {
    std::ifstream in(TINY_CONFIG);
    nlohmann::json c = nlohmann::json::parse(in);
    c["text_config"]["vocab_size"] = 65536;
    const std::string dir = test::temp_dir("serve_synthetic") + "/big-vocab";
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << c.dump();
    return dir + "/config.json";
}

int count_of(const std::string& s, const std::string& what) {
    int n = 0;
    for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) n++;
    return n;
}

}  // namespace

TEST(serve_synthetic, unknown_ids_decode_to_a_placeholder) {
    const text_engine te([] {
        engine_options o;
        o.threads = 1;
        return o;
    }());
    const tokenizer& tok = te.tok();
    EXPECT_EQ(token_bytes_or_unknown(tok, (int32_t)tok.size()), UNKNOWN_TOKEN_TEXT);
    EXPECT_EQ(token_bytes_or_unknown(tok, -1), UNKNOWN_TOKEN_TEXT);
    const std::vector<int32_t> hi = tok.encode("hi");
    EXPECT_EQ(token_bytes_or_unknown(tok, hi[0]), tok.token_bytes(hi[0]));
    text_options o;
    o.chat = false;
    completion_text ct(tok, te.eos(), te.think_end(), o);
    std::string shown;
    for (int32_t id : {hi[0], (int32_t)tok.size() + 5, (int32_t)1 << 20, hi[0]}) {
        text_delta d;
        token_event e;
        e.id = id;
        EXPECT_NO_THROW(ct.push(e, d));
        shown += d.text;
    }
    text_delta d;
    ct.finish(d);
    shown += d.text;
    const std::string h(tok.token_bytes(hi[0]));
    EXPECT_EQ(shown, h + U_FFFD + U_FFFD + h);
    EXPECT_EQ(ct.completion_tokens(), 4);
    // logprobs of an unknown id: the placeholder, as text and bytes
    token_event e;
    e.id = (int32_t)tok.size() + 1;
    e.top = {{e.id, -0.5f}};
    const ojson lp = chat_logprobs(tok, {e});
    EXPECT_EQ(lp["content"][0]["token"], U_FFFD);
    EXPECT_EQ(lp["content"][0]["bytes"], ojson::array({239, 191, 189}));
}

TEST(serve_synthetic, ignore_eos_is_parsed) {
    EXPECT_FALSE(parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}]})", {}).ignore_eos);
    EXPECT_TRUE(parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}], "ignore_eos": true})", {}).ignore_eos);
    EXPECT_TRUE(parse_completion_request(R"({"prompt": "x", "ignore_eos": true})", {}).ignore_eos);
    EXPECT_THROW(parse_completion_request(R"({"prompt": "x", "ignore_eos": 1})", {}), api_error);
}

// A chat completion from a synthetic model whose vocabulary is 16x the tokenizer's: sampling covers every id,
// and the tokens beyond the tokenizer come back as U+FFFD instead of failing the request.
TEST(serve_synthetic, serves_ids_beyond_the_tokenizer) {
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    serve_options o;
    o.engine.threads = 1;
    o.synthetic.config = big_vocab_config();
    o.synthetic.layers = 2;
    o.http.port = 0;
    o.sched.max_batch = 2;
    o.ctx_size = 512;
    o.progress = o.log_requests = false;
    server srv(o);
    srv.start();
    srv.load();
    EXPECT_EQ(srv.eng().cfg().vocab, 65536);
    EXPECT_EQ(srv.eng().n_valid_tokens(), 65536) << "a synthetic model samples its whole vocabulary";

    http_client c("127.0.0.1", srv.port(), 60);
    std::string body, err;
    ASSERT_EQ(c.get("/v1/models", &body, &err), 200) << err;
    EXPECT_EQ(nlohmann::json::parse(body)["data"][0]["id"], "synthetic-big-vocab");

    const int64_t N = 24;
    // thinking off: every token is the answer's, so each has a log-prob entry (reasoning tokens have none)
    const std::string req = nlohmann::json{{"messages", {{{"role", "user"}, {"content", "Hello there"}}}},
                                           {"max_tokens", N},
                                           {"ignore_eos", true},
                                           {"temperature", 0},
                                           {"chat_template_kwargs", {{"enable_thinking", false}}},
                                           {"logprobs", true}}
                                .dump();
    std::string resp;
    ASSERT_EQ(c.post("/v1/chat/completions", req, [&](std::string_view p) { resp += p; return true; }, &err), 200)
        << err << resp;
    const nlohmann::json j = nlohmann::json::parse(resp);
    EXPECT_EQ(j["usage"]["completion_tokens"], N);
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    const nlohmann::json& lp = j["choices"][0]["logprobs"]["content"];
    ASSERT_EQ((int64_t)lp.size(), N);
    int unknown = 0;
    for (const auto& t : lp) unknown += t["bytes"] == nlohmann::json::array({239, 191, 189});
    EXPECT_GT(unknown, 0) << resp;
    auto str = [](const nlohmann::json& m, const char* k) {  // absent or null: ""
        return m.contains(k) && m[k].is_string() ? m[k].get<std::string>() : std::string();
    };
    const nlohmann::json& msg = j["choices"][0]["message"];
    const std::string text = str(msg, "content") + str(msg, "reasoning_content");
    EXPECT_GE(count_of(text, U_FFFD), unknown) << text;

    // the same streamed, timed by the load generator: every token counted, one text event per token here
    const std::string sreq = nlohmann::json{{"messages", {{{"role", "user"}, {"content", "Hello again"}}}},
                                            {"max_tokens", N},
                                            {"ignore_eos", true},
                                            {"stream", true},
                                            {"stream_options", {{"include_usage", true}}}}
                                 .dump();
    const stream_timing s = timed_stream(c, "/v1/chat/completions", sreq, std::chrono::steady_clock::now());
    ASSERT_TRUE(s.ok) << s.error;
    EXPECT_EQ(s.completion_tokens, N);
    EXPECT_GT(s.ttft_s, 0);
    EXPECT_GT(s.tok_s(), 0);
    EXPECT_EQ(s.finish_reason, "length");
    EXPECT_GE(s.last_s, s.first_s);
    EXPECT_EQ((int64_t)s.itl_s.size(), s.text_events - 1);
    srv.request_stop();
    srv.wait();
}

TEST(serve_synthetic, bench_serve_json) {
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    const int64_t max_tokens = 8;
    std::string out;
    const std::string cmd = std::string(TANSY_CLI) + " bench --serve --synthetic " + TINY_CONFIG +
                            " --layers 2 --backend cpu --concurrency 1,2 --prompt-tokens 64 --max-tokens 8 --engine-steps 2"
                            " --engine-runs 1 --json 2>/dev/null";
    ASSERT_EQ(test::run_command(cmd, &out, false), 0) << out;
    const nlohmann::json j = nlohmann::json::parse(out);
    ASSERT_TRUE(j["serve"].is_array());
    ASSERT_EQ(j["serve"].size(), 4u);  // 2 concurrencies x greedy, sampled
    int i = 0;
    for (int64_t C : {1, 2})
        for (const char* mode : {"greedy", "sampled"}) {
            const nlohmann::json& r = j["serve"][i++];
            EXPECT_EQ(r["concurrency"], C);
            EXPECT_EQ(r["sampling"], mode);
            EXPECT_EQ(r["completion_tokens"], C * max_tokens) << "every stream runs to max_tokens";
            for (const char* k : {"agg_tok_s", "per_stream_tok_s", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50",
                                  "ttft_ms_p99", "engine_tok_s", "round_tok_s"}) {
                ASSERT_TRUE(r.contains(k) && r[k].is_number()) << k;
                EXPECT_GT(r[k].get<double>(), 0) << k;
            }
            // the round's work adds the prompts' prefill to the decode steps
            EXPECT_LT(r["round_tok_s"].get<double>(), r["engine_tok_s"].get<double>());
            // the server's share of the TTFT, from its /metrics: every stream's prompt ran in steps, within the
            // client's time to the first token
            ASSERT_TRUE(r["queue_ms_mean"].is_number() && r["prefill_ms_mean"].is_number());
            EXPECT_GE(r["queue_ms_mean"].get<double>(), 0);
            EXPECT_GT(r["prefill_ms_mean"].get<double>(), 0);
            EXPECT_LT(r["queue_ms_mean"].get<double>() + r["prefill_ms_mean"].get<double>(),
                      r["ttft_ms_p99"].get<double>());
            // its arrival-to-first-token time holds the wait and the steps, and no text reaches a client before it
            ASSERT_TRUE(r["server_ttft_ms_mean"].is_number());
            EXPECT_GE(r["server_ttft_ms_mean"].get<double>() + k_clock_slack_ms,
                      r["queue_ms_mean"].get<double>() + r["prefill_ms_mean"].get<double>());
            EXPECT_LE(r["server_ttft_ms_mean"].get<double>(), r["ttft_ms_p99"].get<double>() + k_clock_slack_ms);
            EXPECT_LE(r["itl_ms_p50"].get<double>(), r["itl_ms_p99"].get<double>());
            EXPECT_LE(r["ttft_ms_p50"].get<double>(), r["ttft_ms_p99"].get<double>());
        }
}

}  // namespace tansy

namespace tansy {

// Every --scenario of bench --serve at tiny sizes in one run (~4 s on the CPU): the keys are there and the
// prefix cache counts as it should (requests with the cache restore tokens, those with "cache_prompt": false
// none). Four layers: the first four of the tiny model hold its first attention layer (KV for the cache).
TEST(serve_synthetic, bench_serve_scenarios_json) {
    if (!http_available()) GTEST_SKIP() << "built without the HTTP server (no Asio headers)";
    const int64_t turns = 3, burst = 3;
    std::string out;
    const std::string cmd =
        std::string(TANSY_CLI) + " bench --serve --synthetic " + TINY_CONFIG +
        " --layers 4 --backend cpu --scenario second-turn,agent,burst,cache-decode --prompt-tokens 64 --max-tokens 32"
        " --conversation-tokens 400 --repeats 2 --turns 3 --turn-tokens 300 --decoders 2 --burst 3 --burst-tokens 200"
        " --steady-tokens 16 --engine-runs 1 --json 2>/dev/null";
    ASSERT_EQ(test::run_command(cmd, &out, false), 0) << out;
    const nlohmann::json j = nlohmann::json::parse(out);
    EXPECT_FALSE(j.contains("serve")) << "no rounds unless asked for";
    auto positive = [](const nlohmann::json& o, std::initializer_list<const char*> keys) {
        for (const char* k : keys) {
            ASSERT_TRUE(o.contains(k) && o[k].is_number()) << k << " in " << o.dump();
            EXPECT_GT(o[k].get<double>(), 0) << k;
        }
    };

    const nlohmann::json& st = j["second_turn"];
    positive(st, {"prompt_tokens", "cached_tokens", "turn1_ttft_ms", "ttft_cached_ms", "ttft_cold_ms", "ratio"});
    EXPECT_EQ(st["cold_cached_tokens"], 0) << "cache_prompt false restores nothing";
    ASSERT_EQ(st["runs"].size(), 2u);
    for (const auto& r : st["runs"]) {
        EXPECT_EQ(r["turn1_cached_tokens"], 0) << "a new conversation shares nothing with the last one";
        EXPECT_GT(r["cached_tokens"].get<int64_t>(), 300) << "turn 2 restores most of turn 1's ~400 tokens";
        EXPECT_LT(r["cached_tokens"].get<int64_t>(), r["prompt_tokens"].get<int64_t>());
        EXPECT_EQ(r["cold_cached_tokens"], 0);
    }

    const nlohmann::json& ag = j["agent"];
    positive(ag, {"prefill_ms_cached", "prefill_ms_uncached", "ratio", "cached_tokens", "prompt_tokens",
                  "ttft_ms_p50_cached", "ttft_ms_p50_uncached"});
    EXPECT_EQ(ag["uncached_cached_tokens"], 0);
    ASSERT_EQ((int64_t)ag["per_turn"].size(), turns);
    for (int64_t k = 0; k < turns; k++) {
        const nlohmann::json& t = ag["per_turn"][k];
        EXPECT_EQ(t["uncached_cached_tokens"], 0) << "turn " << k + 1;
        if (k == 0) EXPECT_EQ(t["cached_tokens"], 0) << "the first turn has nothing to restore";
        else EXPECT_GT(t["cached_tokens"].get<int64_t>(), 0) << "turn " << k + 1 << " restores the turns before";
    }

    const nlohmann::json& b = j["burst"];
    positive(b, {"prefill_tok_s", "ttft_ms_p50", "ttft_ms_max", "ideal_ttft_ms_max", "ttft_max_over_ideal",
                 "worst_ttft_over_ideal", "burst_prefill_s"});
    positive(b["steady"], {"itl_ms_p50", "itl_ms_p99", "window_s", "gaps"});
    for (const char* k : {"itl_ms_p50", "itl_ms_p99", "itl_ms_max", "window_s", "gaps"})
        EXPECT_TRUE(b["during_burst"][k].is_number()) << k;
    ASSERT_EQ((int64_t)b["prompts"].size(), burst);
    for (const auto& p : b["prompts"]) EXPECT_GT(p["prompt_tokens"].get<int64_t>(), 150);

    const nlohmann::json& cd = j["cache_decode"];
    positive(cd, {"ratio"});
    for (const char* half : {"cache_on", "cache_off"}) {
        positive(cd[half], {"tok_s", "per_stream_tok_s", "itl_ms_p50"});
        EXPECT_EQ(cd[half]["rounds"], 2) << half;
    }
}

}  // namespace tansy
