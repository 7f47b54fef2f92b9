#include "server/tokenize_pool.h"

#include <exception>

namespace tansy {

tokenize_pool::tokenize_pool(const tokenizer& tok, int threads) : tok_(tok) {
    for (int i = 0; i < std::max(1, threads); i++)
        threads_.emplace_back([this] {
            for (;;) {
                std::function<void()> job;
                {
                    std::unique_lock<std::mutex> lk(mu_);
                    cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
                    if (jobs_.empty()) return;
                    job = std::move(jobs_.front());
                    jobs_.pop_front();
                }
                job();
            }
        });
}

tokenize_pool::~tokenize_pool() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
}

std::vector<int32_t> tokenize_pool::encode(const std::string& text, const std::vector<byte_range>& plain) {
    std::mutex done_mu;
    std::condition_variable done_cv;
    bool done = false;
    std::vector<int32_t> ids;
    std::exception_ptr err;
    {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_.push_back([&] {
            try {
                ids = tok_.encode(text, std::span<const byte_range>(plain));
            } catch (...) {
                err = std::current_exception();
            }
            std::lock_guard<std::mutex> dl(done_mu);
            done = true;
            done_cv.notify_one();
        });
    }
    cv_.notify_one();
    std::unique_lock<std::mutex> dl(done_mu);
    done_cv.wait(dl, [&] { return done; });
    if (err) std::rethrow_exception(err);
    return ids;
}

}  // namespace tansy
