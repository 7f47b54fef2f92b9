#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include "core/check.h"
#include "model/config.h"
#include "runtime/text_engine.h"
#include "server/auth.h"
#include "server/constraints.h"
#include "server/load_progress.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/queue.h"
#include "server/responses.h"
#include "server/text_stream.h"
#include "server/tokenize_api.h"
#include "server/tokenize_pool.h"
#include "server/webui.h"
#include "tokenizer/chat_template.h"

// the project version (CMakeLists.txt gives it to this file only)
#ifndef TANSY_VERSION
#define TANSY_VERSION "unknown"
#endif

namespace tansy {

namespace {

using clock_t_ = std::chrono::steady_clock;
constexpr auto k_poll = std::chrono::milliseconds(100);  // how often a waiting worker checks its client

double secs(clock_t_::time_point a, clock_t_::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

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

// tool_choice "none": ids that may never be sampled (the <tool_call> token), masked to -infinity rather than
// biased (a logit_bias of -100 is not a ban). The model could still spell "<tool_call>" out of ordinary tokens;
// with tools off the parser leaves such text in the content.
class ban_constraint final : public token_constraint {
  public:
    explicit ban_constraint(std::vector<int32_t> ids) : ids_(std::move(ids)) {}
    bool active() const override { return true; }
    void mask(float* logits, int64_t n_valid, int64_t) override {
        for (int32_t id : ids_)
            if (id >= 0 && id < n_valid) logits[id] = -std::numeric_limits<float>::infinity();
    }
    void accept(int32_t) override {}

  private:
    std::vector<int32_t> ids_;
};

}  // namespace

struct server::state {
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

    void log_line(const std::string& s) {
        if (!opt.log_requests) return;
        std::lock_guard<std::mutex> lk(log_mu);
        fprintf(stderr, "tansy: %s\n", s.c_str());
    }

    void reply_error(http_response& res, const api_error& e, const char* endpoint, const std::string& id = "-") {
        res = http_response{};
        res.status = e.status;
        res.body = error_body(e);
        if (e.status == 429 || e.status == 503) res.headers.emplace_back("Retry-After", e.status == 429 ? "1" : "5");
        if (e.status == 401) res.headers.emplace_back("WWW-Authenticate", "Bearer");
        metrics.request_done(endpoint, e.status);
        log_line(strprintf("%s %d %s: %s", id.c_str(), e.status, endpoint, e.what()));
    }

    bool serves(const std::string& name) const {
        return name == opt.model_name ||
               std::find(opt.model_aliases.begin(), opt.model_aliases.end(), name) != opt.model_aliases.end();
    }

    // OpenAI's answer for a model it does not have (status 404, type invalid_request_error).
    static api_error model_not_found(const std::string& name) {
        return api_error(404, "The model '" + name + "' does not exist", "model", "model_not_found",
                         "invalid_request_error");
    }

    void check_auth(const http_request& req) {
        if (!bearer_ok(req.header("authorization"), opt.api_key))
            throw api_error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "", "invalid_api_key");
    }

    // ---- routes

    void install_routes() {
        http.set_error_body([](int status, const std::string& msg) {
            // GET /v1/models/NAME of a name not served has no route of its own (routes are exact paths)
            const std::string unknown_model = "no such endpoint: GET /v1/models/";
            if (status == 404 && msg.rfind(unknown_model, 0) == 0 && msg.size() > unknown_model.size())
                return error_body(model_not_found(msg.substr(unknown_model.size())));
            const char* code = status == 413 ? "request_too_large" : status == 404 ? "unknown_url" : "";
            return error_body(status, msg, "", code);
        });
        http.set_logger([this](const http_request& r, int status) {
            if (r.path != "/v1/chat/completions" && r.path != "/v1/completions" && r.path.rfind("/v1/responses", 0) != 0 &&
                r.path != "/health" &&
                r.path != "/metrics" && r.path != "/tokenize" && r.path != "/detokenize" && r.path != "/props" &&
                status >= 400)
                log_line(strprintf("- %d %s %s", status, r.method.c_str(), r.path.c_str()));
        });
        if (opt.webui)
            // The chat page is public (it carries no data); its API calls send the key the user types, if any.
            // note: the CSP keeps the page to this origin: it loads nothing else and connects nowhere else
            http.route("GET", "/", [](const http_request&, http_response& res) {
                res.content_type = "text/html; charset=utf-8";
                res.body = std::string(webui_index_html());
                res.headers.emplace_back("Cache-Control", "no-cache");
                res.headers.emplace_back("X-Content-Type-Options", "nosniff");
                res.headers.emplace_back("Content-Security-Policy",
                                         "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                         "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'");
            });
        http.route("GET", "/health", [this](const http_request&, http_response& res) {
            const bool ok = ready && !stopping;
            res.status = ok ? 200 : 503;
            res.body = ok ? R"({"status": "ok"})" : stopping ? R"({"status": "shutting down"})" : R"({"status": "loading"})";
            if (!ok) res.headers.emplace_back("Retry-After", "5");
        });
        http.route("GET", "/metrics", [this](const http_request& req, http_response& res) {
            try {
                check_auth(req);
            } catch (const api_error& e) {
                return reply_error(res, e, "metrics");
            }
            scheduler_stats st;
            if (ready) st = sched->stats();
            res.content_type = "text/plain; version=0.0.4; charset=utf-8";
            res.body = metrics.render(ready ? &st : nullptr, ready);
        });
        auto models = [this](const http_request& req, http_response& res) {
            try {
                check_auth(req);
            } catch (const api_error& e) {
                return reply_error(res, e, "models");
            }
            const std::string prefix = "/v1/models/";
            const std::string id = req.path.rfind(prefix, 0) == 0 ? req.path.substr(prefix.size()) : opt.model_name;
            const ojson m = {{"id", id}, {"object", "model"}, {"created", created}, {"owned_by", "tansy"},
                             {"max_model_len", ctx}};
            res.body = req.path == "/v1/models" ? dump(ojson{{"object", "list"}, {"data", ojson::array({m})}}) : dump(m);
            metrics.request_done("models", 200);
        };
        http.route("GET", "/v1/models", models);
        http.route("GET", "/v1/models/" + opt.model_name, models);
        for (const std::string& alias : opt.model_aliases) http.route("GET", "/v1/models/" + alias, models);
        http.route("POST", "/v1/chat/completions",
                   [this](const http_request& req, http_response& res) { handle_completion(req, res, true); });
        http.route("POST", "/v1/completions",
                   [this](const http_request& req, http_response& res) { handle_completion(req, res, false); });
        http.route("POST", "/v1/responses",
                   [this](const http_request& req, http_response& res) { handle_completion(req, res, true, true); });
        for (const char* method : {"GET", "DELETE"})
            http.route(method, "/v1/responses/*", [this](const http_request& req, http_response& res) {
                stored_route(req, res);
            });
        utility_route("POST", "/tokenize", "tokenize", [this](const http_request& req) {
            const tokenize_request r = parse_tokenize_request(req.body);
            std::vector<int32_t> ids;
            try {
                ids = r.parse_special ? tok_pool->encode(r.content)
                                      : tok_pool->encode(r.content, {byte_range{0, r.content.size()}});
            } catch (const error& e) {
                throw api_error(400, e.what(), "content");
            }
            return tokenize_response(te->tok(), ids, r.with_pieces);
        });
        utility_route("POST", "/detokenize", "detokenize", [this](const http_request& req) {
            const std::vector<int32_t> ids = parse_detokenize_request(req.body, te->tok().size());
            return ojson{{"content", te->tok().decode(ids)}};
        });
        utility_route("GET", "/props", "props", [this](const http_request&) { return props(); });
    }

    // ---- llama.cpp's utility endpoints (server/tokenize_api.h): authenticated like the rest, answered once the
    // model is loaded, and on the HTTP worker (no sequence is involved)

    void utility_route(const char* method, const char* path, const char* endpoint,
                       std::function<ojson(const http_request&)> fn) {
        http.route(method, path, [this, endpoint, fn](const http_request& req, http_response& res) {
            try {
                check_auth(req);
                if (stopping) throw api_error(503, "the server is shutting down", "", "shutting_down");
                if (!ready) throw api_error(503, "the model is still loading; retry shortly", "", "model_loading");
                res.body = dump(fn(req));
            } catch (const api_error& e) {
                return reply_error(res, e, endpoint);
            } catch (const error& e) {
                return reply_error(res, api_error(400, e.what()), endpoint);
            }
            metrics.request_done(endpoint, 200);
        });
    }

    // What is served and how (llama.cpp's /props names where they mean the same: model_path, total_slots,
    // default_generation_settings.n_ctx).
    ojson props() {
        engine& e = te->eng();
        const ojson sampling = {{"temperature", defaults.temperature}, {"top_k", defaults.top_k},
                                {"top_p", defaults.top_p},             {"min_p", defaults.min_p}};
        return ojson{{"model", opt.model_name},
                     {"model_aliases", opt.model_aliases},
                     {"model_path", te->model_dir()},
                     {"n_ctx", ctx},
                     {"total_slots", opt.sched.max_batch},
                     {"vocab_size", te->tok().size()},
                     {"backend", e.be().name()},
                     {"device", e.be().device_name()},
                     {"version", TANSY_VERSION},
                     {"synthetic", !opt.synthetic.config.empty()},
                     {"default_generation_settings", {{"n_ctx", ctx}, {"params", sampling}}}};
    }

    // ---- completions

    std::vector<int32_t> build_prompt(const completion_request& r, size_t k, bool* thinking) {
        const completion_request::prompt_item* pi = r.chat ? nullptr : &r.prompts[k];
        std::vector<int32_t> ids;
        *thinking = false;
        try {
            if (r.chat) {
                chat_options co;
                co.kwargs = r.template_kwargs;
                co.system_anywhere = true;  // the API allows system/developer messages anywhere (issue 36)
                const ojson tools = r.tool_choice == tool_choice_mode::none ? ojson(nullptr) : r.tools;
                // only the template's own text may become special tokens: the client's is encoded as plain text
                const rendered_chat rc = render_chat_marked(r.messages, tools, co);
                const std::string& text = rc.text;
                // thinking is on exactly when the template opened <think> for the answer
                const std::string open = "<think>\n";
                *thinking = te->think_end() >= 0 && text.size() >= open.size() &&
                            text.compare(text.size() - open.size(), open.size(), open) == 0;
                ids = tok_pool->encode(text, rc.client);
            } else if (pi->is_ids) {
                for (int32_t id : pi->ids)
                    if (id >= te->eng().n_valid_tokens())
                        throw api_error(400, strprintf("token id %d is outside the vocabulary", id), "prompt");
                ids = pi->ids;
            } else if (r.allow_special_tokens) {
                ids = tok_pool->encode(pi->text);
            } else {
                ids = tok_pool->encode(pi->text, {byte_range{0, pi->text.size()}});
            }
        } catch (const error& e) {
            std::string msg = e.what();
            if (msg.rfind("chat template: ", 0) == 0) msg.erase(0, 15);
            throw api_error(400, msg, r.chat ? "messages" : "prompt");
        }
        if (ids.empty()) throw api_error(400, "the prompt is empty", r.chat ? "messages" : "prompt");
        return ids;
    }

    std::unique_ptr<token_constraint> make_constraint(const completion_request& r, bool thinking, int64_t max_tokens) {
        if (!r.chat) return nullptr;
        const int64_t reserve = std::clamp<int64_t>(max_tokens / 3, 8, 1024);
        const bool forced = r.tool_choice == tool_choice_mode::required || r.tool_choice == tool_choice_mode::named;
        const bool has_tools = r.tools.is_array() && !r.tools.empty() && r.tool_choice != tool_choice_mode::none;
        // tool calls constrained by their schemas: when forced, or offered next to a response_format (issue 36);
        // a response_format with tool_choice required / named applies to a later turn
        const bool tools = forced || (has_tools && r.json_mode);
        const bool json = r.json_mode && !forced;
        if (!tools && !json) {
            if (r.tool_choice == tool_choice_mode::none) {
                const int32_t open = te->tok().find("<tool_call>");
                if (open >= 0) return std::make_unique<ban_constraint>(std::vector<int32_t>{open});
            }
            return nullptr;
        }
        if (json && !tools && r.json_schema.is_null())
            return std::make_unique<json_object_constraint>(tokens, thinking, reserve);
        static const ojson k_any_object = {{"type", "object"}, {"additionalProperties", true}};
        const ojson* schema = !json ? nullptr : r.json_schema.is_null() ? &k_any_object : &r.json_schema;
        std::shared_ptr<const content_spec> spec;
        try {
            spec = build_content_spec(schema, r.json_schema_strict, r.tools,
                                      r.tool_choice == tool_choice_mode::named ? r.tool_name : "", tools,
                                      r.parallel_tool_calls);
        } catch (const schema_error& e) {
            const std::string msg = e.what();
            const bool tool = msg.rfind("tools[", 0) == 0;
            throw api_error(400, tool ? msg : "response_format.json_schema: " + msg, tool ? "tools" : "response_format");
        }
        return std::make_unique<schema_constraint>(tokens, thinking, reserve, std::move(spec));
    }

    // GET /v1/responses/{id}: a stored response; DELETE: forgets it.
    void stored_route(const http_request& req, http_response& res) {
        const std::string id = req.path.substr(std::string("/v1/responses/").size());
        try {
            check_auth(req);
            if (id.find('/') != std::string::npos)
                throw api_error(404, "no such endpoint: " + req.method + " " + req.path, "", "unknown_url");
            if (req.method == "DELETE") {
                if (!stored.erase(id)) throw response_not_found(id);
                res.body = dump(ojson{{"id", id}, {"object", "response.deleted"}, {"deleted", true}});
            } else {
                std::optional<stored_response> r = stored.get(id);
                if (!r) throw response_not_found(id);
                res.body = dump(r->response);
            }
        } catch (const api_error& e) {
            return reply_error(res, e, "responses");
        }
        metrics.request_done("responses", 200);
    }

    // chat: /v1/chat/completions, or with `responses` /v1/responses (the same request path, its own wire format)
    void handle_completion(const http_request& req, http_response& res, bool chat, bool responses = false) {
        const char* endpoint = responses ? "responses" : chat ? "chat" : "completions";
        auto j0 = std::make_shared<job>();
        in_flight++;
        j0->in_flight = &in_flight;  // the request counts once, until its first job (kept by all) goes
        j0->t0 = clock_t_::now();
        // one job per prompt: a chat request has one, a completions request one per prompt (issue 36)
        std::vector<std::shared_ptr<job>> jobs;  // submitted
        try {
            check_auth(req);
            if (stopping) throw api_error(503, "the server is shutting down", "", "shutting_down");
            if (!ready) throw api_error(503, "the model is still loading; retry shortly", "", "model_loading");
            std::optional<responses_request> rr;
            if (responses) rr = parse_responses_request(req.body, defaults, stored);
            completion_request r = responses ? std::move(rr->chat)
                                   : chat    ? parse_chat_request(req.body, defaults)
                                             : parse_completion_request(req.body, defaults);
            if (!r.model.empty() && !serves(r.model)) throw model_not_found(r.model);
            if (opt.strict_api && !r.unknown_fields.empty())
                throw api_error(400, "Unrecognized request argument supplied: " + r.unknown_fields[0].substr(0, 64) +
                                         " (this server runs with --strict-api)",
                                r.unknown_fields[0].substr(0, 64), "unknown_parameter");
            for (const auto& [id, bias] : r.logit_bias)
                if (id >= te->eng().n_valid_tokens())
                    throw api_error(400, strprintf("logit_bias names token id %d, outside the vocabulary of %lld tokens",
                                                   id, (long long)te->eng().n_valid_tokens()), "logit_bias");
            const response_meta meta{new_id(responses ? "resp_" : chat ? "chatcmpl-" : "cmpl-"), unix_now(), opt.model_name};
            if (responses) {
                const bool keep = rr->store;
                j0->resp = std::make_shared<responses_writer>(std::move(*rr), meta, keep ? &stored : nullptr);
            }
            const size_t n_prompts = chat ? 1 : r.prompts.size();
            const char* prompt_param = responses ? "input" : chat ? "messages" : "prompt";
            // every prompt is built and checked before any is submitted
            std::vector<std::vector<int32_t>> prompts(n_prompts);
            std::vector<bool> thinking(n_prompts, false);
            for (size_t k = 0; k < n_prompts; k++) {
                bool th = false;
                prompts[k] = build_prompt(r, k, &th);
                thinking[k] = th;
                const int64_t P = (int64_t)prompts[k].size();
                if (P >= ctx || (r.max_tokens > 0 && P + r.max_tokens > ctx))
                    throw api_error(400,
                                    strprintf("This model's maximum context length is %lld tokens. However, you requested "
                                              "%lld tokens (%lld in the %s, %lld in the completion). Please reduce the "
                                              "length of the %s or completion.",
                                              (long long)ctx, (long long)(P + std::max<int64_t>(r.max_tokens, 0)),
                                              (long long)P, prompt_param,
                                              (long long)std::max<int64_t>(r.max_tokens, 0), prompt_param),
                                    prompt_param, "context_length_exceeded");
            }
            for (size_t k = 0; k < n_prompts; k++) {
                std::shared_ptr<job> j = k == 0 ? j0 : std::make_shared<job>();
                const int64_t P = (int64_t)prompts[k].size();
                const int64_t max_tokens = r.max_tokens > 0 ? r.max_tokens : ctx - P;
                j->t0 = j0->t0;
                j->endpoint = endpoint;
                j->chat = chat;
                j->index = (int)k;
                j->meta = meta;
                j->stream = r.stream;
                j->include_usage = r.stream && r.include_usage;
                j->logprobs = r.logprobs;
                j->prompt_tokens = P;
                j->client_closed = req.client_closed;
                text_options to;
                to.chat = chat;
                to.thinking = thinking[k];
                to.tools = chat && r.tool_choice != tool_choice_mode::none && r.tools.is_array();
                to.tool_schemas = r.tools;
                to.stop = r.stop;
                j->text = std::make_unique<completion_text>(te->tok(), te->eos(), te->think_end(), to);

                sequence_request sr;
                sr.prompt = std::move(prompts[k]);
                sr.max_tokens = max_tokens;
                sr.sampling = r.sampling;
                // several prompts with one seed: each its own stream of random numbers
                sr.sampling.seed = r.sampling.seed + (uint64_t)k * 0x9E3779B97F4A7C15ull;
                sr.penalties = r.penalties;
                sr.logit_bias = r.logit_bias;
                if (!r.ignore_eos) sr.stop_ids = te->eos();
                sr.cache_prompt = r.cache_prompt;
                sr.logprobs = r.logprobs;
                try {
                    sr.constraint = make_constraint(r, thinking[k], max_tokens);
                } catch (const api_error& e) {  // a schema the compiler refuses: named as the request named it
                    if (responses) throw as_responses_error(e);
                    throw;
                }
                sr.sink = j->ch;
                j->seq_id = next_seq++;
                switch (sched->submit(j->seq_id, std::move(sr))) {
                    case scheduler::submit_status::ok: break;
                    case scheduler::submit_status::queue_full:
                        metrics.rejected("queue_full");
                        throw api_error(429, "the server is busy (request queue full); retry shortly", "", "rate_limit_exceeded");
                    case scheduler::submit_status::shutting_down:
                        metrics.rejected("shutting_down");
                        throw api_error(503, "the server is shutting down", "", "shutting_down");
                    case scheduler::submit_status::too_large:
                        metrics.rejected("too_large");
                        throw api_error(400, "this request needs more sequence memory than the server's budget "
                                             "(--state-memory); lower max_tokens", "max_tokens", "context_length_exceeded");
                }
                jobs.push_back(j);
            }
        } catch (const api_error& e) {
            cancel_all(jobs, 0);
            return reply_error(res, e, endpoint);
        } catch (const error& e) {
            cancel_all(jobs, 0);
            return reply_error(res, api_error(400, e.what()), endpoint);
        } catch (const std::exception& e) {
            cancel_all(jobs, 0);
            return reply_error(res, api_error(500, std::string("internal error: ") + e.what()), endpoint);
        }
        if (!j0->stream) return finish_blocking(jobs, res);
        res.content_type = "text/event-stream";
        res.headers.emplace_back("Cache-Control", "no-cache");
        res.headers.emplace_back("X-Accel-Buffering", "no");
        res.stream = [this, jobs](const http_write_fn& write) {
            try {
                run_stream(jobs, write);
            } catch (const std::exception& e) {
                cancel_all(jobs, 0);
                log_line(strprintf("%s stream failed: %s", jobs[0]->meta.id.c_str(), e.what()));
            }
        };
    }

    void cancel_all(const std::vector<std::shared_ptr<job>>& jobs, size_t from) {
        for (size_t k = from; k < jobs.size(); k++) sched->cancel(jobs[k]->seq_id);
    }

    // Moves the sequence's events through its text pipeline, calling `emit(delta, final)` for text that became
    // visible; returns false when the client went away (the sequence is then cancelled).
    template <class F>
    bool pump(job& j, F&& emit) {
        auto last_check = clock_t_::now();
        for (;;) {
            result_channel::batch b;
            const bool got = j.ch->wait(b, k_poll);
            const auto now = clock_t_::now();
            if (!got || now - last_check >= k_poll) {
                last_check = now;
                if (j.client_closed && j.client_closed()) {
                    sched->cancel(j.seq_id);
                    metrics.disconnect();
                    return false;
                }
            }
            text_delta d;
            for (const token_event& e : b.tokens) {
                if (!j.got_first) {
                    j.got_first = true;
                    j.t_first = e.t;
                    metrics.ttft(secs(j.t0, e.t));
                } else {
                    metrics.inter_token(secs(j.t_prev, e.t));
                }
                j.t_prev = e.t;
                j.text->push(e, d);
                if (j.text->stop_matched() && !j.cancel_sent) {
                    sched->cancel(j.seq_id);  // the rest would be cut anyway
                    j.cancel_sent = true;
                }
            }
            if (b.finish) {
                j.fin = *b.finish;
                j.text->finish(d);
                return emit(d, true);
            }
            if (!d.empty() && !emit(d, false)) {
                sched->cancel(j.seq_id);
                metrics.disconnect();
                return false;
            }
        }
    }

    // "stop" / "length" / "tool_calls", or "" with *err set when the sequence failed or was cut by shutdown.
    std::string finish_reason_of(const job& j, api_error* err) const {
        std::string fr;
        if (j.text->stop_matched()) {
            fr = "stop";
        } else {
            switch (j.fin.reason) {
                case finish_reason::stop:
                case finish_reason::cancelled: fr = "stop"; break;
                case finish_reason::length: fr = "length"; break;
                case finish_reason::shutdown:
                    *err = api_error(503, "the server shut down before the completion finished", "", "shutting_down");
                    return "";
                case finish_reason::error:
                    *err = api_error(500, "generation failed: " + j.fin.error);
                    return "";
            }
        }
        if (fr == "stop" && j.chat && !j.text->tool_calls().empty()) fr = "tool_calls";
        return fr;
    }

    // A step's content tokens in the Responses API's shape (an array; empty when logprobs were not asked for).
    ojson responses_logprobs(const job& j, const text_delta& d) const {
        if (j.logprobs < 0 || d.logprobs.empty()) return ojson::array();
        return chat_logprobs(te->tok(), d.logprobs)["content"];
    }

    // summed over the request's prompts, as OpenAI reports it
    static ojson usage_of(const std::vector<std::shared_ptr<job>>& jobs) {
        int64_t p = 0, c = 0, r = 0, cached = 0;
        for (const auto& j : jobs)
            p += j->prompt_tokens, c += j->text->completion_tokens(), r += j->text->reasoning_tokens(),
                cached += j->fin.cached_tokens;
        return usage_json(p, c, r, cached);
    }

    // Per sequence; the request is counted (status, latency) with its first job only.
    void log_done(const job& j, int status, const std::string& finish) {
        const double total = secs(j.t0, clock_t_::now());
        const int64_t n = j.text->completion_tokens();
        const double gen_s = j.got_first ? secs(j.t_first, j.t_prev) : 0.0;
        if (j.index == 0) {
            metrics.request_done(j.endpoint, status);
            metrics.request_latency(total);
        }
        metrics.tokens(j.prompt_tokens, n);
        log_line(strprintf("%s%s %d %s%s prompt=%lld gen=%lld (reasoning %lld) ttft=%.3fs %.1f tok/s total=%.3fs finish=%s",
                           j.meta.id.c_str(), j.index ? strprintf("[%d]", j.index).c_str() : "", status, j.endpoint,
                           j.stream ? " stream" : "", (long long)j.prompt_tokens,
                           (long long)n, (long long)j.text->reasoning_tokens(), j.got_first ? secs(j.t0, j.t_first) : 0.0,
                           n > 1 && gen_s > 0 ? (double)(n - 1) / gen_s : 0.0, total, finish.c_str()));
    }

    void finish_blocking(const std::vector<std::shared_ptr<job>>& jobs, http_response& res) {
        ojson choices = ojson::array();
        for (size_t k = 0; k < jobs.size(); k++) {  // the sequences run together; their results are read in order
            job& j = *jobs[k];
            std::string text;
            const bool alive = pump(j, [&](text_delta& d, bool) {
                if (j.resp) j.resp->add(d.parsed, responses_logprobs(j, d));
                else if (j.logprobs >= 0) j.lp_tokens.insert(j.lp_tokens.end(), d.logprobs.begin(), d.logprobs.end());
                text += d.text;
                return true;
            });
            if (!alive) {  // nobody to answer; the status only shows in the log and metrics
                cancel_all(jobs, k + 1);
                res.status = 499;
                log_done(*jobs[0], 499, "client disconnected");
                return;
            }
            api_error err(500, "");
            const std::string fr = finish_reason_of(j, &err);
            if (fr.empty()) {
                cancel_all(jobs, k + 1);
                reply_error(res, err, j.endpoint, j.meta.id);
                return;
            }
            ojson lp = nullptr;
            if (j.logprobs >= 0)
                lp = j.chat ? chat_logprobs(te->tok(), j.lp_tokens) : completion_logprobs(te->tok(), j.lp_tokens, 0);
            if (j.resp) {
                j.resp->set_cached_tokens(j.fin.cached_tokens);
                res.body = dump(j.resp->finish(fr == "length", j.prompt_tokens, j.text->completion_tokens(),
                                               j.text->reasoning_tokens()));
            } else if (j.chat) {
                res.body = dump(chat_response(j.meta, j.text->reasoning(), j.text->content(), j.text->tool_calls(),
                                              j.call_ids, fr, usage_of(jobs), lp));
            } else {
                choices.push_back(completion_choice(j.index, text, fr, lp));
            }
            if (k > 0) log_done(j, 200, fr);
            if (k + 1 == jobs.size()) {
                if (!j.chat) res.body = dump(completion_response(j.meta, choices, usage_of(jobs)));
                log_done(*jobs[0], 200, fr);
            }
        }
    }

    void run_stream(const std::vector<std::shared_ptr<job>>& jobs, const http_write_fn& write) {
        job& j0 = *jobs[0];
        const bool opened = j0.resp ? write(j0.resp->begin())
                            : !j0.chat || write(sse(chat_chunk(j0.meta, {{"role", "assistant"}, {"content", ""}}, "", nullptr,
                                                               j0.include_usage)));
        if (!opened) {
            cancel_all(jobs, 0);
            metrics.disconnect();
            log_done(j0, 499, "client disconnected");
            return;
        }
        // Several prompts: their sequences run together; the choices are sent one after the other.
        for (size_t k = 0; k < jobs.size(); k++) {
            job& j = *jobs[k];
            auto send_delta = [&](const text_delta& d) {
                if (j.resp) {
                    const std::string events = j.resp->add(d.parsed, responses_logprobs(j, d));
                    return events.empty() || write(events);
                }
                ojson lp = nullptr;
                if (j.logprobs >= 0 && !d.logprobs.empty()) {
                    lp = j.chat ? chat_logprobs(te->tok(), d.logprobs) : completion_logprobs(te->tok(), d.logprobs, j.text_offset);
                }
                if (j.chat) {
                    const ojson delta = chat_delta(d.parsed, j.call_ids);
                    if (delta.empty() && lp.is_null()) return true;
                    return write(sse(chat_chunk(j.meta, delta, "", lp, j.include_usage)));
                }
                j.text_offset += (int64_t)d.text.size();
                if (d.text.empty() && lp.is_null()) return true;
                return write(sse(completion_chunk(j.meta, d.text, "", lp, j.include_usage, j.index)));
            };
            bool final_ok = true;
            const bool alive = pump(j, [&](text_delta& d, bool) {
                if (!send_delta(d)) return final_ok = false;
                return true;
            });
            if (!alive || !final_ok) {
                cancel_all(jobs, k + 1);
                log_done(j0, 499, "client disconnected");
                return;
            }
            api_error err(500, "");
            const std::string fr = finish_reason_of(j, &err);
            if (fr.empty()) {
                cancel_all(jobs, k + 1);
                // the status line is long gone: the error travels as an event, as OpenAI's API does
                if (j.resp) {
                    write(j.resp->failed(err));
                } else {
                    write("data: " + error_body(err) + "\n\n");
                    write("data: [DONE]\n\n");
                }
                log_done(j0, err.status, err.what());
                return;
            }
            if (j.resp) {
                j.resp->set_cached_tokens(j.fin.cached_tokens);
                write(j.resp->finish_events(fr == "length", j.prompt_tokens, j.text->completion_tokens(),
                                            j.text->reasoning_tokens()));
            } else if (j.chat) {
                write(sse(chat_chunk(j.meta, ojson::object(), fr, nullptr, j.include_usage)));
            } else {
                write(sse(completion_chunk(j.meta, "", fr, nullptr, j.include_usage, j.index)));
            }
            if (k > 0) log_done(j, 200, fr);
            if (k + 1 == jobs.size()) {
                if (j.include_usage && !j.resp) write(sse(usage_chunk(j.meta, j.chat, usage_of(jobs))));
                if (!j.resp) write("data: [DONE]\n\n");  // the Responses stream ends with response.completed
                log_done(j0, 200, fr);
            }
        }
    }
};

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
        std::string dir = s.opt.engine.model_dir.empty() ? default_model_dir() : s.opt.engine.model_dir;
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
    const std::string dir = s.opt.engine.model_dir.empty() ? default_model_dir() : s.opt.engine.model_dir;
    const bool synthetic = !s.opt.synthetic.config.empty();
    {
        // a synthetic model reads no checkpoint: nothing for the bar to follow
        load_progress bar(dir, s.opt.progress && !synthetic);
        // Tests only: the tiny model loads in milliseconds; this makes the "loading" state observable.
        if (const char* d = std::getenv("TANSY_TEST_LOAD_DELAY_MS"))
            std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(d)));
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
    fprintf(stderr, "tansy serve: ready: model '%s'%s (%s backend), context %lld, batch %d, queue %d, state budget %.0f MiB\n",
            s.opt.model_name.c_str(), synthetic ? strprintf(" (synthetic, %lld layers, vocabulary %lld, tokenizer of %s)",
                                                           (long long)c.n_layers(), (long long)c.vocab, dir.c_str()).c_str() : "",
            s.opt.engine.backend.c_str(), (long long)s.ctx, s.opt.sched.max_batch,
            s.opt.sched.max_queue, (double)s.opt.sched.state_budget / (1 << 20));
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
