#include "server/constraints.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tansy {

namespace {

constexpr size_t k_max_depth = 64;    // nesting the recogniser accepts
constexpr uint8_t k_max_ws_run = 24;  // whitespace run outside strings (indentation, not an endless pad)
constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

bool is_eos(const token_table& t, int32_t id) { return std::find(t.eos.begin(), t.eos.end(), id) != t.eos.end(); }

// During reasoning: nothing is constrained until the tokens left fall to the reserve; then </think> comes.
void mask_reasoning(const token_table& t, float* logits, int64_t n, int64_t tokens_left, int64_t reserve) {
    if (t.think_end < 0 || t.think_end >= n || tokens_left > reserve) return;
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
    return t;
}

// ---- json_prefix

bool json_prefix::end_value() {
    stage_ = stack_.empty() ? stage::done : stage::after_value;
    return true;
}

bool json_prefix::feed_value_start(char c) {
    switch (c) {
        case '{':
        case '[':
            if (stack_.size() >= k_max_depth) return false;
            stack_ += c;
            stage_ = c == '{' ? stage::obj_first : stage::arr_first;
            return true;
        case '"':
            stage_ = stage::string;
            key_ = false;
            esc_ = 0;
            return true;
        case 't': lit_ = "true"; break;
        case 'f': lit_ = "false"; break;
        case 'n': lit_ = "null"; break;
        case '-': stage_ = stage::number, num_ = 1; return true;
        default:
            if (!is_digit(c)) return false;
            stage_ = stage::number;
            num_ = c == '0' ? 2 : 3;
            return true;
    }
    stage_ = stage::literal;
    lit_pos_ = 1;
    return true;
}

// Number states: 1 after '-', 2 after a leading 0, 3 integer digits, 4 after '.', 5 fraction digits,
// 6 after e/E, 7 after the exponent's sign, 8 exponent digits. 2, 3, 5 and 8 may end the number.
bool json_prefix::feed_number(char c, bool* consumed) {
    *consumed = true;
    switch (num_) {
        case 1: if (c == '0') { num_ = 2; return true; } if (is_digit(c)) { num_ = 3; return true; } return false;
        case 4: if (is_digit(c)) { num_ = 5; return true; } return false;
        case 6: if (c == '+' || c == '-') { num_ = 7; return true; } if (is_digit(c)) { num_ = 8; return true; } return false;
        case 7: if (is_digit(c)) { num_ = 8; return true; } return false;
        default: break;
    }
    if (is_digit(c) && num_ != 2) return true;
    if (c == '.' && (num_ == 2 || num_ == 3)) { num_ = 4; return true; }
    if ((c == 'e' || c == 'E') && (num_ == 2 || num_ == 3 || num_ == 5)) { num_ = 6; return true; }
    *consumed = false;  // the number ended before c
    return true;
}

bool json_prefix::feed(char c) {
    if (stage_ != stage::string && stage_ != stage::number && stage_ != stage::literal) {
        if (is_ws(c)) {
            if (stage_ == stage::done || ws_run_ >= k_max_ws_run) return false;
            ws_run_++;
            return true;
        }
        ws_run_ = 0;
    }
    switch (stage_) {
        case stage::start:
            if (c != '{') return false;
            stack_ += '{';
            stage_ = stage::obj_first;
            return true;
        case stage::obj_first:
            if (c == '}') {
                stack_.pop_back();
                return end_value();
            }
            [[fallthrough]];
        case stage::obj_key:
            if (c != '"') return false;
            stage_ = stage::string;
            key_ = true;
            esc_ = 0;
            return true;
        case stage::colon:
            if (c != ':') return false;
            stage_ = stage::value;
            return true;
        case stage::arr_first:
            if (c == ']') {
                stack_.pop_back();
                return end_value();
            }
            [[fallthrough]];
        case stage::value: return feed_value_start(c);
        case stage::after_value:
            if (c == ',') {
                stage_ = stack_.back() == '{' ? stage::obj_key : stage::value;
                return true;
            }
            if ((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '[')) {
                stack_.pop_back();
                return end_value();
            }
            return false;
        case stage::string:
            if (esc_ == 1) {
                if (c == 'u') {
                    esc_ = 5;
                    return true;
                }
                if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
                    esc_ = 0;
                    return true;
                }
                return false;
            }
            if (esc_ >= 2) {
                if (!is_hex(c)) return false;
                esc_ = esc_ == 2 ? 0 : esc_ - 1;
                return true;
            }
            if (u8_need_ > 0 || (unsigned char)c >= 0x80) return feed_utf8((unsigned char)c);
            if (c == '"') {
                if (key_) {
                    stage_ = stage::colon;
                    return true;
                }
                return end_value();
            }
            if (c == '\\') {
                esc_ = 1;
                return true;
            }
            return (unsigned char)c >= 0x20;  // raw control characters are not allowed in JSON strings
        case stage::number: {
            bool consumed = false;
            if (!feed_number(c, &consumed)) return false;
            if (consumed) return true;
            end_value();
            return feed(c);
        }
        case stage::literal:
            if (c != lit_[lit_pos_]) return false;
            if (lit_[++lit_pos_] == 0) end_value();
            return true;
        case stage::done: return false;
    }
    return false;
}

// Strings must stay valid UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
bool json_prefix::feed_utf8(unsigned char c) {
    if (u8_need_ > 0) {
        if (c < u8_lo_ || c > u8_hi_) return false;
        u8_need_--;
        u8_lo_ = 0x80, u8_hi_ = 0xBF;
        return true;
    }
    u8_lo_ = 0x80, u8_hi_ = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) u8_need_ = 1;
    else if (c == 0xE0) u8_need_ = 2, u8_lo_ = 0xA0;
    else if (c == 0xED) u8_need_ = 2, u8_hi_ = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) u8_need_ = 2;
    else if (c == 0xF0) u8_need_ = 3, u8_lo_ = 0x90;
    else if (c == 0xF4) u8_need_ = 3, u8_hi_ = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) u8_need_ = 3;
    else return false;
    return true;
}

bool json_prefix::feed(std::string_view s) {
    for (char c : s)
        if (!feed(c)) return false;
    return true;
}

std::string json_prefix::closer() const {
    std::string out;
    switch (stage_) {
        case stage::done: return "";
        case stage::start: return "{}";
        case stage::string:
            for (int k = 0; k < u8_need_; k++) out += (char)(k == 0 ? u8_lo_ : 0x80);  // finish the character
            if (esc_ == 1) out += 'n';
            if (esc_ >= 2) out.append((size_t)(esc_ - 1), '0');
            out += '"';
            if (key_) out += ":0";
            break;
        case stage::number:
            if (num_ == 1 || num_ == 4 || num_ == 6 || num_ == 7) out += '0';
            break;
        case stage::literal: out += lit_ + lit_pos_; break;
        case stage::colon: out += ":0"; break;
        case stage::value: out += '0'; break;
        case stage::obj_key: out += "\"\":0"; break;
        case stage::obj_first:
        case stage::arr_first:
        case stage::after_value: break;
    }
    for (size_t i = stack_.size(); i-- > 0;) out += stack_[i] == '{' ? '}' : ']';
    return out;
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
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out.
    const bool closing = tokens_left <= (int64_t)closer.size();
    const bool near = tokens_left <= (int64_t)closer.size() + 16;
    std::vector<float> saved(logits, logits + n);
    // Which first bytes can follow at all: most tokens are ruled out by one table look-up, not a parse
    // (outside strings only a few bytes fit; the real vocabulary has 248k tokens).
    bool first_ok[256];
    for (int c = 0; c < 256; c++) {
        json_prefix p = json_;
        first_ok[c] = p.feed((char)c);
    }
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] == k_neg_inf) continue;
        const std::string& b = t.bytes[(size_t)i];
        bool ok;
        if (!b.empty() && !closing && !first_ok[(unsigned char)b[0]]) {
            ok = false;
        } else if (json_.complete()) {
            ok = is_eos(t, (int32_t)i);
        } else if (t.special[(size_t)i] || b.empty()) {
            ok = false;
        } else if (closing) {
            ok = closer.compare(0, b.size(), b) == 0;
        } else {
            json_prefix next = json_;
            ok = next.feed(b) && (!near || (int64_t)next.closer().size() <= tokens_left - 1);
        }
        if (!ok) logits[i] = k_neg_inf;
    }
    ensure_one(t, logits, saved, n);
}

void json_object_constraint::accept(int32_t id) {
    const token_table& t = *t_;
    if (reasoning_) {
        if (id == t.think_end) reasoning_ = false;
        return;
    }
    if (id < 0 || id >= (int32_t)t.bytes.size() || t.special[(size_t)id]) return;
    json_.feed(t.bytes[(size_t)id]);  // the mask only let valid tokens through
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
    std::vector<float> saved(logits, logits + n);
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] == k_neg_inf) continue;
        const std::string& b = t.bytes[(size_t)i];
        if (t.special[(size_t)i] || b.empty() || !allowed(so_far_ + b)) logits[i] = k_neg_inf;
    }
    ensure_one(t, logits, saved, n);
}

void prefix_constraint::accept(int32_t id) {
    const token_table& t = *t_;
    if (reasoning_) {
        if (id == t.think_end) reasoning_ = false;
        return;
    }
    if (id < 0 || id >= (int32_t)t.bytes.size() || t.special[(size_t)id]) {
        done_ = true;  // the turn ended (or something unexpected): nothing left to force
        return;
    }
    so_far_ += t.bytes[(size_t)id];
    for (const std::string& a : alts_)
        if (so_far_.size() >= a.size() && so_far_.compare(0, a.size(), a) == 0) done_ = true;
    if (!allowed(so_far_)) done_ = true;
}

}  // namespace tansy
