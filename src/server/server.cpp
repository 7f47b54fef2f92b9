// `tansy serve` (server.h): the server's construction, model loading and shutdown, and the helpers every handler
// uses; the routes are in server_routes.cpp, completion requests in server_completion.cpp.
#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "model/config.h"
#include "runtime/text_engine.h"
#include "server/auth.h"
#include "server/load_progress.h"
#include "server/server_internal.h"

namespace tansy {

void server::state::log_line(const std::string& s) {
    if (!opt.log_requests) return;
    std::lock_guard<std::mutex> lk(log_mu);
    fprintf(stderr, "tansy: %s\n", s.c_str());
}

void server::state::reply_error(http_response& res, const api_error& e, const char* endpoint, const std::string& id) {
    res = http_response{};
    res.status = e.status;
    res.body = error_body(e);
    if (e.status == 429 || e.status == 503) res.headers.emplace_back("Retry-After", e.status == 429 ? "1" : "5");
    if (e.status == 401) res.headers.emplace_back("WWW-Authenticate", "Bearer");
    metrics.request_done(endpoint, e.status);
    log_line(strprintf("%s %d %s: %s", id.c_str(), e.status, endpoint, e.what()));
}

bool server::state::serves(const std::string& name) const {
    return name == opt.model_name ||
           std::find(opt.model_aliases.begin(), opt.model_aliases.end(), name) != opt.model_aliases.end();
}

// OpenAI's answer for a model it does not have (status 404, type invalid_request_error).
api_error server::state::model_not_found(const std::string& name) {
    return api_error(404, "The model '" + name + "' does not exist", "model", "model_not_found",
                     "invalid_request_error");
}

void server::state::check_auth(const http_request& req) {
    if (!bearer_ok(req.header("authorization"), opt.api_key))
        throw api_error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "", "invalid_api_key");
}

server::server(serve_options opt) : s_(std::make_unique<state>(std::move(opt))) {}

server::~server() {
    request_stop();
    if (s_->http_thread.joinable()) {
        s_->http.stop();
        s_->http_thread.join();
    }
    if (s_->sched) s_->sched->shutdown(std::chrono::milliseconds(0));
}

void server::start() {
    state& s = *s_;
    if (s.opt.model_name.empty()) {
        std::string dir = s.opt.engine.model_dir.empty() ? bundled_model_dir() : s.opt.engine.model_dir;
        if (!s.opt.synthetic.config.empty())
            dir = std::filesystem::absolute(s.opt.synthetic.config).lexically_normal().parent_path().string();
        while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
        s.opt.model_name = std::filesystem::path(dir).filename().string();
        if (s.opt.model_name.empty()) s.opt.model_name = "tansy";
        if (!s.opt.synthetic.config.empty()) s.opt.model_name = "synthetic-" + s.opt.model_name;
    }
    s.install_routes();
    s.http.bind();
    s.http_thread = std::thread([&s] { s.http.run(); });
}

int server::port() const { return s_->http.port(); }

int server::in_flight() const { return s_->in_flight.load(); }

engine& server::eng() {
    TANSY_CHECK(s_->te, "server::eng() before load()");
    return s_->te->eng();
}

void server::load() {
    state& s = *s_;
    const std::string dir = s.opt.engine.model_dir.empty() ? bundled_model_dir() : s.opt.engine.model_dir;
    const bool synthetic = !s.opt.synthetic.config.empty();
    {
        // a synthetic model reads no checkpoint: nothing for the bar to follow
        load_progress bar(dir, s.opt.progress && !synthetic);
        if (s.opt.load_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(s.opt.load_delay_ms));
        s.te = std::make_unique<text_engine>(s.opt.engine, s.opt.synthetic);
        bar.done();
    }
    const model_config& c = s.te->eng().cfg();
    const int64_t model_max = c.max_positions > 0 ? c.max_positions : 32768;
    s.ctx = s.opt.ctx_size > 0 ? std::min(s.opt.ctx_size, model_max) : std::min<int64_t>(model_max, 32768);
    s.defaults = load_sampling_defaults(s.te->model_dir());
    s.tokens = token_table::build(s.te->tok(), s.te->eng().n_valid_tokens(), s.te->eos(), s.te->think_end());
    s.tok_pool = std::make_unique<tokenize_pool>(s.te->tok(), 2);
    // One capacity for every sequence: the CUDA backend batches only equal capacities (and preallocates
    // them, which the state budget accounts for); the CPU backend grows KV caches on demand.
    s.opt.sched.seq_capacity = s.ctx;
    if (s.opt.cache.budget > 0) {
        // a checkpoint before the last <|im_start|>: where the next turn's prompt leaves this conversation
        s.opt.cache.turn_token = s.te->tok().find("<|im_start|>");
        s.cache = std::make_unique<prefix_cache>(s.te->eng().be(), s.opt.cache);
        s.opt.sched.cache = s.cache.get();
    }
    s.sched = std::make_unique<scheduler>(s.te->eng(), s.opt.sched);
    s.ready = true;
    const backend_options& bo = s.opt.engine.backend_opt;
    fprintf(stderr,
            "tansy serve: ready: model '%s'%s (%s backend), context %lld, batch %d, queue %d, state budget %.0f MiB "
            "(KV cache %s, DeltaNet state %s)\n",
            s.opt.model_name.c_str(), synthetic ? strprintf(" (synthetic, %lld layers, vocabulary %lld, tokenizer of %s)",
                                                           (long long)c.n_layers(), (long long)c.vocab, dir.c_str()).c_str() : "",
            s.opt.engine.backend.c_str(), (long long)s.ctx, s.opt.sched.max_batch,
            s.opt.sched.max_queue, (double)s.opt.sched.state_budget / (1 << 20), bo.kv_fp8 ? "fp8" : "bf16",
            bo.state_bf16 ? "bf16" : "fp32");
}

void server::request_stop() {
    {
        std::lock_guard<std::mutex> lk(s_->stop_mu);
        s_->stop_requested = true;
    }
    s_->stop_cv.notify_all();
}

void server::wait() {
    state& s = *s_;
    {
        std::unique_lock<std::mutex> lk(s.stop_mu);
        s.stop_cv.wait(lk, [&] { return s.stop_requested; });
    }
    s.stopping = true;
    const auto t0 = clock_t_::now();
    int active = 0, queued = 0;
    if (s.sched) {
        const scheduler_stats st = s.sched->stats();
        active = st.active, queued = st.queued;
    }
    fprintf(stderr, "tansy serve: shutting down (%d requests in flight: %d sequences running, %d queued; up to %.1f s "
            "to finish)\n", s.in_flight.load(), active, queued, s.opt.shutdown_grace_ms / 1000.0);
    s.http.stop();  // no new connections; the workers finish their requests
    if (s.sched) s.sched->shutdown(std::chrono::milliseconds(s.opt.shutdown_grace_ms));
    if (s.http_thread.joinable()) s.http_thread.join();
    fprintf(stderr, "tansy serve: stopped after %.2f s (%d requests unfinished)\n", secs(t0, clock_t_::now()),
            s.in_flight.load());
}

}  // namespace tansy
