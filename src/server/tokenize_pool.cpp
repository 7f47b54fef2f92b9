#include "server/tokenize_pool.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>

namespace tansy {

tokenize_pool::tokenize_pool(const tokenizer& tok, int threads) : tok_(tok) { pool_.start(std::max(1, threads)); }

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
