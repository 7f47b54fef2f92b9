#include "server/load_client.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

namespace tansy {

namespace {

using clock_t_ = std::chrono::steady_clock;

double secs(clock_t_::time_point a, clock_t_::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Text in a chat delta or a completions choice.
bool has_text(const nlohmann::json& choice) {
    if (const auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
        for (const char* k : {"content", "reasoning_content"})
            if (const auto c = d->find(k); c != d->end() && c->is_string() && !c->get_ref<const std::string&>().empty())
                return true;
        if (const auto t = d->find("tool_calls"); t != d->end() && t->is_array() && !t->empty()) return true;
        return false;
    }
    const auto t = choice.find("text");
    return t != choice.end() && t->is_string() && !t->get_ref<const std::string&>().empty();
}

// The answer's text in a chat delta (content, not reasoning) or a completions choice.
void append_content(const nlohmann::json& choice, std::string& out) {
    const auto d = choice.find("delta");
    const nlohmann::json& from = d != choice.end() && d->is_object() ? *d : choice;
    for (const char* k : {"content", "text"})
        if (const auto c = from.find(k); c != from.end() && c->is_string()) out += c->get_ref<const std::string&>();
}

// Parses the SSE events of one response as its pieces arrive.
class sse_timer {
  public:
    sse_timer(stream_timing& r, clock_t_::time_point round_start, clock_t_::time_point sent, stream_control* ctl)
        : r_(r), t0_(round_start), sent_(sent), ctl_(ctl) {}

    void feed(std::string_view piece) {
        const auto now = clock_t_::now();
        buf_ += piece;
        size_t end;
        while ((end = buf_.find("\n\n")) != std::string::npos) {
            event(std::string_view(buf_).substr(0, end), now);
            buf_.erase(0, end + 2);
        }
    }
    const std::string& rest() const { return buf_; }
    bool done() const { return done_; }
    bool got_text() const { return got_text_; }

  private:
    void event(std::string_view ev, clock_t_::time_point now) {
        if (ev.rfind("data: ", 0) != 0) return;  // comments, other fields
        ev.remove_prefix(6);
        if (ev == "[DONE]") {
            done_ = true;
            return;
        }
        const nlohmann::json j = nlohmann::json::parse(ev, nullptr, /*allow_exceptions=*/false);
        if (j.is_discarded() || !j.is_object()) {
            if (r_.error.empty()) r_.error = "malformed event: " + std::string(ev.substr(0, 200));
            return;
        }
        if (const auto e = j.find("error"); e != j.end()) {
            r_.error = "error event: " + e->dump();
            return;
        }
        if (const auto u = j.find("usage"); u != j.end() && u->is_object()) {
            r_.completion_tokens = u->value("completion_tokens", (int64_t)0);
            r_.prompt_tokens = u->value("prompt_tokens", (int64_t)0);
            if (const auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object())
                r_.cached_tokens = d->value("cached_tokens", (int64_t)0);
        }
        const auto ch = j.find("choices");
        if (ch == j.end() || !ch->is_array()) return;
        for (const auto& c : *ch) {
            if (const auto f = c.find("finish_reason"); f != c.end() && f->is_string()) r_.finish_reason = f->get<std::string>();
            append_content(c, r_.content);
            if (!has_text(c)) continue;
            const double t = secs(t0_, now);
            if (!got_text_) {
                got_text_ = true;
                r_.ttft_s = secs(sent_, now);
                r_.first_s = t;
            } else {
                gaps_.push_back(t - r_.last_s);
            }
            r_.last_s = t;
            r_.event_s.push_back(t);
            r_.text_events++;
            if (ctl_) ctl_->text_events.store(r_.text_events);
        }
    }

  public:
    // Gaps per token, once the token count is known.
    void finish() {
        const int64_t T = r_.completion_tokens, K = r_.text_events;
        const double per_event = K > 1 && T > 1 ? (double)(T - 1) / (double)(K - 1) : 1.0;
        r_.itl_s.clear();
        for (double g : gaps_) r_.itl_s.push_back(g / per_event);
    }

  private:
    stream_timing& r_;
    clock_t_::time_point t0_, sent_;
    stream_control* ctl_;
    std::string buf_;
    std::vector<double> gaps_;
    bool done_ = false, got_text_ = false;
};

}  // namespace

double stream_timing::tok_s() const {
    const double span = last_s - first_s;
    return text_events > 1 && completion_tokens > 1 && span > 0 ? (double)(completion_tokens - 1) / span : 0.0;
}

stream_timing timed_stream(http_client& client, const std::string& path, const std::string& body,
                           clock_t_::time_point round_start, stream_control* ctl) {
    stream_timing r;
    try {
        const auto sent = clock_t_::now();
        sse_timer timer(r, round_start, sent, ctl);
        std::string transport_error;
        r.status = client.post(
            path, body,
            [&](std::string_view piece) {
                timer.feed(piece);
                if (ctl && ctl->stop.load() && !timer.done() && r.text_events > 0) r.stopped = true;
                return !r.stopped;
            },
            &transport_error);
        r.end_s = secs(round_start, clock_t_::now());
        if (r.stopped) {
            r.status = 200;  // it was streaming: the caller closed it
            r.completion_tokens = r.text_events;
            r.finish_reason = "stopped";
        }
        timer.finish();
        if (r.stopped) {
            if (r.text_events == 0 && r.error.empty()) r.error = "stopped before its first token";
        } else if (r.status < 0) {
            r.error = "no response: " + transport_error;
        } else if (r.status != 200) {
            r.error = "HTTP " + std::to_string(r.status) + ": " + timer.rest().substr(0, 500);
        } else if (r.error.empty() && !timer.done()) {
            r.error = "the stream ended without [DONE]";
        } else if (r.error.empty() && r.completion_tokens == 0) {
            r.error = "no usage chunk (the request must set stream_options.include_usage)";
        }
        r.ok = r.error.empty();
    } catch (const std::exception& e) {
        r.ok = false;
        r.error = std::string("client error: ") + e.what();
    }
    if (ctl) ctl->done.store(true);
    return r;
}

int64_t round_result::tokens() const {
    int64_t n = 0;
    for (const stream_timing& s : streams) n += s.completion_tokens;
    return n;
}

int round_result::failed() const {
    int n = 0;
    for (const stream_timing& s : streams) n += !s.ok;
    return n;
}

round_result run_round(const std::string& host, int port, const std::string& path, const std::vector<std::string>& bodies) {
    stream_set set(host, port, path, bodies);
    return set.wait();
}

stream_set::stream_set(const std::string& host, int port, const std::string& path, std::vector<std::string> bodies,
                       std::optional<time_point> round_start) {
    const size_t n = bodies.size();
    res_.streams.resize(n);
    for (size_t i = 0; i < n; i++) ctl_.push_back(std::make_unique<stream_control>());
    // Every client thread exists before any sends (creating hundreds takes milliseconds); then all go at once.
    struct gate {
        std::mutex mu;
        std::condition_variable cv;
        bool go = false;
        clock_t_::time_point t0;
    };
    auto g = std::make_shared<gate>();
    threads_.reserve(n);
    for (size_t i = 0; i < n; i++) {
        threads_.emplace_back([this, g, host, port, path, body = std::move(bodies[i]), i] {
            http_client client(host, port);
            clock_t_::time_point t0;
            {
                std::unique_lock<std::mutex> lk(g->mu);
                g->cv.wait(lk, [&] { return g->go; });
                t0 = g->t0;
            }
            res_.streams[i] = timed_stream(client, path, body, t0, ctl_[i].get());
        });
    }
    {
        std::lock_guard<std::mutex> lk(g->mu);
        const auto now = clock_t_::now();
        g->t0 = round_start.value_or(now);
        sent_s_ = secs(g->t0, now);
        g->go = true;
    }
    g->cv.notify_all();
}

stream_set::~stream_set() {
    stop();
    wait();
}

void stream_set::stop() {
    for (auto& c : ctl_) c->stop.store(true);
}

round_result stream_set::wait() {
    if (!joined_) {
        for (std::thread& t : threads_) t.join();
        joined_ = true;
        for (const stream_timing& s : res_.streams) res_.wall_s = std::max(res_.wall_s, s.end_s);
    }
    return res_;
}

}  // namespace tansy
