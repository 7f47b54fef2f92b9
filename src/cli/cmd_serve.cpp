// tansy serve: the OpenAI-compatible HTTP server (src/server/server.h).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "cli/commands.h"
#include "core/check.h"
#include "loader/hf_cache.h"
#include "server/server.h"

namespace tansy {

namespace {

// Half of the memory the kernel reports as available: the default budget for sequence state on the CPU.
size_t half_available_memory() {
    FILE* f = fopen("/proc/meminfo", "r");
    if (!f) return size_t(4) << 30;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return kb ? (size_t)kb * 1024 / 2 : size_t(4) << 30;
}

}  // namespace

void add_synthetic_options(arg_parser& p) {
    p.option("--synthetic", "CONFIG", "serve random weights of this config.json (e.g. the full Qwen3.6-35B-A3B config)\n"
                                      "                            instead of a checkpoint, with the tokenizer of --model (default:\n"
                                      "                            the bundled model); ids beyond that tokenizer show as U+FFFD")
        .option("--layers", "N", "keep only the first N layers of the synthetic config")
        .option("--seed", "S", "synthetic weight seed (default 1)")
        .option("--skew", "X", "synthetic router skew: 0 uniform (default), ~1 strongly uneven expert load");
}

synthetic_spec synthetic_from(const arg_parser& p, engine_options& eo) {
    synthetic_spec s;
    if (!p.has("--synthetic")) {
        for (const char* o : {"--layers", "--seed", "--skew"})
            if (p.has(o)) fail("%s needs --synthetic", o);
        return s;
    }
    s.config = p.str("--synthetic");
    s.layers = p.integer("--layers", 0);
    if (s.layers < 0) fail("--layers must be >= 0");
    eo.backend_opt.synthetic_seed = (uint64_t)p.integer("--seed", 1);
    eo.backend_opt.router_skew = (float)p.number("--skew", 0.0);
    if (!(eo.backend_opt.router_skew >= 0)) fail("--skew must be >= 0");
    return s;
}

size_t default_state_budget(const std::string& backend) {
    return backend == "cpu" ? half_available_memory() : size_t(16) << 30;
}

void add_batch_options(arg_parser& p, const std::string& max_batch_default, const std::string& state_default) {
    p.option("--max-batch", "N", "sequences decoded together (default " + max_batch_default + ")")
        .option("--state-memory", "MIB", "KV cache + recurrent state of running sequences, at most (default:\n"
                                         "                            " + state_default + "; on cuda, --kv-cache fp8 fits\n"
                                         "                            about twice the tokens of long contexts in it)")
        .option("--prefill-budget", "N", "rows a step carries while streams decode: their decode rows and prompt\n"
                                           "                            tokens up to N in all (at least N/4 prompt tokens; default 2048):\n"
                                           "                            bounds their wait between two tokens")
        .option("--prefill-pace", "R", "while streams decode, size each step's prompt tokens (within --prefill-budget)\n"
                                       "                            from measured step times so that the step lasts about R\n"
                                       "                            decode-only steps: their gap between two tokens stays near R x\n"
                                       "                            the steady one, prompts take longer; pieces stay at least as\n"
                                       "                            long as their fixed cost (default 0: off)")
        .option("--prefix-cache-memory", "MIB", "prompt prefixes kept for reuse (KV + DeltaNet state snapshots), within\n"
                                                "                            --state-memory (default: 512 on cpu, a quarter of --state-memory on\n"
                                                "                            cuda; 0: off)")
        .option("--prefix-cache-interval", "N", "a DeltaNet state checkpoint at the first prefill piece end N\n"
                                                  "                            prompt tokens after the last one (default 2048)")
        .option("--no-prefix-cache", "", "no prefix cache (as --prefix-cache-memory 0); a request may also send\n"
                                         "                            \"cache_prompt\": false");
}

void batch_options_from(const arg_parser& p, const char* cmd, int max_batch, size_t state_budget, serve_options& o) {
    o.sched.max_batch = (int)p.integer("--max-batch", max_batch);
    if (o.sched.max_batch < 1 || o.sched.max_batch > 4096) fail("%s: --max-batch must be in [1, 4096]", cmd);
    const int64_t mib = p.integer("--state-memory", 0);
    if (mib < 0) fail("%s: --state-memory must be >= 0", cmd);
    o.sched.state_budget = mib > 0 ? (size_t)mib << 20 : state_budget;
    o.sched.prefill_budget = p.integer("--prefill-budget", 2048);
    if (o.sched.prefill_budget < 1) fail("%s: --prefill-budget must be >= 1", cmd);
    o.sched.prefill_pace = p.number("--prefill-pace", 0);
    if (!(o.sched.prefill_pace == 0 || (o.sched.prefill_pace > 1 && o.sched.prefill_pace <= 1000)))
        fail("%s: --prefill-pace must be 0 (off) or in (1, 1000]", cmd);
    const int64_t pc_mib = p.integer("--prefix-cache-memory", -1);
    if (pc_mib < -1) fail("%s: --prefix-cache-memory must be >= 0", cmd);
    o.cache.budget = pc_mib >= 0 ? (size_t)pc_mib << 20
                     : o.engine.backend == "cpu" ? std::min(size_t(512) << 20, o.sched.state_budget / 2)
                                                 : o.sched.state_budget / 4;
    o.cache.budget = std::min(o.cache.budget, o.sched.state_budget);
    if (p.has("--no-prefix-cache")) o.cache.budget = 0;
    o.cache.snapshot_interval = p.integer("--prefix-cache-interval", 2048);
    if (o.cache.snapshot_interval < 1) fail("%s: --prefix-cache-interval must be >= 1", cmd);
}

int cmd_serve(int argc, char** argv) {
    arg_parser p("serve", "[options]",
                 "Serves the model over HTTP with the OpenAI API: POST /v1/chat/completions, POST /v1/completions\n"
                 "(streamed with \"stream\": true), GET /v1/models, GET /health (503 while loading), GET /metrics\n"
                 "(Prometheus). Requests are batched continuously: the running ones decode together, and new\n"
                 "prompts are prefilled a piece per step in the same forward pass (--prefill-budget). SIGINT/SIGTERM\n"
                 "stop accepting, let running requests finish (--shutdown-timeout), and exit 0; a second signal\n"
                 "exits at once. The API key may also come from $TANSY_API_KEY.\n"
                 "--synthetic serves random weights of any config.json (no checkpoint), to measure served speed\n"
                 "(see also tansy bench --serve). Requests may set \"ignore_eos\": true to run to max_tokens.");
    add_engine_options(p);
    add_synthetic_options(p);
    p.option("--host", "ADDR", "address to listen on (default 127.0.0.1)")
        .option("--port", "N", "port (default 8080; 0: any free port, printed at start)")
        .option("--api-key", "KEY", "require 'Authorization: Bearer KEY' (default: $TANSY_API_KEY, else none)")
        .option("--model-name", "NAME", "the model id clients use and see (default: the model directory's name)")
        .option("--max-queue", "N", "requests waiting for a batch slot before 429 (default 64)")
        .option("--ctx-size", "N", "tokens per sequence, prompt + completion (default min(model maximum, 32768))");
    add_batch_options(p, "16", "half of available memory on cpu, 16384 on cuda");
    p.option("--max-body", "MIB", "largest request body accepted (default 8; larger gets 413)")
        .option("--http-threads", "N", "requests handled at once; more wait their turn (default max(64, 2 x (max-batch +\n"
                                       "                            max-queue)); idle or slow connections use no thread)")
        .option("--max-connections", "N", "open connections in total; more get 503 + Retry-After (default 4096)")
        .option("--max-connections-per-ip", "N", "open connections per client address (default 1024)")
        .option("--header-timeout", "S", "seconds for a client to send its whole request headers (default 10; then 408)")
        .option("--body-timeout", "S", "seconds for a client to send its whole request body (default 60; then 408)")
        .option("--cors-origin", "ORIGIN", "allow browser calls from ORIGIN (repeatable; * allows any): CORS headers and\n"
                                           "                            OPTIONS preflights", "", true)
        .option("--shutdown-timeout", "S", "seconds running requests get to finish on shutdown (default 10)")
        .option("--no-webui", "", "no chat page at / (default: GET / answers a chat page for the browser)")
        .option("--strict-api", "", "answer an unknown request field with a 400 naming it (default: ignore it with a\n"
                                    "warning on stderr, once per field name)")
        .option("--quiet", "", "no progress bar and no per-request log lines", "-q");
    if (!p.parse(argc, argv)) return 0;

    serve_options o;
    o.engine = engine_options_from(p);
    o.synthetic = synthetic_from(p, o.engine);
    o.http.host = p.str("--host", "127.0.0.1");
    const int64_t port = p.integer("--port", 8080);
    if (port < 0 || port > 65535) fail("serve: --port must be in [0, 65535]");
    o.http.port = (int)port;
    o.api_key = p.str("--api-key");
    if (o.api_key.empty())
        if (const char* k = std::getenv("TANSY_API_KEY")) o.api_key = k;
    if (const char* d = std::getenv("TANSY_TEST_LOAD_DELAY_MS")) o.load_delay_ms = std::atoi(d);
    o.model_name = p.str("--model-name");
    // a checkpoint from the Hugging Face cache is served as ORG/NAME, not as its snapshot's hash
    if (o.model_name.empty() && p.has("--model") && o.engine.model_dir != p.str("--model"))
        o.model_name = hf_repo_name(p.str("--model"));
    o.sched.max_queue = (int)p.integer("--max-queue", 64);
    if (o.sched.max_queue < 0) fail("serve: --max-queue must be >= 0");
    o.ctx_size = p.integer("--ctx-size", 0);
    if (o.ctx_size < 0) fail("serve: --ctx-size must be >= 0");
    batch_options_from(p, "serve", 16, default_state_budget(o.engine.backend), o);
    const int64_t body = p.integer("--max-body", 8);
    if (body < 1) fail("serve: --max-body must be >= 1");
    o.http.max_body_bytes = (size_t)body << 20;
    o.http.threads = (int)p.integer("--http-threads", std::max(64, 2 * (o.sched.max_batch + o.sched.max_queue)));
    if (o.http.threads < 2) fail("serve: --http-threads must be >= 2");
    o.http.max_connections = (int)p.integer("--max-connections", o.http.max_connections);
    if (o.http.max_connections < 1) fail("serve: --max-connections must be >= 1");
    o.http.max_connections_per_addr = (int)p.integer("--max-connections-per-ip", o.http.max_connections_per_addr);
    if (o.http.max_connections_per_addr < 1) fail("serve: --max-connections-per-ip must be >= 1");
    o.http.header_timeout_s = p.number("--header-timeout", o.http.header_timeout_s);
    if (!(o.http.header_timeout_s > 0)) fail("serve: --header-timeout must be > 0");
    o.http.body_timeout_s = p.number("--body-timeout", o.http.body_timeout_s);
    if (!(o.http.body_timeout_s > 0)) fail("serve: --body-timeout must be > 0");
    o.http.cors_origins = p.all("--cors-origin");
    for (const std::string& origin : o.http.cors_origins)
        if (origin.empty()) fail("serve: --cors-origin needs an origin (e.g. http://localhost:3000) or *");
    const double grace = p.number("--shutdown-timeout", 10.0);
    if (!(grace >= 0)) fail("serve: --shutdown-timeout must be >= 0");
    o.shutdown_grace_ms = (int)(grace * 1000);
    o.progress = o.log_requests = !p.has("--quiet");
    o.webui = !p.has("--no-webui");
    o.strict_api = p.has("--strict-api");

    // Signals go to one thread that asks the server to stop (blocked everywhere else: every thread created
    // from here on inherits the mask). A write to a closed connection must fail, not kill the process.
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);

    // The signal thread outlives this function: it reaches the server only through g_srv, under g_srv_mu.
    static std::mutex g_srv_mu;
    static server* g_srv = nullptr;
    static std::atomic<bool> loaded{false};
    server srv(o);
    {
        std::lock_guard<std::mutex> lk(g_srv_mu);
        g_srv = &srv;
    }
    struct unregister {  // destroyed before srv, on every path out
        ~unregister() {
            std::lock_guard<std::mutex> lk(g_srv_mu);
            g_srv = nullptr;
        }
    } unregister_on_exit;
    std::thread([set] {
        int n = 0;
        for (;;) {
            int sig = 0;
            if (sigwait(&set, &sig) != 0) continue;
            if (!loaded) {  // nothing in flight yet, and the loader cannot be interrupted
                fprintf(stderr, "\ntansy serve: %s while loading; exiting\n", sig == SIGINT ? "interrupted" : "terminated");
                _exit(0);
            }
            if (++n > 1) {
                fprintf(stderr, "tansy serve: second signal, exiting now\n");
                _exit(130);
            }
            std::lock_guard<std::mutex> lk(g_srv_mu);
            if (g_srv) g_srv->request_stop();
        }
    }).detach();

    srv.start();
    fprintf(stderr, "tansy serve: listening on http://%s:%d\n", o.http.host.c_str(), srv.port());
    if (o.webui) fprintf(stderr, "tansy serve: chat page at http://%s:%d/\n", o.http.host.c_str(), srv.port());
    srv.load();
    loaded = true;
    srv.wait();
    return 0;
}

}  // namespace tansy
