// Server metrics in the Prometheus text format (version 0.0.4): counters and histograms updated by the HTTP
// workers, gauges read from the scheduler when /metrics is scraped. Thread-safe.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/scheduler.h"

namespace tansy {

class histogram {
  public:
    explicit histogram(std::vector<double> bounds);
    void observe(double v);
    // name_bucket{le=...}, name_sum, name_count lines
    void write(std::string& out, const std::string& name, const std::string& help) const;

  private:
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;  // per bound, not cumulative; one more for +Inf
    double sum_ = 0;
    uint64_t n_ = 0;
};

class server_metrics {
  public:
    server_metrics();
    void request_done(const std::string& endpoint, int status);
    void tokens(int64_t prompt, int64_t generated);
    void ttft(double s);
    void inter_token(double s);
    void request_latency(double s);
    // A sequence's wait for admission and the forward steps that processed its prompt (finish_event): the parts
    // of its time to first token spent in the scheduler.
    void prompt_timing(double queue_s, double prefill_s);
    void rejected(const std::string& reason);  // queue_full, shutting_down, loading, ...
    void disconnect();
    // Everything, with the scheduler's gauges (stats may be null while the model loads).
    std::string render(const scheduler_stats* stats, bool loaded) const;

  private:
    mutable std::mutex mu_;
    std::map<std::pair<std::string, int>, uint64_t> requests_;
    std::map<std::string, uint64_t> rejected_;
    uint64_t prompt_tokens_ = 0, generated_tokens_ = 0, disconnects_ = 0;
    histogram ttft_, itl_, latency_, queue_, prefill_;
};

// Resident set size of this process in bytes (0 where /proc is unavailable).
size_t process_rss_bytes();

}  // namespace tansy
