// Scenarios of `tansy bench --serve` beside its rounds: the prefix cache's and mixed steps' figures of issue 30,
// each driven over HTTP against the server in the same process (server/load_client.h) and reported as a human
// table and a JSON object of its own.
//   second-turn   TTFT of a chat's second turn after a long first one: restored from the cache vs cold
//                 ("cache_prompt": false, which neither restores nor stores)
//   agent         a replay of T turns, each adding ~K tokens (an assistant reply + a tool result): total prefill
//                 time (the sum of TTFTs) with the cache vs without
//   burst         D streams decode, then B long prompts arrive at once: the streams' inter-token gaps before and
//                 during the burst, and the prompts' TTFTs against the ideal (their share of the prefill work at
//                 the engine's prefill rate)
//   cache-decode  decode rate of D streams on a server with the cache vs one without (two servers in turn)
// Every request is greedy, runs to its max_tokens ("ignore_eos") with thinking off, so each reply is its content.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_prompts.h"
#include "server/load_client.h"

namespace tansy {

struct scenario_options {
    int64_t max_tokens = 256;       // --max-tokens: caps the replies of second-turn and agent; cache-decode's length
    int64_t prompt_tokens = 2048;   // --prompt-tokens: prompts of the decoding streams (burst, cache-decode)
    int repeats = 3;                // second-turn: conversations; cache-decode: rounds per server (medians)
    int64_t conversation_tokens = 16384;  // second-turn: system prompt + first user message
    int64_t turns = 20, turn_tokens = 1024;  // agent
    int64_t decoders = 16;          // burst, cache-decode: streams decoding
    int64_t burst = 16, burst_tokens = 8192;  // burst: prompts sent at once, tokens each
    int64_t steady_tokens = 64;     // burst: tokens of every decoder timed before the burst
    int64_t context_tokens = 0;     // the server's context per sequence (the decoders of burst run up to it)
};

// Reply lengths: short, so that the TTFTs dominate each request.
constexpr int64_t SECOND_TURN_REPLY = 64, AGENT_REPLY = 32, BURST_REPLY = 16;
constexpr int64_t SECOND_TURN_FOLLOW_UP = 100;  // tokens of turn 2's new user message

// Every scenario name --scenario accepts (rounds: the concurrency rounds of cmd_bench_serve.cpp).
const std::vector<std::string>& scenario_names();
// Tokens of context (the server's --ctx-size) one sequence of this scenario needs, with room for the replies.
int64_t scenario_context(const std::string& name, const scenario_options& o);
// Sequences this scenario runs at once.
int64_t scenario_batch(const std::string& name, const scenario_options& o);

struct scenario_target {
    std::string host;
    int port = 0;
    std::string path;  // /v1/chat/completions
    const prompt_maker* prompts = nullptr;
};

struct scenario_report {
    std::string key;              // its key in the --json object
    nlohmann::ordered_json json;  // its figures
    std::string table;            // the same for people
};

scenario_report run_second_turn(const scenario_target& t, const scenario_options& o);
scenario_report run_agent(const scenario_target& t, const scenario_options& o);
// prefill_tok_s: the engine's prefill rate for one prompt of burst_tokens (runtime/bench.h), the ideal's rate.
scenario_report run_burst(const scenario_target& t, const scenario_options& o, double prefill_tok_s);

// cache-decode: one server's half, then the comparison.
struct decode_rate {
    double tok_s = 0;             // median over rounds: completion tokens of all streams while all decode / window
    double per_stream_tok_s = 0;  // median over rounds of the median stream's decode rate
    double itl_ms_p50 = 0, itl_ms_p99 = 0;  // over all rounds
    int rounds = 0;
};
decode_rate measure_decode(const scenario_target& t, const scenario_options& o, const std::string& label);
scenario_report cache_decode_report(const decode_rate& on, const decode_rate& off, const scenario_options& o);

// Shared by the scenario files.
// A greedy streamed chat request running to max_tokens with thinking off; cache_prompt false: the prefix cache
// neither restores nor stores it.
std::string scenario_body(const nlohmann::ordered_json& messages, int64_t max_tokens, bool cache_prompt, uint64_t seed);
// Stops the benchmark with the stream's error (a failed stream makes the figures meaningless).
void check_stream(const stream_timing& s, const std::string& what);
double median(std::vector<double> v);

// The sums and counts of the server's tansy_queue_wait_seconds and tansy_prefill_seconds histograms (/metrics):
// the server's side of TTFTs, admission waits and the steps that processed the prompts (n prompts); and of
// tansy_time_to_first_token_seconds, a request's arrival to its first generated token (ttft_n requests).
struct prompt_sums {
    double queue_s = 0, prefill_s = 0, n = 0;
    double ttft_s = 0, ttft_n = 0;
};
prompt_sums read_prompt_sums(int port);

}  // namespace tansy
