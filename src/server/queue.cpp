#include "server/queue.h"

namespace tansy {

void result_channel::on_token(const token_event& e) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        tokens_.push_back(e);
    }
    cv_.notify_one();
}

void result_channel::on_finish(const finish_event& e) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        finish_ = e;
    }
    cv_.notify_one();
}

bool result_channel::wait(batch& out, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&] { return !tokens_.empty() || (finish_ && !finish_taken_); };
    if (!cv_.wait_for(lk, timeout, ready)) return false;
    for (token_event& t : tokens_) out.tokens.push_back(std::move(t));
    tokens_.clear();
    if (finish_ && !finish_taken_) {
        out.finish = finish_;
        finish_taken_ = true;
    }
    return true;
}

}  // namespace tansy
