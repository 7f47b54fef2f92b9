#include "server/tokenize_pool.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <latch>
#include <mutex>

namespace tansy {

tokenize_pool::tokenize_pool(const tokenizer& tok, int threads) : tok_(tok) {
    const int n = std::max(1, threads);
    pool_.start(n);
    // Every thread encodes once now, so that its pre-token cache (6 MB, allocated and zeroed on the first encode:
    // ~2-3 ms, bench_tokenizer's cold run) is in place before a request waits on it. The first latch hands one
    // task to each thread: a thread that took one blocks until all are taken.
    std::latch taken(n), done(n);
    for (int i = 0; i < n; i++)
        pool_.post([&] {
            taken.arrive_and_wait();
            try {
                (void)tok_.encode(" warm up");
            } catch (...) {  // nothing to warm: the first request pays instead
            }
            done.count_down();
        });
    done.wait();
}

tokenize_pool::~tokenize_pool() { pool_.stop_and_join(); }

std::vector<int32_t> tokenize_pool::encode(const std::string& text, const std::vector<byte_range>& plain) {
    std::mutex done_mu;
    std::condition_variable done_cv;
    bool done = false;
    std::vector<int32_t> ids;
    std::exception_ptr err;
    pool_.post([&] {
        try {
            ids = tok_.encode(text, std::span<const byte_range>(plain));
        } catch (...) {
            err = std::current_exception();
        }
        std::lock_guard<std::mutex> dl(done_mu);
        done = true;
        done_cv.notify_one();
    });
    std::unique_lock<std::mutex> dl(done_mu);
    done_cv.wait(dl, [&] { return done; });
    if (err) std::rethrow_exception(err);
    return ids;
}

}  // namespace tansy
