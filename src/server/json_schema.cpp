// JSON Schema recogniser: schema_state reads a JSON value byte by byte against a compiled schema_program
// (json_schema_compile.cpp) and finds the shortest text that completes it. The subset: json_schema.h.
#include "server/json_schema.h"

#include <algorithm>
#include <cstring>

#include "tokenizer/utf8.h"

namespace tansy {

namespace {

constexpr size_t k_max_alts = 16;
constexpr uint8_t k_max_ws = 24;
constexpr uint32_t k_max_key = 256;
constexpr uint32_t k_max_digits = 15;
constexpr size_t k_max_frames = k_max_nesting + 2;

enum : uint8_t { k_value, k_obj, k_arr, k_str, k_num, k_lit, k_key };
// obj st: 0 after '{', 1 after ',', 2 after a key, 3 in a value, 4 after a value
// arr st: 0 after '[', 1 after a value, 2 in a value
// num st: 1 after '-', 2 after a leading 0, 3 integer digits, 4 after '.', 5 fraction digits, 6 after e/E,
//         7 after the exponent's sign, 8 exponent digits (2, 3, 5, 8 may end)

const std::vector<std::string> k_bool_texts = {"false", "true"};
const std::vector<std::string> k_null_texts = {"null"};

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// ---- the recogniser

struct ctx {
    const schema_program* p;
    std::vector<schema_alt>* forks;
};

bool obj_required_left(const schema_node& n, size_t from) {
    for (size_t i = from; i < n.prop_required.size(); i++)
        if (n.prop_required[i]) return true;
    return false;
}

// The window of properties that may come next: [next, last] (last: the first required one from next on).
size_t obj_window_end(const schema_node& n, size_t next) {
    for (size_t i = next; i < n.prop_required.size(); i++)
        if (n.prop_required[i]) return i + 1;
    return n.prop_required.size();
}

// A value of `node` inside a container whose frame is the depth-th on the stack: satisfiable, and its shortest
// form nests within k_max_frames (the check a '{' or '[' makes, with the value's frame at depth + 1), so that a
// key or an item once written can always be completed.
bool fits(const schema_program& p, int node, size_t depth) {
    if (!p.satisfiable(node)) return false;
    const int d = p.node(node).min_depth;
    return d == 0 || depth + 1 + (size_t)d + 1 <= k_max_frames;
}

bool prop_ok(const schema_program& p, const schema_node& n, size_t next, size_t i, size_t depth) {
    return i >= next && i < obj_window_end(n, next) && fits(p, n.prop_nodes[i], depth);
}

bool extra_ok(const schema_program& p, const schema_node& n, size_t depth) {
    return n.additional >= 0 && fits(p, n.additional, depth);
}

bool any_key_left(const schema_program& p, const schema_node& n, size_t next, size_t depth) {
    if (extra_ok(p, n, depth)) return true;
    for (size_t i = next; i < obj_window_end(n, next); i++)
        if (fits(p, n.prop_nodes[i], depth)) return true;
    return false;
}

int item_of(const schema_node& n, uint32_t i) { return i < n.prefix.size() ? n.prefix[i] : n.items; }

bool item_ok(const schema_program& p, const schema_node& n, uint32_t i, size_t depth) {
    const int it = item_of(n, i);
    return i < n.max_items && it >= 0 && fits(p, it, depth);
}

// Narrows a sorted range of texts to those with byte c at pos.
void narrow(const std::vector<std::string>& t, uint32_t* lo, uint32_t* hi, uint16_t pos, char c) {
    const uint32_t a = (uint32_t)(std::lower_bound(t.begin() + *lo, t.begin() + *hi, c,
                                                   [&](const std::string& s, char x) {
                                                       return s.size() <= pos || (unsigned char)s[pos] < (unsigned char)x;
                                                   }) - t.begin());
    const uint32_t b = (uint32_t)(std::upper_bound(t.begin() + a, t.begin() + *hi, c,
                                                   [&](char x, const std::string& s) {
                                                       return (unsigned char)x < (unsigned char)s[pos];
                                                   }) - t.begin());
    *lo = a, *hi = b;
}

bool step_utf8(schema_frame& f, unsigned char c) { return utf8_step(&f.u8_need, &f.u8_lo, &f.u8_hi, c); }

// A value of node n is expected next (a union forks when its first byte comes).
void start_value(schema_alt& a, int n) {
    schema_frame f;
    f.kind = k_value;
    f.node = n;
    a.stack.push_back(f);
}

// The top value is complete: pop it and tell its container.
void end_value(schema_alt& a) {
    a.stack.pop_back();
    if (a.stack.empty()) return;
    schema_frame& f = a.stack.back();
    if (f.kind == k_obj) f.st = 4;
    else if (f.kind == k_arr) f.st = 1, f.count++;
}

bool num_can_end(uint8_t st) { return st == 2 || st == 3 || st == 5 || st == 8; }

bool lit_exact(const schema_frame& f) { return f.lo < f.hi && (*f.texts)[f.lo].size() == f.pos; }

schema_state::result feed_alt(const ctx& x, schema_alt& a, char c);

schema_state::result refeed(const ctx& x, schema_alt& a, char c) {
    if (a.stack.empty()) return schema_state::result::ended;
    return feed_alt(x, a, c);
}

schema_state::result feed_alt(const ctx& x, schema_alt& a, char c) {
    using R = schema_state::result;
    if (a.stack.empty()) return R::ended;
    schema_frame& f = a.stack.back();
    const schema_program& p = *x.p;
    const schema_node& n = p.node(f.node);
    const unsigned char uc = (unsigned char)c;
    const bool between = f.kind == k_value || f.kind == k_obj || f.kind == k_arr;
    if (between) {
        if (is_ws(c)) {
            if (f.kind == k_obj && f.st == 3) return R::fail;
            if (a.ws >= k_max_ws) return R::fail;
            a.ws++;
            return R::ok;
        }
        a.ws = 0;
    }
    switch (f.kind) {
        case k_value: {
            if (!p.satisfiable(f.node)) return R::fail;
            if (!n.any_of.empty()) {  // each branch gets its own alternative
                const schema_alt base = a;
                R first = R::fail;
                bool any = false;
                for (int b : n.any_of) {
                    if (!p.satisfiable(b)) continue;
                    if (!any) {
                        any = true;
                        a.stack.back().node = b;
                        first = feed_alt(x, a, c);
                    } else if (x.forks->size() < k_max_alts) {
                        schema_alt alt = base;
                        alt.stack.back().node = b;
                        if (feed_alt(x, alt, c) == R::ok) x.forks->push_back(std::move(alt));
                    }
                }
                return first;
            }
            if (n.has_enum) {
                f.kind = k_lit, f.texts = &n.enums, f.lo = 0, f.hi = (uint32_t)n.enums.size(), f.pos = 0;
                return feed_alt(x, a, c);
            }
            const size_t depth = a.stack.size();
            if (c == '{' && (n.types & st_obj)) {
                if (depth + (size_t)n.min_depth + 1 > k_max_frames) return R::fail;
                f.kind = k_obj, f.st = 0, f.next = 0, f.cur = -1;
                return R::ok;
            }
            if (c == '[' && (n.types & st_arr)) {
                if (depth + (size_t)n.min_depth + 1 > k_max_frames || n.min_items > n.max_items) return R::fail;
                f.kind = k_arr, f.st = 0, f.count = 0;
                return R::ok;
            }
            if (c == '"' && (n.types & st_str)) {
                if (n.min_len > n.max_len) return R::fail;
                f.kind = k_str, f.count = 0, f.esc = 0, f.u8_need = 0;
                return R::ok;
            }
            if ((c == '-' || is_digit(c)) && (n.types & (st_int | st_num))) {
                f.kind = k_num, f.flags = !(n.types & st_num), f.count = 1;
                f.st = c == '-' ? 1 : c == '0' ? 2 : 3;
                if (c == '-') f.count = 0;
                return R::ok;
            }
            if ((c == 't' || c == 'f') && (n.types & st_bool)) {
                f.kind = k_lit, f.texts = &k_bool_texts, f.lo = 0, f.hi = 2, f.pos = 0;
                return feed_alt(x, a, c);
            }
            if (c == 'n' && (n.types & st_null)) {
                f.kind = k_lit, f.texts = &k_null_texts, f.lo = 0, f.hi = 1, f.pos = 0;
                return feed_alt(x, a, c);
            }
            return R::fail;
        }
        case k_obj:
            switch (f.st) {
                case 0:
                case 1:
                    if (c == '}' && f.st == 0 && !obj_required_left(n, f.next)) {
                        end_value(a);
                        return R::ok;
                    }
                    if (c != '"' || a.stack.size() >= k_max_frames) return R::fail;
                    {
                        schema_frame k;
                        k.kind = k_key, k.node = f.node, k.texts = &n.keys_sorted, k.lo = 0,
                        k.hi = (uint32_t)n.keys_sorted.size(), k.pos = 0, k.flags = extra_ok(p, n, a.stack.size()), k.count = 0;
                        const uint16_t next = f.next;
                        a.stack.push_back(k);
                        // no key of the window left and no additional ones: a dead end
                        if (!any_key_left(p, n, next, a.stack.size() - 1)) return R::fail;
                    }
                    return R::ok;
                case 2: {
                    if (c != ':') return R::fail;
                    f.st = 3;
                    const int v = f.cur >= 0 ? n.prop_nodes[(size_t)f.cur] : n.additional;
                    start_value(a, v);
                    return R::ok;
                }
                case 4:
                    if (c == ',' && any_key_left(p, n, f.next, a.stack.size())) {
                        f.st = 1;
                        return R::ok;
                    }
                    if (c == '}' && !obj_required_left(n, f.next)) {
                        end_value(a);
                        return R::ok;
                    }
                    return R::fail;
                default: return R::fail;
            }
        case k_arr:
            if (c == ']' && f.st != 2 && f.count >= n.min_items) {
                end_value(a);
                return R::ok;
            }
            if (f.st == 0) {
                if (!item_ok(p, n, 0, a.stack.size())) return R::fail;
                f.st = 2;
                start_value(a, item_of(n, 0));
                return feed_alt(x, a, c);
            }
            if (f.st == 1 && c == ',' && item_ok(p, n, f.count, a.stack.size())) {
                f.st = 2;
                start_value(a, item_of(n, f.count));
                return R::ok;
            }
            return R::fail;
        case k_str:
            if (f.esc == 1) {
                if (c == 'u') { f.esc = 5; return R::ok; }
                if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
                    f.esc = 0;
                    return R::ok;
                }
                return R::fail;
            }
            if (f.esc >= 2) {  // \uXXXX: 5 = first hex digit; 15 = second after a 'd' (no surrogates)
                if (!is_hex(c)) return R::fail;
                if (f.esc == 15) {
                    if (!(c >= '0' && c <= '7')) return R::fail;
                    f.esc = 3;
                    return R::ok;
                }
                if (f.esc == 5 && (c == 'd' || c == 'D')) { f.esc = 15; return R::ok; }
                f.esc = f.esc == 2 ? 0 : f.esc - 1;
                return R::ok;
            }
            if (f.u8_need > 0) return step_utf8(f, uc) ? R::ok : R::fail;
            if (c == '"') {
                if (f.count < n.min_len) return R::fail;
                end_value(a);
                return R::ok;
            }
            if (uc < 0x20) return R::fail;
            if (f.count >= n.max_len) return R::fail;
            if (uc >= 0x80 && !step_utf8(f, uc)) return R::fail;
            if (c == '\\') f.esc = 1;
            f.count++;
            return R::ok;
        case k_num: {
            const bool int_only = f.flags;
            switch (f.st) {
                case 1:
                    if (c == '0') { f.st = 2; f.count = 1; return R::ok; }
                    if (is_digit(c)) { f.st = 3; f.count = 1; return R::ok; }
                    return R::fail;
                case 4: if (is_digit(c)) { f.st = 5; f.count = 1; return R::ok; } return R::fail;
                case 6:
                    if (c == '+' || c == '-') { f.st = 7; return R::ok; }
                    if (is_digit(c)) { f.st = 8; f.count = 1; return R::ok; }
                    return R::fail;
                case 7: if (is_digit(c)) { f.st = 8; f.count = 1; return R::ok; } return R::fail;
                default: break;
            }
            if (is_digit(c) && f.st != 2) {
                if (f.count >= (f.st == 8 ? 2u : k_max_digits)) return R::fail;
                f.count++;
                return R::ok;
            }
            if (!int_only && c == '.' && (f.st == 2 || f.st == 3)) { f.st = 4; return R::ok; }
            if (!int_only && (c == 'e' || c == 'E') && (f.st == 2 || f.st == 3 || f.st == 5)) { f.st = 6; return R::ok; }
            end_value(a);  // the number ended before c
            return refeed(x, a, c);
        }
        case k_lit: {
            uint32_t lo = f.lo, hi = f.hi;
            narrow(*f.texts, &lo, &hi, f.pos, c);
            if (lo == hi) {
                if (!lit_exact(f)) return R::fail;
                end_value(a);
                return refeed(x, a, c);
            }
            f.lo = lo, f.hi = hi, f.pos++;
            if (hi - lo == 1 && (*f.texts)[lo].size() == f.pos) end_value(a);
            return R::ok;
        }
        case k_key: {
            const schema_frame& o = a.stack[a.stack.size() - 2];
            uint32_t lo = f.lo, hi = f.hi;
            if (lo < hi) narrow(*f.texts, &lo, &hi, f.pos, c);
            bool listed = false;  // a key of the window still fits
            const size_t od = a.stack.size() - 1;  // the object's depth
            for (uint32_t i = lo; i < hi && !listed; i++) listed = prop_ok(p, n, o.next, (size_t)n.keys_prop[i], od);
            if (c == '"' && !listed) {  // the end of the key (a '"' inside a listed key follows a backslash)
                if (f.u8_need) return R::fail;
                const int prop = lit_exact(f) ? n.keys_prop[f.lo] : -1;
                if (prop >= 0 && !prop_ok(p, n, o.next, (size_t)prop, od)) return R::fail;
                if (prop < 0 && !f.flags) return R::fail;  // (an additional key never spells a listed one)
                a.stack.pop_back();
                schema_frame& ob = a.stack.back();
                ob.cur = (int16_t)prop;
                if (prop >= 0) ob.next = (uint16_t)(prop + 1);
                ob.st = 2;
                return R::ok;
            }
            bool extra = f.flags && (f.u8_need > 0 || f.count < k_max_key) && c != '\\' && c != '"' && uc >= 0x20;
            if (extra && (f.u8_need > 0 || uc >= 0x80)) {
                schema_frame t = f;
                extra = step_utf8(t, uc);
                if (extra) f.u8_need = t.u8_need, f.u8_lo = t.u8_lo, f.u8_hi = t.u8_hi;
            }
            if (!listed && !extra) return R::fail;
            f.flags = extra;
            f.lo = lo, f.hi = hi, f.pos++, f.count++;
            return R::ok;
        }
        default: return R::fail;
    }
}

}  // namespace

namespace {

void put_str(size_t* len, std::string* out, std::string_view s) {
    *len += s.size();
    if (out) out->append(s);
}

// The cheapest text closing the object of frame f from its state st (a value or key above it already closed),
// with `next` the first property that may still come.
void close_obj(const schema_program& p, const schema_frame& f, uint8_t st, size_t next, size_t depth, size_t* len,
               std::string* out) {
    const schema_node& n = p.node(f.node);
    auto entry = [&](size_t i, bool comma) {
        if (comma) put_str(len, out, ",");
        put_str(len, out, "\"");
        put_str(len, out, n.prop_keys[i]);
        put_str(len, out, "\":");
        put_str(len, out, p.node(n.prop_nodes[i]).min_text);
    };
    bool comma = st != 0 && st != 1;
    if (st == 2) {
        put_str(len, out, ":");
        put_str(len, out, p.node(f.cur >= 0 ? n.prop_nodes[(size_t)f.cur] : n.additional).min_text);
    }
    if (st == 1 && !obj_required_left(n, next)) {  // after ',' a key must come: the cheapest one
        size_t best = SIZE_MAX, best_cost = SIZE_MAX;
        for (size_t i = next; i < obj_window_end(n, next); i++) {
            if (!fits(p, n.prop_nodes[i], depth)) continue;
            const size_t cost = n.prop_keys[i].size() + p.node(n.prop_nodes[i]).min_size;
            if (cost < best_cost) best = i, best_cost = cost;
        }
        if (extra_ok(p, n, depth) && p.node(n.additional).min_size < best_cost) {
            put_str(len, out, "\"\":");
            put_str(len, out, p.node(n.additional).min_text);
        } else if (best != SIZE_MAX) {
            entry(best, false);
        }
        put_str(len, out, "}");
        return;
    }
    for (size_t i = next; i < n.prop_required.size(); i++) {
        if (!n.prop_required[i]) continue;
        entry(i, comma);
        comma = true;
    }
    put_str(len, out, "}");
}

size_t close_alt(const schema_program& p, const schema_alt& a, std::string* out) {
    size_t len = 0;
    for (size_t i = a.stack.size(); i-- > 0;) {
        const schema_frame& f = a.stack[i];
        const schema_node& n = p.node(f.node);
        switch (f.kind) {
            case k_value: put_str(&len, out, n.min_text); break;
            case k_str: {
                for (int k = 0; k < f.u8_need; k++) {
                    const char b = (char)(k == 0 ? f.u8_lo : 0x80);
                    put_str(&len, out, std::string_view(&b, 1));
                }
                if (f.esc == 1) put_str(&len, out, "n");
                else if (f.esc == 15) put_str(&len, out, "000");
                else if (f.esc >= 2) put_str(&len, out, std::string((size_t)(f.esc - 1), '0'));
                if (f.count < n.min_len) put_str(&len, out, std::string(n.min_len - f.count, 'a'));
                put_str(&len, out, "\"");
                break;
            }
            case k_num:
                if (f.st == 1 || f.st == 4 || f.st == 6 || f.st == 7) put_str(&len, out, "0");
                break;
            case k_lit: {
                uint32_t best = f.lo;
                for (uint32_t k = f.lo; k < f.hi; k++)
                    if ((*f.texts)[k].size() < (*f.texts)[best].size()) best = k;
                put_str(&len, out, std::string_view((*f.texts)[best]).substr(f.pos));
                break;
            }
            case k_key: {  // the key, its value, then the object below (handled here)
                const schema_frame& o = a.stack[i - 1];
                auto rest = [&](size_t next) {
                    size_t l = 0;
                    close_obj(p, o, 4, next, i, &l, nullptr);
                    return l;
                };
                size_t best = SIZE_MAX, best_cost = SIZE_MAX;
                for (uint32_t k = f.lo; k < f.hi; k++) {
                    const size_t prop = (size_t)n.keys_prop[k];
                    if (!prop_ok(p, n, o.next, prop, i)) continue;
                    const size_t cost = n.keys_sorted[k].size() - f.pos + p.node(n.prop_nodes[prop]).min_size + rest(prop + 1);
                    if (cost < best_cost) best = k, best_cost = cost;
                }
                size_t next = o.next;
                // (a key spelling a listed one cannot end as an additional key)
                if (f.flags && !(best != SIZE_MAX && lit_exact(f)) &&
                    (best == SIZE_MAX || f.u8_need + p.node(n.additional).min_size + rest(next) < best_cost)) {
                    for (int k = 0; k < f.u8_need; k++) {
                        const char b = (char)(k == 0 ? f.u8_lo : 0x80);
                        put_str(&len, out, std::string_view(&b, 1));
                    }
                    put_str(&len, out, "\":");
                    put_str(&len, out, p.node(n.additional).min_text);
                } else if (best != SIZE_MAX) {
                    const size_t prop = (size_t)n.keys_prop[best];
                    put_str(&len, out, std::string_view(n.keys_sorted[best]).substr(f.pos));
                    put_str(&len, out, "\":");
                    put_str(&len, out, p.node(n.prop_nodes[prop]).min_text);
                    next = prop + 1;
                }
                close_obj(p, o, 4, next, i, &len, out);
                i--;
                break;
            }
            case k_obj: close_obj(p, f, f.st, f.next, i + 1, &len, out); break;
            case k_arr: {
                uint32_t done = f.count + (f.st == 2 ? 1 : 0);
                for (uint32_t k = done; k < n.min_items; k++) {
                    if (k > 0) put_str(&len, out, ",");
                    put_str(&len, out, p.node(item_of(n, k)).min_text);
                }
                put_str(&len, out, "]");
                break;
            }
            default: break;
        }
    }
    return len;
}

}  // namespace

schema_state::schema_state(const schema_program* p, int root) : p_(p) {
    schema_alt a;
    a.stack.reserve(8);
    start_value(a, root);
    alts_.push_back(std::move(a));
    n_ = 1;
}

schema_state::schema_state(const schema_state& o)
    : p_(o.p_), alts_(o.alts_.begin(), o.alts_.begin() + o.n_), n_(o.n_), started_(o.started_) {}

// Copies the live alternatives into this state's own (their stacks' buffers reused: no allocation once warm).
schema_state& schema_state::operator=(const schema_state& o) {
    if (this == &o) return *this;
    p_ = o.p_, n_ = o.n_, started_ = o.started_;
    if (alts_.size() < n_) alts_.resize(n_);
    for (size_t i = 0; i < n_; i++) alts_[i] = o.alts_[i];
    return *this;
}

schema_state::result schema_state::feed(char c) {
    started_ = true;
    std::vector<schema_alt> forks;
    const ctx x{p_, &forks};
    size_t w = 0;
    bool ended = false;
    for (size_t i = 0; i < n_; i++) {
        const result r = feed_alt(x, alts_[i], c);
        if (r == result::ok) {
            if (w != i) std::swap(alts_[w], alts_[i]);
            w++;
        } else if (r == result::ended) {
            ended = true;
        }
    }
    n_ = (uint8_t)w;
    for (schema_alt& f : forks) {
        if (n_ >= k_max_alts) break;
        if (alts_.size() == n_) alts_.push_back(std::move(f));
        else alts_[n_] = std::move(f);
        n_++;
    }
    if (n_ > 0) return result::ok;
    return ended ? result::ended : result::fail;
}

bool schema_state::feed(std::string_view s) {
    for (char c : s)
        if (feed(c) != result::ok) return false;
    return true;
}

bool schema_state::accepting() const {
    for (size_t i = 0; i < n_; i++) {
        const schema_alt& a = alts_[i];
        if (a.stack.empty()) return true;
        if (a.stack.size() != 1) continue;
        const schema_frame& f = a.stack.back();
        if (f.kind == k_num && num_can_end(f.st)) return true;
        if (f.kind == k_lit && lit_exact(f)) return true;
    }
    return false;
}

bool schema_state::finished() const {
    for (size_t i = 0; i < n_; i++)
        if (!alts_[i].stack.empty()) return false;
    return n_ > 0;
}

size_t schema_state::closer(std::string* out) const {
    size_t best = SIZE_MAX;
    size_t which = 0;
    for (size_t i = 0; i < n_; i++) {
        const size_t n = close_alt(*p_, alts_[i], nullptr);
        if (n < best) best = n, which = i;
    }
    if (best == SIZE_MAX) return SIZE_MAX;
    if (out) close_alt(*p_, alts_[which], out);
    return best;
}

int64_t schema_state::free_string_room(bool* exact, bool* bytes) const {
    *exact = false, *bytes = false;
    if (n_ != 1 || alts_[0].stack.empty()) return -1;
    const schema_frame& f = alts_[0].stack.back();
    if (f.kind == k_key && f.lo == f.hi && f.flags && f.u8_need == 0) {  // an additional key, no listed one left
        *bytes = true;
        return (int64_t)k_max_key - (int64_t)f.count;
    }
    if (f.kind != k_str || f.esc != 0 || f.u8_need != 0) return -1;
    *exact = true;
    const schema_node& n = p_->node(f.node);
    return n.max_len == UINT32_MAX ? (int64_t)UINT32_MAX : (int64_t)n.max_len - (int64_t)f.count;
}

namespace {

template <class T>
void put_raw(std::string* out, T v) {
    out->append((const char*)&v, sizeof v);
}

}  // namespace

void schema_state::key(std::string* out) const {
    put_raw(out, started_);
    put_raw(out, n_);
    for (size_t i = 0; i < n_; i++) {
        const schema_alt& a = alts_[i];
        put_raw(out, a.ws);
        put_raw(out, (uint16_t)a.stack.size());
        for (const schema_frame& f : a.stack) {
            const schema_node& n = p_->node(f.node);
            put_raw(out, f.kind);
            put_raw(out, f.node);
            switch (f.kind) {
                case k_obj: put_raw(out, f.st), put_raw(out, f.next), put_raw(out, f.cur); break;
                case k_arr: {
                    // past the prefix items and minItems, with no maxItems, every further item reads alike
                    const uint32_t settled = std::max<uint32_t>((uint32_t)n.prefix.size(), n.min_items);
                    put_raw(out, f.st);
                    put_raw(out, n.max_items == UINT32_MAX ? std::min(f.count, settled) : f.count);
                    break;
                }
                case k_str:
                    // with no maxLength, the length only matters until minLength is reached
                    put_raw(out, n.max_len == UINT32_MAX ? std::min(f.count, n.min_len) : f.count);
                    put_raw(out, f.esc), put_raw(out, f.u8_need);
                    if (f.u8_need) put_raw(out, f.u8_lo), put_raw(out, f.u8_hi);
                    break;
                case k_num: put_raw(out, f.st), put_raw(out, f.count), put_raw(out, f.flags); break;
                case k_lit: put_raw(out, f.texts), put_raw(out, f.lo), put_raw(out, f.hi), put_raw(out, f.pos); break;
                case k_key:
                    put_raw(out, f.lo), put_raw(out, f.hi), put_raw(out, f.pos), put_raw(out, f.flags), put_raw(out, f.count);
                    put_raw(out, f.u8_need);
                    if (f.u8_need) put_raw(out, f.u8_lo), put_raw(out, f.u8_hi);
                    break;
                default: break;  // k_value: its node alone
            }
        }
    }
}

}  // namespace tansy
