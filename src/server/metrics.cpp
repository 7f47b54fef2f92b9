#include "server/metrics.h"

#include <unistd.h>

#include <cstdio>

#include "core/check.h"

namespace tansy {

histogram::histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void histogram::observe(double v) {
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) i++;
    counts_[i]++;
    sum_ += v;
    n_++;
}

static std::string num(double v) {
    char b[64];
    snprintf(b, sizeof b, "%.9g", v);
    return b;
}

void histogram::write(std::string& out, const std::string& name, const std::string& help) const {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    uint64_t cum = 0;
    for (size_t i = 0; i < bounds_.size(); i++) {
        cum += counts_[i];
        out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
    }
    cum += counts_.back();
    out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
    out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(n_) + "\n";
}

server_metrics::server_metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      latency_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}),
      queue_({0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      prefill_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}) {}

void server_metrics::request_done(const std::string& endpoint, int status) {
    std::lock_guard<std::mutex> lk(mu_);
    requests_[{endpoint, status}]++;
}

void server_metrics::tokens(int64_t prompt, int64_t generated) {
    std::lock_guard<std::mutex> lk(mu_);
    prompt_tokens_ += (uint64_t)prompt;
    generated_tokens_ += (uint64_t)generated;
}

void server_metrics::ttft(double s) {
    std::lock_guard<std::mutex> lk(mu_);
    ttft_.observe(s);
}

void server_metrics::inter_token(double s) {
    std::lock_guard<std::mutex> lk(mu_);
    itl_.observe(s);
}

void server_metrics::request_latency(double s) {
    std::lock_guard<std::mutex> lk(mu_);
    latency_.observe(s);
}

void server_metrics::prompt_timing(double queue_s, double prefill_s) {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.observe(queue_s);
    prefill_.observe(prefill_s);
}

void server_metrics::rejected(const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu_);
    rejected_[reason]++;
}

void server_metrics::disconnect() {
    std::lock_guard<std::mutex> lk(mu_);
    disconnects_++;
}

size_t process_rss_bytes() {
    FILE* f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long long pages_total = 0, pages_rss = 0;
    const int n = fscanf(f, "%llu %llu", &pages_total, &pages_rss);
    fclose(f);
    return n == 2 ? (size_t)pages_rss * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

std::string server_metrics::render(const scheduler_stats* st, bool loaded) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::string o;
    auto gauge = [&](const char* name, const char* help, double v) {
        o += strprintf("# HELP %s %s\n# TYPE %s gauge\n%s %s\n", name, help, name, name, num(v).c_str());
    };
    auto counter = [&](const char* name, const char* help, double v) {
        o += strprintf("# HELP %s %s\n# TYPE %s counter\n%s %s\n", name, help, name, name, num(v).c_str());
    };
    gauge("tansy_model_loaded", "1 once the model is loaded and requests are served", loaded ? 1 : 0);
    o += "# HELP tansy_requests_total HTTP requests by endpoint and status\n# TYPE tansy_requests_total counter\n";
    for (const auto& [k, n] : requests_)
        o += strprintf("tansy_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n", k.first.c_str(), k.second,
                       (unsigned long long)n);
    o += "# HELP tansy_requests_rejected_total requests refused before generation, by reason\n"
         "# TYPE tansy_requests_rejected_total counter\n";
    for (const auto& [k, n] : rejected_)
        o += strprintf("tansy_requests_rejected_total{reason=\"%s\"} %llu\n", k.c_str(), (unsigned long long)n);
    counter("tansy_prompt_tokens_total", "prompt tokens of finished requests", (double)prompt_tokens_);
    counter("tansy_generation_tokens_total", "generated tokens of finished requests", (double)generated_tokens_);
    counter("tansy_client_disconnects_total", "requests cancelled because the client went away", (double)disconnects_);
    ttft_.write(o, "tansy_time_to_first_token_seconds", "time from request arrival to its first generated token");
    itl_.write(o, "tansy_inter_token_latency_seconds", "time between consecutive generated tokens of a request");
    latency_.write(o, "tansy_request_duration_seconds", "time from request arrival to its last byte");
    queue_.write(o, "tansy_queue_wait_seconds", "time a sequence waited for admission to the running batch");
    prefill_.write(o, "tansy_prefill_seconds",
                   "time of the forward steps that processed a sequence's prompt (with what else they carried)");
    if (st) {
        gauge("tansy_queue_depth", "requests waiting for a batch slot", st->queued);
        gauge("tansy_active_sequences", "sequences being generated", st->active);
        gauge("tansy_state_memory_bytes", "KV cache and recurrent state held by running sequences",
              (double)st->state_bytes);
        gauge("tansy_state_memory_budget_bytes", "the most sequence state the scheduler admits",
              (double)st->state_budget);
        counter("tansy_decode_steps_total", "batched decode forwards", (double)st->steps);
        counter("tansy_decode_rows_total", "sequences carried by decode forwards (rows / steps = mean batch)",
                (double)st->decode_rows);
        counter("tansy_host_picks_total", "tokens chosen on the host from a downloaded logits row",
                (double)st->host_picks);
        const prefix_cache_stats& pc = st->cache;
        counter("tansy_prefix_cache_hits_total", "requests that restored a cached prompt prefix", (double)pc.hits);
        counter("tansy_prefix_cache_misses_total", "requests that found no cached prompt prefix", (double)pc.misses);
        counter("tansy_prefix_cache_cached_tokens_total", "prompt tokens restored from the prefix cache instead of computed",
                (double)pc.cached_tokens);
        counter("tansy_prefix_cache_evictions_total", "prefix cache entries evicted for memory", (double)pc.evictions);
        gauge("tansy_prefix_cache_bytes", "memory held by the prefix cache (within the state budget)", (double)pc.bytes);
        gauge("tansy_prefix_cache_budget_bytes", "the most the prefix cache holds (0: off)", (double)pc.budget);
        gauge("tansy_prefix_cache_entries", "cached sequences (each with its KV and recurrent state)", (double)pc.entries);
        gauge("tansy_prefix_cache_checkpoints", "recurrent-state checkpoints inside cached sequences", (double)pc.checkpoints);
    }
    gauge("process_resident_memory_bytes", "resident memory of the server process", (double)process_rss_bytes());
    return o;
}

}  // namespace tansy
