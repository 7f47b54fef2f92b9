// server::state (server.h) and what its files share: server.cpp (construction, loading, shutdown and the helpers
// every handler uses), server_routes.cpp (the routes and the small endpoints), server_completion.cpp (completion
// requests: prompt, constraint, submission, and their blocking or streamed answer). Internal to src/server.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/constraints.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/queue.h"
#include "server/responses.h"
#include "server/server.h"
#include "server/text_stream.h"
#include "server/tokenize_pool.h"

namespace tansy {

using clock_t_ = std::chrono::steady_clock;

inline double secs(clock_t_::time_point a, clock_t_::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

inline int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct server::state {
    // One request in flight: what its worker needs while the sequence runs (shared with the stream function).
    struct job {
        uint64_t seq_id = 0;
        response_meta meta;
        const char* endpoint = "chat";
        bool chat = true, stream = false, include_usage = false;
        int logprobs = -1;
        int index = 0;  // the choice (a /v1/completions request may hold several prompts, one sequence each)
        int64_t prompt_tokens = 0;
        std::shared_ptr<result_channel> ch = std::make_shared<result_channel>();
        std::unique_ptr<completion_text> text;
        std::vector<std::string> call_ids;
        std::vector<token_event> lp_tokens;  // non-streamed logprobs
        int64_t text_offset = 0;             // completions logprobs: bytes of text before the current chunk
        clock_t_::time_point t0, t_first, t_prev;
        bool got_first = false, cancel_sent = false;
        finish_event fin;
        std::function<bool()> client_closed;
        std::shared_ptr<responses_writer> resp;  // POST /v1/responses: its response object and events (chat form)
        std::atomic<int>* in_flight = nullptr;  // the server's count of completion requests, decremented when done

        job() = default;
        job(const job&) = delete;
        job& operator=(const job&) = delete;
        ~job() {
            if (in_flight) in_flight->fetch_sub(1);
        }
    };

    serve_options opt;
    http_server http;
    std::thread http_thread;
    server_metrics metrics;
    std::atomic<bool> ready{false}, stopping{false};
    std::unique_ptr<text_engine> te;
    std::unique_ptr<prefix_cache> cache;  // declared before sched: outlives it
    std::unique_ptr<scheduler> sched;
    std::unique_ptr<tokenize_pool> tok_pool;
    std::shared_ptr<const token_table> tokens;
    sampling_params defaults;
    int64_t ctx = 0;
    int64_t created = unix_now();
    std::atomic<uint64_t> next_seq{1};
    // completion requests between their handler's start and the end of their response (a stream included):
    // what a shutdown waits for, whether their sequence is queued, decoding, or already done and being sent
    std::atomic<int> in_flight{0};
    response_store stored;  // /v1/responses kept for previous_response_id and GET /v1/responses/{id}
    std::mutex stop_mu, log_mu;
    std::condition_variable stop_cv;
    bool stop_requested = false;

    explicit state(serve_options o) : opt(std::move(o)), http(opt.http) {}

    // server.cpp
    void log_line(const std::string& s);
    void reply_error(http_response& res, const api_error& e, const char* endpoint, const std::string& id = "-");
    bool serves(const std::string& name) const;
    static api_error model_not_found(const std::string& name);
    void check_auth(const http_request& req);

    // server_routes.cpp
    void install_routes();
    void utility_route(const char* method, const char* path, const char* endpoint,
                       std::function<ojson(const http_request&)> fn);
    ojson props();
    void stored_route(const http_request& req, http_response& res);

    // server_completion.cpp
    std::vector<int32_t> build_prompt(const completion_request& r, size_t k, bool* thinking);
    std::unique_ptr<token_constraint> make_constraint(const completion_request& r, bool thinking, int64_t max_tokens);
    void handle_completion(const http_request& req, http_response& res, bool chat, bool responses = false);
    void cancel_all(const std::vector<std::shared_ptr<job>>& jobs, size_t from);
    template <class F>
    bool pump(job& j, F&& emit);
    std::string finish_reason_of(const job& j, api_error* err) const;
    ojson responses_logprobs(const job& j, const text_delta& d) const;
    static ojson usage_of(const std::vector<std::shared_ptr<job>>& jobs);
    void log_done(const job& j, int status, const std::string& finish);
    void finish_blocking(const std::vector<std::shared_ptr<job>>& jobs, http_response& res);
    void run_stream(const std::vector<std::shared_ptr<job>>& jobs, const http_write_fn& write);
};

}  // namespace tansy
