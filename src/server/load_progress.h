// A progress bar on stderr while the model loads. The loader has no progress callback, so progress is
// estimated from what loading does: it maps the checkpoint and touches its pages, so the growth of the resident
// set against the checkpoint's size tracks it (capped below 100% until done() says so). On a terminal the bar
// redraws in place; otherwise one line at the start and one at the end.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace tansy {

class load_progress {
  public:
    load_progress(const std::string& model_dir, bool enabled);
    ~load_progress();  // stops the bar (done() not called: loading failed; the line is just ended)
    void done();

  private:
    void draw(double fraction, bool final);
    bool enabled_, tty_;
    std::string name_;
    uint64_t total_ = 0, rss0_ = 0;
    std::chrono::steady_clock::time_point t0_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

}  // namespace tansy
