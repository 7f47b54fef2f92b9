// `tansy serve`: the OpenAI-compatible server. Owns the HTTP server, the text engine and the scheduler, and
// the handlers that join them:
//   POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/NAME]   GET /health   GET /metrics
//   POST /v1/responses   GET|DELETE /v1/responses/{id}   (the Responses API on the chat path, server/responses.h)
//   POST /tokenize   POST /detokenize   GET /props   (llama.cpp's shapes, server/tokenize_api.h)
//   GET /   the chat page (server/webui.h; needs no API key; serve_options::webui turns it off)
// The HTTP side listens before the model is loaded (/health answers 503 "loading" meanwhile). Each request is
// parsed and tokenised on its HTTP worker, submitted to the scheduler, and its tokens are turned into text,
// reasoning and tool calls on that worker as they come (server/text_stream.h).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/scheduler.h"
#include "runtime/text_engine.h"
#include "server/http.h"

namespace tansy {

struct serve_options {
    engine_options engine;
    synthetic_spec synthetic;  // config set: serve random weights of that config.json (text_engine.h)
    http_options http;
    scheduler_options sched;
    prefix_cache_options cache;  // the prefix cache (runtime/prefix_cache.h); budget 0: none
    std::string api_key;     // empty: no authentication
    std::string model_name;  // empty: the model directory's name ("synthetic-" + the config's directory name)
    // Other names the model answers to (in a request's "model", GET /v1/models/NAME); /v1/models lists
    // model_name only. A request naming any other model gets 404 model_not_found; one naming none is served.
    std::vector<std::string> model_aliases;
    int64_t ctx_size = 0;    // tokens per sequence (prompt + completion); 0: min(model maximum, 32768)
    int shutdown_grace_ms = 10000;  // in-flight requests may finish this long after SIGINT/SIGTERM
    bool progress = true;    // progress bar on stderr while loading
    int load_delay_ms = 0;   // tests only ($TANSY_TEST_LOAD_DELAY_MS): the tiny model loads in milliseconds;
                             // a delay makes the "loading" state observable
    bool log_requests = true;
    bool webui = true;  // GET / answers the chat page (src/server/webui/index.html); off: 404
    // An unknown request field is a 400 naming it (code unknown_parameter) instead of a warning on stderr: for
    // client developers who want a misspelled field (max_token) to fail loudly.
    bool strict_api = false;
};

class server {
  public:
    explicit server(serve_options opt);
    ~server();
    server(const server&) = delete;
    server& operator=(const server&) = delete;

    // Binds and starts serving on a background thread (requests get 503 "loading" until load() is done).
    // Throws tansy::error when the address cannot be bound.
    void start();
    int port() const;
    // Completion requests being handled: from their handler's start to the end of their response (a stream's
    // last event), whether their sequence is queued, decoding or finished. What the shutdown log reports.
    int in_flight() const;
    // The loaded engine (after load()), for measurements beside the server (tansy bench --serve). Only while
    // no request is running: the scheduler's thread drives this engine otherwise.
    engine& eng();
    // Loads the model (on the calling thread) and starts the scheduler. Throws tansy::error.
    void load();
    // Asks the server to stop; safe to call from any thread, any number of times.
    void request_stop();
    // Blocks until request_stop(), then stops accepting, lets in-flight requests finish within the grace
    // period (cancelling the rest), and returns when every connection is done.
    void wait();

  private:
    struct state;
    std::unique_ptr<state> s_;
};

}  // namespace tansy
