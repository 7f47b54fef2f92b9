// Token constraints (constraints.h): the shared token table and, per request, the masks that keep a step's
// candidate tokens to what the recogniser allows (json_prefix.cpp, content_spec.cpp, json_schema.cpp).
#include "server/constraints.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tokenizer/utf8.h"

namespace tansy {

namespace {

constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();

bool is_eos(const token_table& t, int32_t id) { return std::find(t.eos.begin(), t.eos.end(), id) != t.eos.end(); }

// During reasoning: nothing is constrained until the tokens left fall to the reserve; then </think> comes. The
// turn may not end inside the reasoning (the constrained answer must come).
void mask_reasoning(const token_table& t, float* logits, int64_t n, int64_t tokens_left, int64_t reserve) {
    if (t.think_end < 0 || t.think_end >= n) return;
    for (int32_t e : t.eos)
        if (e >= 0 && e < n) logits[e] = k_neg_inf;
    if (tokens_left > reserve) return;
    for (int64_t i = 0; i < n; i++)
        if (i != t.think_end) logits[i] = k_neg_inf;
}

// Keeps at least one token: when a mask removed all, the end of the turn is the way out.
void ensure_one(const token_table& t, float* logits, const std::vector<float>& saved, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (logits[i] != k_neg_inf) return;
    for (int32_t e : t.eos)
        if (e >= 0 && e < n) logits[e] = saved.empty() ? 0.0f : saved[(size_t)e];
}

// The loop every mask shares: each token still allowed for which ok(id, bytes) is false is masked, and one way
// out is kept (ensure_one).
template <class F>
void mask_tokens(const token_table& t, float* logits, int64_t n, F&& ok) {
    std::vector<float> saved(logits, logits + n);
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] == k_neg_inf) continue;
        if (!ok(i, t.bytes[(size_t)i])) logits[i] = k_neg_inf;
    }
    ensure_one(t, logits, saved, n);
}

// The reasoning's part of accept(): true while it runs (the id is then taken by it); </think> ends it.
bool accept_reasoning(const token_table& t, bool* reasoning, int32_t id) {
    if (!*reasoning) return false;
    if (id == t.think_end) *reasoning = false;
    return true;
}

// A token with text to feed a recogniser (in the table, not special).
bool is_text(const token_table& t, int32_t id) {
    return id >= 0 && id < (int32_t)t.bytes.size() && !t.special[(size_t)id];
}

}  // namespace

std::shared_ptr<const token_table> token_table::build(const tokenizer& tok, int64_t n_valid, std::vector<int32_t> eos,
                                                      int32_t think_end) {
    auto t = std::make_shared<token_table>();
    t->bytes.resize((size_t)n_valid);
    t->special.resize((size_t)n_valid, true);
    for (int64_t i = 0; i < n_valid && i < tok.size(); i++) {
        if (tok.is_special((int32_t)i)) continue;
        t->bytes[(size_t)i] = std::string(tok.token_bytes((int32_t)i));
        t->special[(size_t)i] = false;
    }
    t->eos = std::move(eos);
    t->think_end = think_end;
    t->json_plain.assign((size_t)n_valid, 0);
    t->raw_plain.assign((size_t)n_valid, 0);
    t->code_points.assign((size_t)n_valid, 0);
    for (int64_t i = 0; i < n_valid; i++) {
        const std::string& b = t->bytes[(size_t)i];
        // whole, valid UTF-8 characters only (a token that ends inside a character is checked byte by byte)
        if (b.empty() || utf8_find_invalid(b) >= 0) continue;
        bool json = true, raw = true;
        for (char c : b) {
            if (c == '"' || c == '\\' || (unsigned char)c < 0x20) json = false;
            if (c == '<') raw = false;
        }
        t->json_plain[(size_t)i] = json;
        t->raw_plain[(size_t)i] = raw;
        size_t cp = 0;
        for (unsigned char c : b) cp += (c & 0xC0) != 0x80;
        t->code_points[(size_t)i] = (uint16_t)std::min<size_t>(cp, UINT16_MAX);
    }
    return t;
}

// ---- json_object_constraint

json_object_constraint::json_object_constraint(std::shared_ptr<const token_table> t, bool thinking,
                                               int64_t reasoning_reserve)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve) {}

void json_object_constraint::mask(float* logits, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return mask_reasoning(t, logits, n, tokens_left, reserve_);
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    const std::string closer = json_.closer();
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out. One
    // token stays for the end of the turn, so that a completed object ends with finish_reason stop.
    const int64_t left = tokens_left - 1;
    const bool closing = left <= (int64_t)closer.size();
    const bool near = left <= (int64_t)closer.size() + 16;
    // Which first bytes can follow at all: most tokens are ruled out by one table look-up, not a parse
    // (outside strings only a few bytes fit; the real vocabulary has 248k tokens).
    bool first_ok[256];
    for (int c = 0; c < 256; c++) {
        json_prefix p = json_;
        first_ok[c] = p.feed((char)c);
    }
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        if (!b.empty() && !closing && !first_ok[(unsigned char)b[0]]) return false;
        if (json_.complete()) return is_eos(t, (int32_t)i);
        if (t.special[(size_t)i] || b.empty()) return false;
        if (closing) return closer.compare(0, b.size(), b) == 0;
        json_prefix next = json_;
        return next.feed(b) && (!near || (int64_t)next.closer().size() <= left - 1);
    });
}

void json_object_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id) || !is_text(*t_, id)) return;
    json_.feed(t_->bytes[(size_t)id]);  // the mask only let valid tokens through
}

// ---- prefix_constraint

prefix_constraint::prefix_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                                     std::vector<std::string> alternatives)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve), alts_(std::move(alternatives)) {}

bool prefix_constraint::allowed(const std::string& s) const {
    for (const std::string& a : alts_)
        if (a.compare(0, std::min(a.size(), s.size()), s, 0, std::min(a.size(), s.size())) == 0) return true;
    return false;
}

void prefix_constraint::mask(float* logits, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return mask_reasoning(t, logits, n, tokens_left, reserve_);
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        return !t.special[(size_t)i] && !b.empty() && allowed(so_far_ + b);
    });
}

void prefix_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id)) return;
    if (!is_text(*t_, id)) {
        done_ = true;  // the turn ended (or something unexpected): nothing left to force
        return;
    }
    so_far_ += t_->bytes[(size_t)id];
    for (const std::string& a : alts_)
        if (so_far_.size() >= a.size() && so_far_.compare(0, a.size(), a) == 0) done_ = true;
    if (!allowed(so_far_)) done_ = true;
}

// ---- schema_constraint

schema_constraint::schema_constraint(std::shared_ptr<const token_table> t, bool thinking, int64_t reasoning_reserve,
                                     std::shared_ptr<const content_spec> spec)
    : t_(std::move(t)), reasoning_(thinking && t_->think_end >= 0), reserve_(reasoning_reserve), spec_(std::move(spec)),
      st_(spec_.get()) {}

void schema_constraint::mask(float* logits, int64_t n, int64_t tokens_left) {
    const token_table& t = *t_;
    if (reasoning_) return mask_reasoning(t, logits, n, tokens_left, reserve_);
    n = std::min<int64_t>(n, (int64_t)t.bytes.size());
    std::string closer;
    const size_t clen = st_.closer(&closer);
    const bool complete = st_.complete();
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out. One
    // token stays for the end of the turn, so that a completed document ends with finish_reason stop.
    const int64_t left = tokens_left - 1;
    const bool closing = clen != SIZE_MAX && left <= (int64_t)clen;
    const bool near = clen != SIZE_MAX && left <= (int64_t)clen + 16;
    // Most tokens fail on their first or second byte: a table look-up each, filled once per step (the second
    // byte's row only for first bytes that fit), instead of a walk per token
    bool first_ok[256];
    std::vector<content_state> after_first;
    after_first.reserve(256);
    for (int c = 0; c < 256; c++) {
        after_first.push_back(st_);
        first_ok[c] = after_first.back().feed((char)c);
    }
    std::vector<int8_t> second_ok(256 * 256, -1);
    auto pair_ok = [&](unsigned char a, unsigned char b) {
        int8_t& v = second_ok[(size_t)a * 256 + b];
        if (v < 0) {
            for (int c = 0; c < 256; c++) {
                content_state p = after_first[a];
                second_ok[(size_t)a * 256 + (size_t)c] = p.feed((char)c);
            }
        }
        return v == 1;
    };
    // Plain-text tokens inside a string need no walk; near the end too inside JSON strings, whose closer such a
    // token never lengthens (a raw value's may grow by one: walked there)
    int64_t room = 0;
    int plain = st_.plain_class(&room);
    if (near && (plain == 2 || (int64_t)clen > left - 1)) plain = 0;
    mask_tokens(t, logits, n, [&](int64_t i, const std::string& b) {
        if (is_eos(t, (int32_t)i)) return complete;
        if (t.special[(size_t)i] || b.empty() || !first_ok[(unsigned char)b[0]] ||
            (b.size() >= 2 && !closing && !plain && !pair_ok((unsigned char)b[0], (unsigned char)b[1])))
            return false;
        if (closing) {
            content_state next = st_;
            return b.size() <= closer.size() && closer.compare(0, b.size(), b) == 0 && next.feed(b);
        }
        if (plain && (!(plain & 1) || t.json_plain[(size_t)i]) && (!(plain & 2) || t.raw_plain[(size_t)i]) &&
            t.code_points[(size_t)i] <= room)
            return true;
        content_state next = st_;
        return next.feed(b) && (!near || (int64_t)next.closer(nullptr) <= left - 1);
    });
}

void schema_constraint::accept(int32_t id) {
    if (accept_reasoning(*t_, &reasoning_, id)) return;
    if (!is_text(*t_, id)) {
        done_ = true;  // the turn ended
        return;
    }
    if (!st_.feed(t_->bytes[(size_t)id])) done_ = true;  // (only the mask's way out gets here)
}

}  // namespace tansy
