// The content a schema_constraint allows: build_content_spec() turns response_format's schema and the tools'
// parameter schemas into a content_spec, and content_state reads the content against it byte by byte (JSON
// documents through schema_state, tool calls in the Qwen XML format) and gives the shortest text that completes it.
#include "server/constraints.h"

#include <algorithm>
#include <cstring>

#include "runtime/output_parser.h"
#include "tokenizer/utf8.h"

namespace tansy {

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

// Every parser tag ends with one of these bytes: no tag can have just ended on another.
bool ends_a_tag(char c) { return c == '>' || c == '='; }

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

namespace {

// The partial tags under way at the end of a raw tail: each byte that would carry one of them further.
void pending_tags(const char* tail, size_t n, std::initializer_list<std::string_view> tags, plain_info* p) {
    for (std::string_view t : tags)
        for (size_t k = std::min(n, t.size() - 1); k > 0; k--)
            if (std::string_view(tail + n - k, k) == t.substr(0, k)) p->add_except((uint8_t)t[k]);
}

}  // namespace

plain_info content_state::plain() const {
    plain_info p;
    switch (phase_) {
        case ph_json:
        case ph_jval:
            p.room = js_.free_string_room(&p.exact, &p.bytes);
            if (p.room < 0) return {};
            if (phase_ == ph_json && s_->tools.empty()) {
                p.cls = 1;
                return p;
            }
            // with tools (or in a parameter) a tag may not be spelled: only tokens without '<', the rest walked
            p.cls = 3;
            if (phase_ == ph_json) pending_tags(tail_, tail_n_, {"<tool_call>"}, &p);
            else pending_tags(tail_, tail_n_, {k_parser_tags[0], k_parser_tags[1], k_parser_tags[2], k_parser_tags[3]}, &p);
            return p;
        case ph_sval: {
            if (u8_need_ != 0) return {};
            // such a token ends no tag (no '<'), nor starts one (no newline at its end): all of it, and what
            // "\n</parameter>" had matched, is content
            const content_spec::param& pr = tool().params[(size_t)param_];
            p.cls = 2;
            p.room = pr.max_len == UINT32_MAX ? INT64_MAX : (int64_t)pr.max_len - (int64_t)chars_;
            p.growth = m_;  // the closing tag, partly matched, starts over
            if (chars_ >= pr.min_len) p.closer = k_value_tag.size() + 1 + tool_rest(next_, nullptr);
            pending_tags(tail_, tail_n_, {k_value_tag, k_parser_tags[0], k_parser_tags[1], k_parser_tags[2],
                                          k_parser_tags[3]}, &p);
            return p;
        }
        default: return p;
    }
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
            const bool new_char = u8_need_ == 0;
            if (!utf8_step(&u8_need_, &u8_lo_, &u8_hi_, uc)) return false;
            if (new_char) chars_++;
            push_tail(tail_, &tail_n_, c);
            m_ = 0;
            for (size_t k = std::min<size_t>(tail_n_, k_value_tag.size()); k > 0; k--)
                if (tail_[tail_n_ - k] == k_value_tag[0] &&
                    std::string_view(tail_ + tail_n_ - k, k) == std::string_view(k_value_tag).substr(0, k)) {
                    m_ = (uint8_t)k;
                    break;
                }
            if (m_ == k_value_tag.size()) {
                const uint32_t content = chars_ - m_;
                if (content < pr.min_len || content > pr.max_len) return false;
                lit_ = &k_param_close, pos_ = (uint16_t)k_value_tag.size(), lit_next_ = ph_params, phase_ = ph_lit;
                return true;
            }
            if (ends_a_tag(c))
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
            if (ends_a_tag(c))
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
                if (c == '>' && tail_ends_with(tail_, tail_n_, "<tool_call>")) return false;
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

namespace {

template <class T>
void put_raw(std::string* out, T v) {
    out->append((const char*)&v, sizeof v);
}

// The longest end of a raw tail that is the start of one of the tags (what a later byte could complete into
// one; the rest of the tail can no longer matter).
size_t live_tail(const char* tail, size_t n, std::initializer_list<std::string_view> tags) {
    for (size_t k = n; k > 0; k--)
        for (std::string_view t : tags)
            if (k < t.size() && std::string_view(tail + n - k, k) == t.substr(0, k)) return k;
    return 0;
}

}  // namespace

void content_state::key(std::string* out) const {
    put_raw(out, phase_);
    if (phase_ == ph_start) return put_raw(out, ws_);
    if (phase_ == ph_json || phase_ == ph_jval) js_.key(out);
    if (phase_ == ph_json) {
        if (s_->tools.empty()) return;
        const size_t k = live_tail(tail_, tail_n_, {"<tool_call>"});
        out->append(tail_ + tail_n_ - k, k);
        return;
    }
    // a tool call: which tool and parameter, what may still come, how many calls so far
    put_raw(out, tool_), put_raw(out, param_), put_raw(out, next_), put_raw(out, calls_);
    switch (phase_) {
        case ph_lit: put_raw(out, lit_), put_raw(out, pos_), put_raw(out, lit_next_); break;
        case ph_name:
        case ph_params:
        case ph_pname:
        case ph_senum: put_raw(out, texts_), put_raw(out, lo_), put_raw(out, hi_), put_raw(out, pos_); break;
        case ph_sval: {
            const content_spec::param& pr = tool().params[(size_t)param_];
            // with no maxLength, the length only matters until minLength is reached (a partly matched
            // "\n</parameter>" is not content yet)
            put_raw(out, pr.max_len == UINT32_MAX ? std::min<uint32_t>(chars_ - m_, pr.min_len) : chars_);
            put_raw(out, m_), put_raw(out, u8_need_);
            if (u8_need_) put_raw(out, u8_lo_), put_raw(out, u8_hi_);
            const size_t k = live_tail(tail_, tail_n_, {k_value_tag, k_parser_tags[0], k_parser_tags[1],
                                                        k_parser_tags[2], k_parser_tags[3]});
            out->append(tail_ + tail_n_ - k, k);
            break;
        }
        case ph_jval: {
            const size_t k = live_tail(tail_, tail_n_, {k_parser_tags[0], k_parser_tags[1], k_parser_tags[2],
                                                        k_parser_tags[3]});
            out->append(tail_ + tail_n_ - k, k);
            break;
        }
        default: break;  // ph_after: the calls so far; ph_free: nothing constrains
    }
}

}  // namespace tansy
