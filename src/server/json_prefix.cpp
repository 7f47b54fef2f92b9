// json_prefix: a byte-level recogniser of one JSON object (any keys, any values), with the shortest text that
// closes it; what json_object_constraint (constraints.cpp) checks candidate tokens against.
#include "server/constraints.h"

#include "tokenizer/utf8.h"

namespace tansy {

namespace {

constexpr size_t k_max_depth = 64;    // nesting the recogniser accepts
constexpr uint8_t k_max_ws_run = 24;  // whitespace run outside strings (indentation, not an endless pad)

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

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
            // strings stay valid UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF)
            if (u8_need_ > 0 || (unsigned char)c >= 0x80) return utf8_step(&u8_need_, &u8_lo_, &u8_hi_, (uint8_t)c);
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

plain_info json_prefix::plain() const {
    plain_info p;
    if (stage_ != stage::string || esc_ != 0 || u8_need_ != 0) return p;
    p.cls = 1;
    p.room = INT64_MAX;
    return p;
}

void json_prefix::key(std::string* out) const {
    const uint8_t lit = stage_ != stage::literal ? 0 : lit_[0] == 't' ? 1 : lit_[0] == 'f' ? 2 : 3;
    const uint8_t f[] = {(uint8_t)stage_, ws_run_, (uint8_t)(stage_ == stage::string ? key_ : 0),
                         (uint8_t)(stage_ == stage::string ? esc_ : 0), (uint8_t)(stage_ == stage::string ? u8_need_ : 0),
                         (uint8_t)(u8_need_ && stage_ == stage::string ? u8_lo_ : 0),
                         (uint8_t)(u8_need_ && stage_ == stage::string ? u8_hi_ : 0),
                         (uint8_t)(stage_ == stage::number ? num_ : 0), lit, (uint8_t)(lit ? lit_pos_ : 0)};
    out->append((const char*)f, sizeof f);
    out->append(stack_);
}

}  // namespace tansy
