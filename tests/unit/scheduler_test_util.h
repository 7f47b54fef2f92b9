// Scheduler tests' shared pieces: a sink that collects a sequence's events, and the bundled tiny model on the
// CPU backend (one per test binary) or on the CUDA backend where one is usable.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/check.h"
#include "runtime/scheduler.h"
#include "runtime/text_engine.h"
#include "tokenizer/chat_template.h"

namespace tansy::test {

class collect_sink final : public sequence_sink {
  public:
    void on_token(const token_event& e) override {
        std::lock_guard<std::mutex> lk(mu_);
        tokens_.push_back(e);
        cv_.notify_all();
    }
    void on_finish(const finish_event& e) override {
        std::lock_guard<std::mutex> lk(mu_);
        finishes_++;
        fin_ = e;
        cv_.notify_all();
    }
    // waits for the finish event (fails the test after 120 s: long prompts under ASan on a loaded machine)
    finish_event wait() {
        std::unique_lock<std::mutex> lk(mu_);
        EXPECT_TRUE(cv_.wait_for(lk, std::chrono::seconds(120), [&] { return finishes_ > 0; })) << "no finish event";
        return fin_;
    }
    void wait_tokens(size_t n) {
        std::unique_lock<std::mutex> lk(mu_);
        EXPECT_TRUE(cv_.wait_for(lk, std::chrono::seconds(60), [&] { return tokens_.size() >= n || finishes_ > 0; }));
    }
    std::vector<int32_t> ids() {
        std::lock_guard<std::mutex> lk(mu_);
        std::vector<int32_t> v;
        for (const token_event& e : tokens_) v.push_back(e.id);
        return v;
    }
    std::vector<token_event> events() {
        std::lock_guard<std::mutex> lk(mu_);
        return tokens_;
    }
    int finishes() {
        std::lock_guard<std::mutex> lk(mu_);
        return finishes_;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<token_event> tokens_;
    finish_event fin_;
    int finishes_ = 0;
};

// A grammar-like constraint whose allowed set moves with every token it takes: ids with (id + taken) % mod != 0.
class rotating_constraint final : public token_constraint {
  public:
    explicit rotating_constraint(int mod) : mod_(mod) {}
    bool active() const override { return true; }
    void allow(uint32_t* words, int64_t n_valid, int64_t) override {
        std::fill(words, words + mask_words(n_valid), 0u);
        for (int64_t v = 0; v < n_valid; v++)
            if ((v + taken_) % mod_ != 0) words[v / 32] |= 1u << (v % 32);
    }
    void accept(int32_t id) override {
        EXPECT_NE((id + taken_) % mod_, 0) << "a masked id was picked";
        taken_++;
    }

  private:
    int mod_;
    int64_t taken_ = 0;
};

// The bundled tiny model on the CPU backend, one for the whole test binary.
inline text_engine& tiny() {
    static text_engine te([] {
        engine_options o;
        o.backend = "cpu";
        o.threads = 1;
        return o;
    }());
    return te;
}

// One user message through the model's chat template.
inline std::vector<int32_t> user_prompt(text_engine& te, const std::string& user) {
    const nlohmann::ordered_json msgs = nlohmann::ordered_json::array({{{"role", "user"}, {"content", user}}});
    return te.tok().encode(render_chat(msgs, nullptr, chat_options{}));
}

// What engine::generate gives for prompt, greedy, up to max_tokens (ended early by stop_ids): what a scheduled
// sequence of the same request must give.
inline std::vector<int32_t> greedy_reference(text_engine& te, const std::vector<int32_t>& prompt, int64_t max_tokens,
                                             const std::vector<int32_t>& stop_ids) {
    generation_request req;
    req.prompt = prompt;
    req.max_tokens = max_tokens;
    req.stop_ids = stop_ids;
    auto st = te.eng().new_sequence((int64_t)prompt.size() + max_tokens);
    std::vector<int32_t> out;
    te.eng().generate(*st, req, [&](int32_t id) { return out.push_back(id), true; });
    return out;
}

// The bundled model on the CUDA backend, or null (and why) where there is none.
inline std::unique_ptr<text_engine> cuda_tiny(std::string* why) {
    try {
        engine_options o;
        o.backend = "cuda";
        return std::make_unique<text_engine>(o);
    } catch (const error& e) {
        *why = e.what();
        return nullptr;
    }
}

}  // namespace tansy::test
