// The load generator of `tansy bench --serve`: streamed chat completions sent to an OpenAI-compatible server
// and timed as a client sees them. Each client is one thread with its own connection (server/http_client.h);
// a round starts every client at once and ends when the last stream is done.
//
// Per stream, from the SSE events (one `data:` JSON per event):
//   ttft    request sent -> the first event whose delta has text (content, reasoning or a tool call)
//   itl     the gaps between consecutive text events, each divided by the tokens an event carries, estimated
//           as (tokens - 1) / (text events - 1): the server sends one event per token unless the client falls
//           behind, or a token makes no text of its own (half a character, held back by a stop string)
//   tok/s   (tokens - 1) / (last text event - first text event): the decode rate the stream saw
//   tokens  usage.completion_tokens of the final usage chunk (stream_options.include_usage); cached tokens
//           (prefix cache hits) from its prompt_tokens_details
// A stream may be watched and ended early from another thread (stream_control; stream_set runs streams in the
// background), e.g. clients that decode while a burst of prompts arrives.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "server/http_client.h"

namespace tansy {

struct stream_timing {
    bool ok = false;
    std::string error;               // why not ok: transport error, HTTP status and body, or an error event
    int status = 0;                  // HTTP status (-1: no response)
    double ttft_s = 0;               // request sent -> first text event
    double first_s = 0, last_s = 0;  // first and last text event, seconds after the round started
    double end_s = 0;                // the response ended, seconds after the round started
    std::vector<double> itl_s;       // per-token gaps (see above)
    std::vector<double> event_s;     // text events, seconds after the round started (itl_s[i] ends at event_s[i + 1])
    int64_t text_events = 0;
    int64_t completion_tokens = 0, prompt_tokens = 0;  // from usage (0 when the server sent none)
    int64_t cached_tokens = 0;       // usage.prompt_tokens_details.cached_tokens (prefix cache hits)
    std::string content;             // the answer's text as streamed (content deltas, or completions text)
    std::string finish_reason;
    // Ended early through stream_control::stop (the connection closed; the server cancels the sequence): no
    // usage chunk came, so completion_tokens counts the text events.
    bool stopped = false;
    double tok_s() const;  // (completion_tokens - 1) / (last_s - first_s); 0 with fewer than 2 text events
};

// Watches a running stream from another thread and ends it early.
struct stream_control {
    std::atomic<int64_t> text_events{0};  // so far
    std::atomic<bool> done{false};        // the response has ended (or failed)
    std::atomic<bool> stop{false};        // set: the stream is ended at its next piece of response after its first token
};

// Sends one streamed request (its JSON body must ask for "stream": true) on `client`'s connection and times it
// against `round_start`. Never throws.
stream_timing timed_stream(http_client& client, const std::string& path, const std::string& body,
                           std::chrono::steady_clock::time_point round_start, stream_control* ctl = nullptr);

struct round_result {
    std::vector<stream_timing> streams;  // in the order of the bodies
    double wall_s = 0;                   // first request sent -> last response ended
    int64_t tokens() const;              // completion tokens of every stream
    int failed() const;
};

// One client thread per body, released together; each sends its body to host:port`path` once.
round_result run_round(const std::string& host, int port, const std::string& path, const std::vector<std::string>& bodies);

// The streams of run_round in the background: sent together when constructed (timed against round_start, or
// against that moment), watched and stopped while they run, collected by wait().
class stream_set {
  public:
    using time_point = std::chrono::steady_clock::time_point;
    stream_set(const std::string& host, int port, const std::string& path, std::vector<std::string> bodies,
               std::optional<time_point> round_start = std::nullopt);
    ~stream_set();  // stop(), then wait()
    stream_set(const stream_set&) = delete;
    stream_set& operator=(const stream_set&) = delete;

    size_t size() const { return ctl_.size(); }
    double sent_s() const { return sent_s_; }  // when the bodies were released, seconds after round_start
    int64_t text_events(size_t i) const { return ctl_[i]->text_events.load(); }
    bool done(size_t i) const { return ctl_[i]->done.load(); }
    void stop();          // ends every stream still running
    round_result wait();  // joins the clients (once; later calls return the same result)

  private:
    std::vector<std::unique_ptr<stream_control>> ctl_;
    std::vector<std::thread> threads_;
    round_result res_;
    double sent_s_ = 0;
    bool joined_ = false;
};

}  // namespace tansy
