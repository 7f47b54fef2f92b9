// The per-request result channel between the engine thread and the HTTP worker that serves the request
// (llama.cpp's server_response analogue; the task queue in is the scheduler's). The scheduler pushes token and
// finish events; the worker waits for them with a timeout, so it can poll its client's connection meanwhile.
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <vector>

#include "runtime/scheduler.h"

namespace tansy {

class result_channel final : public sequence_sink {
  public:
    void on_token(const token_event& e) override;   // engine thread
    void on_finish(const finish_event& e) override;  // engine thread

    struct batch {
        std::vector<token_event> tokens;     // in generation order
        std::optional<finish_event> finish;  // set once, after the last token
    };
    // Worker thread: moves whatever arrived into `out` (waiting up to `timeout` for something); returns false
    // on timeout with nothing new.
    bool wait(batch& out, std::chrono::milliseconds timeout);

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<token_event> tokens_;
    std::optional<finish_event> finish_;
    bool finish_taken_ = false;
};

}  // namespace tansy
