// The server's routes (server::state::install_routes) and the endpoints answered on the HTTP worker without a
// sequence: /health, /metrics, /v1/models, GET|DELETE /v1/responses/{id}, /tokenize, /detokenize, /props, GET /.
#include "server/server_internal.h"

#include <optional>

#include "server/tokenize_api.h"
#include "server/webui.h"

// the project version (CMakeLists.txt gives it to this file only)
#ifndef TANSY_VERSION
#define TANSY_VERSION "unknown"
#endif

namespace tansy {

void server::state::install_routes() {
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

// llama.cpp's utility endpoints (server/tokenize_api.h): authenticated like the rest, answered once the model is
// loaded, and on the HTTP worker (no sequence is involved)
void server::state::utility_route(const char* method, const char* path, const char* endpoint,
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
ojson server::state::props() {
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

// GET /v1/responses/{id}: a stored response; DELETE: forgets it.
void server::state::stored_route(const http_request& req, http_response& res) {
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

}  // namespace tansy
