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
//   tokens  usage.completion_tokens of the final usage chunk (stream_options.include_usage)
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
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
    int64_t text_events = 0;
    int64_t completion_tokens = 0, prompt_tokens = 0;  // from usage (0 when the server sent none)
    std::string finish_reason;
    double tok_s() const;  // (completion_tokens - 1) / (last_s - first_s); 0 with fewer than 2 text events
};

// Sends one streamed request (its JSON body must ask for "stream": true) on `client`'s connection and times it
// against `round_start`. Never throws.
stream_timing timed_stream(http_client& client, const std::string& path, const std::string& body,
                           std::chrono::steady_clock::time_point round_start);

struct round_result {
    std::vector<stream_timing> streams;  // in the order of the bodies
    double wall_s = 0;                   // first request sent -> last response ended
    int64_t tokens() const;              // completion tokens of every stream
    int failed() const;
};

// One client thread per body, released together; each sends its body to host:port`path` once.
round_result run_round(const std::string& host, int port, const std::string& path, const std::vector<std::string>& bodies);

}  // namespace tansy
