#include "server/constraints.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "runtime/output_parser.h"

namespace tansy {

namespace {

constexpr size_t k_max_depth = 64;    // nesting the recogniser accepts
constexpr uint8_t k_max_ws_run = 24;  // whitespace run outside strings (indentation, not an endless pad)
constexpr float k_neg_inf = -std::numeric_limits<float>::infinity();

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

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

// Whole, valid UTF-8 characters only (a token that ends inside a character is checked byte by byte).
bool whole_utf8(const std::string& b) {
    size_t i = 0;
    while (i < b.size()) {
        const unsigned char c = (unsigned char)b[i];
        int need = 0;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c < 0x80) need = 0;
        else if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) need = 2, lo = 0xA0;
        else if (c == 0xED) need = 2, hi = 0x9F;
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) need = 3, lo = 0x90;
        else if (c == 0xF4) need = 3, hi = 0x8F;
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else return false;
        i++;
        for (int k = 0; k < need; k++, i++) {
            if (i >= b.size()) return false;
            const unsigned char d = (unsigned char)b[i];
            if (d < lo || d > hi) return false;
            lo = 0x80, hi = 0xBF;
        }
    }
    return true;
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
        if (b.empty() || !whole_utf8(b)) continue;
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
    // Each token adds at least one byte: with no more tokens than the completion has bytes, spell it out. One
    // token stays for the end of the turn, so that a completed object ends with finish_reason stop.
    const int64_t left = tokens_left - 1;
    const bool closing = left <= (int64_t)closer.size();
    const bool near = left <= (int64_t)closer.size() + 16;
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
            ok = next.feed(b) && (!near || (int64_t)next.closer().size() <= left - 1);
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

// ---- content_spec

namespace {

using ojson = nlohmann::ordered_json;

const std::string k_call_head = "<tool_call>\n<function=";
const std::string k_param_close = "\n</parameter>\n";
const std::string k_value_tag = "\n</parameter>";  // ends a raw value (the parser drops the newline)
const std::string k_call_end = "</function>\n</tool_call>";
const std::vector<std::string> k_param_opts = {"</function>\n</tool_call>", "<parameter="};  // sorted
const char* const k_parser_tags[] = {"</parameter>", "<parameter=", "</function>", "</tool_call>"};

bool tail_ends_with(const char* tail, size_t n, std::string_view tag) {
    return n >= tag.size() && std::string_view(tail + n - tag.size(), tag.size()) == tag;
}

bool has_parser_tag(std::string_view s) {
    for (const char* t : k_parser_tags)
        if (s.find(t) != std::string_view::npos) return true;
    return false;
}

void narrow_range(const std::vector<std::string>& t, uint32_t* lo, uint32_t* hi, uint16_t pos, char c) {
    uint32_t a = *lo, b = *hi;
    while (a < b && (t[a].size() <= pos || t[a][pos] != c)) {
        if (t[a].size() > pos && (unsigned char)t[a][pos] > (unsigned char)c) { a = b; break; }
        a++;
    }
    uint32_t e = a;
    while (e < b && t[e].size() > pos && t[e][pos] == c) e++;
    *lo = a, *hi = a < b ? e : a;
}

struct pending_tool {
    size_t index;
    int root;
};

}  // namespace

std::shared_ptr<const content_spec> build_content_spec(const ojson* json, bool json_strict, const ojson& tools,
                                                       const std::string& only, bool with_tools, bool parallel) {
    auto spec = std::make_shared<content_spec>();
    spec->prog = std::make_shared<schema_program>();
    spec->parallel = parallel;
    schema_program& prog = *spec->prog;
    if (json) {
        {
            schema_program check;  // errors are the client's: found before anything is shared
            check.compile(*json, json_strict);
            check.finish();
        }
        spec->json_root = prog.compile(*json, json_strict);
    }
    std::vector<std::vector<int>> param_nodes;
    if (with_tools && tools.is_array()) {
        for (size_t i = 0; i < tools.size(); i++) {
            const ojson& f = tools[i]["function"];
            content_spec::tool tl;
            tl.name = f["name"].get<std::string>();
            if (!only.empty() && tl.name != only) continue;
            const bool strict = f.contains("strict") && f["strict"].is_boolean() && f["strict"].get<bool>();
            const ojson params = f.contains("parameters") ? f["parameters"] : ojson::object();
            std::vector<int> nodes;
            try {
                if (!params.is_object()) throw schema_error("'parameters' must be an object schema");
                {
                    schema_program check;
                    const int r = check.compile(params, strict);
                    check.finish();
                    const schema_node& root = check.node(r);
                    if (!root.any_of.empty() || root.has_enum || root.alias >= 0 || !(root.types & st_obj))
                        throw schema_error("'parameters' must be an object schema with 'properties'");
                }
                const int root = prog.compile(params, strict);
                const schema_node rn = prog.node(root);
                const ojson* props = params.contains("properties") ? &params["properties"] : nullptr;
                for (size_t k = 0; k < rn.prop_names.size(); k++) {
                    content_spec::param pr;
                    pr.name = rn.prop_names[k];
                    pr.required = rn.prop_required[k];
                    const ojson prop = props && props->contains(pr.name) ? (*props)[pr.name] : ojson::object();
                    const std::string type = tool_param_type(prop);
                    pr.raw = tool_param_is_string(type);
                    if (pr.name.empty() || pr.name.find_first_of("<>\n") != std::string::npos) pr.ok = false;
                    int node = rn.prop_nodes[k];
                    if (!pr.raw) {
                        uint8_t mask = st_any;
                        if (type == "integer" || type == "int") mask = st_int | st_null;
                        else if (type == "number" || type == "float" || type == "double") mask = st_int | st_num | st_null;
                        else if (type == "boolean" || type == "bool") mask = st_bool | st_null;
                        if (mask != st_any) node = prog.restrict_types(node, mask);
                    }
                    pr.node = node;
                    tl.params.push_back(std::move(pr));
                }
            } catch (const schema_error& e) {
                if (strict) throw schema_error("tools[" + std::to_string(i) + "] parameters: " + e.what());
                tl.free = true;
                tl.params.clear();
            }
            spec->tools.push_back(std::move(tl));
        }
    }
    prog.finish();
    if (spec->json_root >= 0 && !prog.satisfiable(spec->json_root))
        throw schema_error("no JSON document (of at most 4096 bytes at its shortest) satisfies the schema");
    for (size_t ti = 0; ti < spec->tools.size(); ti++) {
        content_spec::tool& tl = spec->tools[ti];
        for (content_spec::param& pr : tl.params) {
            if (!pr.ok) continue;
            if (!pr.raw) {
                pr.ok = prog.satisfiable(pr.node);
                pr.min_value = prog.node(pr.node).min_text;
                continue;
            }
            // a raw (string) parameter: the string side of its schema
            int n = pr.node;
            const schema_node* x = &prog.node(n);
            if (!x->any_of.empty()) {
                const schema_node* pick = nullptr;
                for (int b : x->any_of)
                    if ((prog.node(b).types & st_str) && prog.satisfiable(b)) { pick = &prog.node(b); break; }
                x = pick;
            }
            if (!x || !(x->types & st_str) || x->min_len > x->max_len) {
                pr.ok = false;
                continue;
            }
            pr.min_len = x->min_len, pr.max_len = x->max_len;
            if (x->has_enum) {
                pr.has_enum = true;
                for (const std::string& e : x->enums) {
                    const ojson v = ojson::parse(e);
                    if (!v.is_string() || has_parser_tag(v.get<std::string>())) continue;
                    pr.raw_enum.push_back(v.get<std::string>() + k_param_close);
                }
                std::sort(pr.raw_enum.begin(), pr.raw_enum.end());
                if (pr.raw_enum.empty()) {
                    pr.ok = false;
                    continue;
                }
                size_t best = 0;
                for (size_t k = 0; k < pr.raw_enum.size(); k++)
                    if (pr.raw_enum[k].size() < pr.raw_enum[best].size()) best = k;
                pr.min_value = pr.raw_enum[best].substr(0, pr.raw_enum[best].size() - k_param_close.size());
            } else {
                pr.min_value = std::string(pr.min_len, 'a');
            }
        }
        for (const content_spec::param& pr : tl.params)
            if (pr.required && !pr.ok) {
                tl.free = true;  // cannot be written validly: left to the model
                tl.params.clear();
                break;
            }
        std::vector<std::pair<std::string, int>> names;
        for (size_t k = 0; k < tl.params.size(); k++)
            if (tl.params[k].ok) names.emplace_back(tl.params[k].name + ">\n", (int)k);
        std::sort(names.begin(), names.end());
        for (auto& [t, k] : names) tl.pnames_sorted.push_back(t), tl.pnames_param.push_back(k);
    }
    std::vector<std::pair<std::string, int>> names;
    for (size_t ti = 0; ti < spec->tools.size(); ti++) names.emplace_back(spec->tools[ti].name + ">\n", (int)ti);
    std::sort(names.begin(), names.end());
    for (auto& [t, k] : names) spec->names_sorted.push_back(t), spec->names_tool.push_back(k);
    return spec;
}

// ---- content_state

content_state::content_state(const content_spec* s) : s_(s) {}

namespace {

size_t put(std::string* out, std::string_view s) {
    if (out) out->append(s);
    return s.size();
}

bool window_ok(const content_spec::tool& t, size_t next, size_t p) {
    if (p < next || !t.params[p].ok) return false;
    for (size_t i = next; i < p; i++)
        if (t.params[i].required) return false;
    return true;
}

bool required_left(const content_spec::tool& t, size_t next) {
    for (size_t i = next; i < t.params.size(); i++)
        if (t.params[i].required) return true;
    return false;
}

bool any_param_left(const content_spec::tool& t, size_t next) {
    for (size_t i = next; i < t.params.size(); i++) {
        if (t.params[i].ok) return true;
        if (t.params[i].required) return false;
    }
    return false;
}

}  // namespace

size_t content_state::param_rest(size_t p, std::string* out) const {
    const content_spec::param& pr = tool().params[p];
    size_t n = put(out, pr.name) + put(out, ">\n") + put(out, pr.min_value) + put(out, k_param_close);
    return n + tool_rest(p + 1, out);
}

size_t content_state::tool_rest(size_t next, std::string* out) const {
    size_t n = 0;
    const content_spec::tool& t = tool();
    for (size_t i = next; i < t.params.size(); i++) {
        if (!t.params[i].required) continue;
        n += put(out, "<parameter=") + put(out, t.params[i].name) + put(out, ">\n") + put(out, t.params[i].min_value) +
             put(out, k_param_close);
    }
    return n + put(out, k_call_end);
}

// The cheapest completion from the entry of phase ph (names: any tool; params: the current tool from next_).
size_t content_state::phase_rest(uint8_t ph, std::string* out) const {
    if (ph == ph_params) return tool_rest(next_, out);
    if (ph == ph_name) {
        size_t best = SIZE_MAX, which = 0;
        for (size_t k = 0; k < s_->names_sorted.size(); k++) {
            content_state c = *this;
            c.tool_ = (int16_t)s_->names_tool[k];
            const size_t n = s_->names_sorted[k].size() + (s_->tools[(size_t)c.tool_].free ? 0 : c.tool_rest(0, nullptr));
            if (n < best) best = n, which = k;
        }
        if (best == SIZE_MAX) return SIZE_MAX;
        if (out) {
            content_state c = *this;
            c.tool_ = (int16_t)s_->names_tool[which];
            put(out, s_->names_sorted[which]);
            if (!s_->tools[(size_t)c.tool_].free) c.tool_rest(0, out);
        }
        return best;
    }
    return 0;
}

size_t content_state::closer(std::string* out) const {
    switch (phase_) {
        case ph_start: {
            const size_t j = s_->json_root >= 0 ? s_->prog->node(s_->json_root).min_size : SIZE_MAX;
            const size_t t = s_->tools.empty() ? SIZE_MAX : k_call_head.size() + phase_rest(ph_name, nullptr);
            if (j == SIZE_MAX && t == SIZE_MAX) return SIZE_MAX;
            if (j <= t) return put(out, s_->prog->node(s_->json_root).min_text);
            return put(out, k_call_head) + phase_rest(ph_name, out);
        }
        case ph_lit: return put(out, std::string_view(*lit_).substr(pos_)) + phase_rest(lit_next_, out);
        case ph_name: {
            size_t best = SIZE_MAX;
            uint32_t which = lo_;
            for (uint32_t k = lo_; k < hi_; k++) {
                content_state c = *this;
                c.tool_ = (int16_t)s_->names_tool[k];
                const size_t n = (*texts_)[k].size() - pos_ + (c.tool().free ? 0 : c.tool_rest(0, nullptr));
                if (n < best) best = n, which = k;
            }
            if (out && best != SIZE_MAX) {
                content_state c = *this;
                c.tool_ = (int16_t)s_->names_tool[which];
                put(out, std::string_view((*texts_)[which]).substr(pos_));
                if (!c.tool().free) c.tool_rest(0, out);
            }
            return best;
        }
        case ph_params: {
            const content_spec::tool& t = tool();
            if (pos_ == 0) return tool_rest(next_, out);
            if (lo_ == 0 && !required_left(t, next_)) return put(out, std::string_view(k_param_opts[0]).substr(pos_));
            size_t best = SIZE_MAX, which = 0;
            for (size_t p = next_; p < t.params.size(); p++) {
                if (!window_ok(t, next_, p)) continue;
                const size_t n = param_rest(p, nullptr);
                if (n < best) best = n, which = p;
            }
            if (best == SIZE_MAX) return SIZE_MAX;
            return put(out, std::string_view(k_param_opts[1]).substr(pos_)) + param_rest(which, out);
        }
        case ph_pname: {
            const content_spec::tool& t = tool();
            size_t best = SIZE_MAX;
            uint32_t which = lo_;
            for (uint32_t k = lo_; k < hi_; k++) {
                const size_t p = (size_t)t.pnames_param[k];
                if (!window_ok(t, next_, p)) continue;
                const size_t n = param_rest(p, nullptr) - t.params[p].name.size() - 2 + ((*texts_)[k].size() - pos_);
                if (n < best) best = n, which = k;
            }
            if (out && best != SIZE_MAX) {
                const size_t p = (size_t)t.pnames_param[which];
                put(out, std::string_view((*texts_)[which]).substr(pos_));
                put(out, t.params[p].min_value);
                put(out, k_param_close);
                tool_rest(p + 1, out);
            }
            return best;
        }
        case ph_sval: {
            const content_spec::param& pr = tool().params[(size_t)param_];
            size_t n = 0;
            for (int k = 0; k < u8_need_; k++) {
                const char b = (char)(k == 0 ? u8_lo_ : 0x80);
                n += put(out, std::string_view(&b, 1));
            }
            if (m_ > 0 && chars_ - m_ >= pr.min_len) {
                n += put(out, std::string_view(k_value_tag).substr(m_));
            } else {
                if (chars_ < pr.min_len) n += put(out, std::string(pr.min_len - chars_, 'a'));
                n += put(out, k_value_tag);
            }
            return n + put(out, "\n") + tool_rest(next_, out);
        }
        case ph_senum: {
            uint32_t best = lo_;
            for (uint32_t k = lo_; k < hi_; k++)
                if ((*texts_)[k].size() < (*texts_)[best].size()) best = k;
            return put(out, std::string_view((*texts_)[best]).substr(pos_)) + tool_rest(next_, out);
        }
        case ph_jval: {
            const size_t j = js_.closer(out);
            if (j == SIZE_MAX) return SIZE_MAX;
            return j + put(out, k_param_close) + tool_rest(next_, out);
        }
        case ph_json: return js_.closer(out);
        default: return 0;
    }
}

bool content_state::complete() const { return phase_ == ph_after || (phase_ == ph_json && js_.accepting()); }

int content_state::plain_class(int64_t* room) const {
    *room = UINT32_MAX;
    if (phase_ == ph_json) {
        *room = js_.free_string_room();
        if (!s_->tools.empty())  // "<tool_call>" may not be spelled (feed): plain tokens only without a '<' under way
            return *room >= 0 && std::memchr(tail_, '<', tail_n_) == nullptr ? 3 : 0;
        return *room >= 0 ? 1 : 0;
    }
    if (phase_ == ph_jval) {  // no parser tag may be under way either
        *room = js_.free_string_room();
        return *room >= 0 && std::memchr(tail_, '<', tail_n_) == nullptr ? 3 : 0;
    }
    if (phase_ == ph_sval && u8_need_ == 0 && m_ <= 1) {
        const content_spec::param& pr = tool().params[(size_t)param_];
        if (pr.min_len == 0 && pr.max_len == UINT32_MAX) return 2;
    }
    return 0;
}

bool content_state::begin_value() {
    const content_spec::param& pr = tool().params[(size_t)param_];
    tail_n_ = 0, m_ = 0, chars_ = 0, u8_need_ = 0;
    if (!pr.raw) {
        js_ = schema_state(s_->prog.get(), pr.node);
        phase_ = ph_jval;
    } else if (pr.has_enum) {
        texts_ = &pr.raw_enum, lo_ = 0, hi_ = (uint32_t)pr.raw_enum.size(), pos_ = 0;
        phase_ = ph_senum;
    } else {
        phase_ = ph_sval;
    }
    return true;
}

namespace {
void push_tail(char* tail, uint8_t* n, char c) {
    if (*n == 15) {
        std::memmove(tail, tail + 1, 14);
        *n = 14;
    }
    tail[(*n)++] = c;
}
}  // namespace

bool content_state::feed(char c) {
    const unsigned char uc = (unsigned char)c;
    switch (phase_) {
        case ph_start:
            if (!s_->tools.empty()) {
                if ((c == '\n' || c == ' ') && ws_ < 4) {
                    ws_++;
                    return true;
                }
                if (c == '<') {
                    lit_ = &k_call_head, pos_ = 1, lit_next_ = ph_name, phase_ = ph_lit;
                    return true;
                }
            }
            if (s_->json_root < 0) return false;
            js_ = schema_state(s_->prog.get(), s_->json_root);
            phase_ = ph_json;
            return js_.feed(c) == schema_state::result::ok;
        case ph_lit:
            if (pos_ >= lit_->size() || (*lit_)[pos_] != c) return false;
            if (++pos_ < lit_->size()) return true;
            phase_ = lit_next_;
            pos_ = 0;
            if (phase_ == ph_name) texts_ = &s_->names_sorted, lo_ = 0, hi_ = (uint32_t)s_->names_sorted.size();
            if (phase_ == ph_params) texts_ = &k_param_opts, lo_ = 0, hi_ = 2;
            return true;
        case ph_name:
            narrow_range(*texts_, &lo_, &hi_, pos_, c);
            if (lo_ == hi_) return false;
            if ((*texts_)[lo_].size() == ++pos_) {
                tool_ = (int16_t)s_->names_tool[lo_];
                if (tool().free) {
                    phase_ = ph_free;
                    return true;
                }
                next_ = 0, phase_ = ph_params, texts_ = &k_param_opts, lo_ = 0, hi_ = 2, pos_ = 0;
            }
            return true;
        case ph_params: {
            narrow_range(*texts_, &lo_, &hi_, pos_, c);
            const content_spec::tool& t = tool();
            const bool end_ok = !required_left(t, next_), param_ok = any_param_left(t, next_);
            bool ok = false;
            for (uint32_t k = lo_; k < hi_; k++) ok = ok || (k == 0 ? end_ok : param_ok);
            if (!ok) return false;
            if (hi_ - lo_ > 1 || (*texts_)[lo_].size() != ++pos_) {
                if (hi_ - lo_ > 1) pos_++;
                return true;
            }
            if (lo_ == 0) {
                calls_++;
                phase_ = ph_after;
            } else {
                texts_ = &t.pnames_sorted, lo_ = 0, hi_ = (uint32_t)t.pnames_sorted.size(), pos_ = 0;
                phase_ = ph_pname;
            }
            return true;
        }
        case ph_pname: {
            narrow_range(*texts_, &lo_, &hi_, pos_, c);
            const content_spec::tool& t = tool();
            bool ok = false;
            for (uint32_t k = lo_; k < hi_ && !ok; k++) ok = window_ok(t, next_, (size_t)t.pnames_param[k]);
            if (!ok) return false;
            if ((*texts_)[lo_].size() == ++pos_ && window_ok(t, next_, (size_t)t.pnames_param[lo_])) {
                param_ = (int16_t)t.pnames_param[lo_];
                next_ = (uint16_t)(param_ + 1);
                return begin_value();
            }
            return true;
        }
        case ph_senum:
            narrow_range(*texts_, &lo_, &hi_, pos_, c);
            if (lo_ == hi_) return false;
            if ((*texts_)[lo_].size() == ++pos_) {
                phase_ = ph_params, texts_ = &k_param_opts, lo_ = 0, hi_ = 2, pos_ = 0;
            }
            return true;
        case ph_sval: {
            const content_spec::param& pr = tool().params[(size_t)param_];
            if (u8_need_ > 0) {
                if (uc < u8_lo_ || uc > u8_hi_) return false;
                u8_need_--;
                u8_lo_ = 0x80, u8_hi_ = 0xBF;
            } else {
                u8_lo_ = 0x80, u8_hi_ = 0xBF;
                if (uc < 0x80) {}
                else if (uc >= 0xC2 && uc <= 0xDF) u8_need_ = 1;
                else if (uc == 0xE0) u8_need_ = 2, u8_lo_ = 0xA0;
                else if (uc == 0xED) u8_need_ = 2, u8_hi_ = 0x9F;
                else if (uc >= 0xE1 && uc <= 0xEF) u8_need_ = 2;
                else if (uc == 0xF0) u8_need_ = 3, u8_lo_ = 0x90;
                else if (uc == 0xF4) u8_need_ = 3, u8_hi_ = 0x8F;
                else if (uc >= 0xF1 && uc <= 0xF3) u8_need_ = 3;
                else return false;
                chars_++;
            }
            push_tail(tail_, &tail_n_, c);
            m_ = 0;
            for (size_t k = std::min<size_t>(tail_n_, k_value_tag.size()); k > 0; k--)
                if (std::string_view(tail_ + tail_n_ - k, k) == std::string_view(k_value_tag).substr(0, k)) {
                    m_ = (uint8_t)k;
                    break;
                }
            if (m_ == k_value_tag.size()) {
                const uint32_t content = chars_ - m_;
                if (content < pr.min_len || content > pr.max_len) return false;
                lit_ = &k_param_close, pos_ = (uint16_t)k_value_tag.size(), lit_next_ = ph_params, phase_ = ph_lit;
                return true;
            }
            for (const char* tag : k_parser_tags)
                if (tail_ends_with(tail_, tail_n_, tag)) return false;
            return chars_ - m_ <= pr.max_len;
        }
        case ph_jval: {
            if (!js_.started() && (c == ' ' || c == '\n' || c == '\t' || c == '\r')) return false;
            const schema_state::result r = js_.feed(c);
            if (r == schema_state::result::ended) {
                if (c != '\n') return false;
                lit_ = &k_param_close, pos_ = 1, lit_next_ = ph_params, phase_ = ph_lit;
                return true;
            }
            if (r != schema_state::result::ok) return false;
            push_tail(tail_, &tail_n_, c);
            for (const char* tag : k_parser_tags)
                if (tail_ends_with(tail_, tail_n_, tag)) return false;
            return true;
        }
        case ph_after:
            if (s_->parallel && calls_ < 8 && c == '\n') {
                lit_ = &k_call_head, pos_ = 0, lit_next_ = ph_name, phase_ = ph_lit;
                return true;
            }
            return false;
        case ph_json:
            if (js_.feed(c) != schema_state::result::ok) return false;
            if (!s_->tools.empty()) {  // with tools offered, the parser would take "<tool_call>" in a string for a call
                push_tail(tail_, &tail_n_, c);
                if (tail_ends_with(tail_, tail_n_, "<tool_call>")) return false;
            }
            return true;
        case ph_free: return true;
        default: return false;
    }
}

bool content_state::feed(std::string_view s) {
    for (char c : s)
        if (!feed(c)) return false;
    return true;
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
    std::vector<float> saved(logits, logits + n);
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
    for (int64_t i = 0; i < n; i++) {
        if (logits[i] == k_neg_inf) continue;
        const std::string& b = t.bytes[(size_t)i];
        bool ok;
        if (is_eos(t, (int32_t)i)) {
            ok = complete;
        } else if (t.special[(size_t)i] || b.empty() || !first_ok[(unsigned char)b[0]] ||
                   (b.size() >= 2 && !closing && !plain && !pair_ok((unsigned char)b[0], (unsigned char)b[1]))) {
            ok = false;
        } else if (closing) {
            content_state next = st_;
            ok = b.size() <= closer.size() && closer.compare(0, b.size(), b) == 0 && next.feed(b);
        } else if (plain && (!(plain & 1) || t.json_plain[(size_t)i]) && (!(plain & 2) || t.raw_plain[(size_t)i]) &&
                   t.code_points[(size_t)i] <= room) {
            ok = true;
        } else {
            content_state next = st_;
            ok = next.feed(b) && (!near || (int64_t)next.closer(nullptr) <= left - 1);
        }
        if (!ok) logits[i] = k_neg_inf;
    }
    ensure_one(t, logits, saved, n);
}

void schema_constraint::accept(int32_t id) {
    const token_table& t = *t_;
    if (reasoning_) {
        if (id == t.think_end) reasoning_ = false;
        return;
    }
    if (id < 0 || id >= (int32_t)t.bytes.size() || t.special[(size_t)id]) {
        done_ = true;  // the turn ended
        return;
    }
    if (!st_.feed(t.bytes[(size_t)id])) done_ = true;  // (only the mask's way out gets here)
}

}  // namespace tansy
