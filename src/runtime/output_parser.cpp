#include "runtime/output_parser.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "tokenizer/chat_template.h"  // py_json_dumps: Python's json.dumps layout, as vLLM writes arguments

namespace tansy {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view k_think_begin = "<think>", k_think_end = "</think>";
constexpr std::string_view k_call_begin = "<tool_call>", k_call_end = "</tool_call>";
constexpr std::string_view k_function = "<function=", k_function_end = "</function>";
constexpr std::string_view k_param = "<parameter=", k_param_end = "</parameter>";
constexpr size_t k_max_name = 256;  // a longer "<function=..." is not a call header

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// Length of the longest suffix of s that is a proper prefix of tag: text that may still become the tag.
size_t held_prefix(std::string_view s, std::string_view tag) {
    for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; k--)
        if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
    return 0;
}

size_t skip_space(const std::string& s) {
    size_t i = 0;
    while (i < s.size() && is_space(s[i])) i++;
    return i;
}

// JSON string escaping without the quotes (invalid UTF-8 cannot come from stream_decoder; replaced anyway).
std::string json_escape(std::string_view s) {
    std::string q = ojson(std::string(s)).dump(-1, ' ', false, ojson::error_handler_t::replace);
    return q.substr(1, q.size() - 2);
}

std::string lower(std::string s) {
    for (char& c : s) c = (char)std::tolower((unsigned char)c);
    return s;
}

// The JSON schema type of a property: "type": "integer", or the first non-null of "type": ["integer", "null"].
std::string schema_type(const ojson& prop) {
    if (!prop.is_object()) return "";
    auto t = prop.find("type");
    if (t == prop.end()) return "";
    if (t->is_string()) return lower(t->get<std::string>());
    if (t->is_array())
        for (const ojson& x : *t)
            if (x.is_string() && x.get<std::string>() != "null") return lower(x.get<std::string>());
    return "";
}

bool is_string_type(const std::string& t) {
    return t.empty() || t == "string" || t == "str" || t == "text" || t == "varchar" || t == "char" || t == "enum";
}

// A parameter's text as the JSON value its schema type asks for; the string itself when it does not parse
// (vLLM qwen3_coder's rule: never lose the model's text).
ojson convert_value(const std::string& v, const std::string& type) {
    if (lower(v) == "null") return nullptr;
    if (type == "integer" || type == "int") {
        errno = 0;
        char* end = nullptr;
        const long long x = std::strtoll(v.c_str(), &end, 10);
        if (!v.empty() && *end == 0 && errno == 0) return x;
        return v;
    }
    if (type == "number" || type == "float" || type == "double") {
        errno = 0;
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (!v.empty() && *end == 0 && errno == 0 && std::isfinite(x)) {
            const ojson j = ojson::parse(v, nullptr, false);
            return j.is_number() ? j : ojson(x);  // keeps 3 as 3, not 3.0
        }
        return v;
    }
    if (type == "boolean" || type == "bool") {
        if (lower(v) == "true") return true;
        if (lower(v) == "false") return false;
        return v;
    }
    // the model's text can nest without bound (a prompt can ask for it): copying or dumping such a tree recurses
    // once per level, so past the client JSON limit the value stays a string
    if (json_depth_exceeds(v)) return v;
    ojson j = ojson::parse(v, nullptr, false);
    if (j.is_discarded()) return v;
    return j;  // object, array, or a type we do not know
}

}  // namespace

std::string tool_param_type(const ojson& prop) { return schema_type(prop); }
bool tool_param_is_string(const std::string& type) { return is_string_type(type); }

output_parser::output_parser(output_parser_options opt) : opt_(std::move(opt)) {
    state_ = opt_.reasoning ? state::reasoning : state::content_start;
    if (opt_.tool_schemas.is_array()) {
        for (const ojson& t : opt_.tool_schemas) {
            const ojson* f = t.is_object() && t.contains("function") ? &t["function"] : &t;
            if (!f->is_object() || !f->contains("name") || !(*f)["name"].is_string()) continue;
            auto& m = types_[(*f)["name"].get<std::string>()];
            const ojson* params = f->contains("parameters") ? &(*f)["parameters"] : nullptr;
            if (!params || !params->is_object() || !params->contains("properties")) continue;
            const ojson& props = (*params)["properties"];
            if (!props.is_object()) continue;
            for (auto it = props.begin(); it != props.end(); ++it) m[it.key()] = schema_type(it.value());
        }
    }
}

std::string output_parser::param_type(const std::string& param) const {
    if (calls_.empty()) return "";
    auto f = types_.find(calls_.back().name);
    if (f == types_.end()) return "";
    auto p = f->second.find(param);
    return p == f->second.end() ? "" : p->second;
}

void output_parser::emit_reasoning(parsed_delta& d, std::string_view s) {
    reasoning_ += s;
    d.reasoning += s;
}

void output_parser::emit_content(parsed_delta& d, std::string_view s) {
    content_ += s;
    d.content += s;
}

void output_parser::emit_args(parsed_delta& d, const std::string& s, const std::string& name) {
    const int index = (int)calls_.size() - 1;
    calls_.back().arguments += s;
    if (name.empty() && s.empty()) return;
    if (!d.tool_calls.empty() && d.tool_calls.back().index == index && name.empty()) {
        d.tool_calls.back().arguments += s;
        return;
    }
    d.tool_calls.push_back(tool_call_delta{index, name, s});
}

void output_parser::open_param(parsed_delta& d, const std::string& name) {
    param_type_ = param_type(name);
    param_value_.clear();
    param_started_ = false;
    std::string head = (n_params_ ? ", " : "{") + ojson(name).dump(-1, ' ', false, ojson::error_handler_t::replace) + ": ";
    if (is_string_type(param_type_)) head += '"';
    n_params_++;
    emit_args(d, head);
}

void output_parser::close_param(parsed_delta& d, std::string tail) {
    if (is_string_type(param_type_)) {
        param_value_ += tail;
        emit_args(d, json_escape(tail) + "\"");
    } else {
        param_value_ += tail;
        emit_args(d, py_json_dumps(convert_value(param_value_, param_type_)));
    }
    param_value_.clear();
}

void output_parser::close_call(parsed_delta& d, bool complete) {
    emit_args(d, n_params_ ? "}" : "{}");
    calls_.back().complete = complete;
    n_params_ = 0;
    raw_call_.clear();
}

bool output_parser::step(parsed_delta& d, bool final) {
    switch (state_) {
        case state::reasoning: {
            if (at_start_) {  // the prompt already opened <think>; a model that repeats it is forgiven
                if (buf_.empty()) return false;
                if (!final && buf_.size() < k_think_begin.size() && k_think_begin.substr(0, buf_.size()) == buf_)
                    return false;
                if (buf_.compare(0, k_think_begin.size(), k_think_begin) == 0) buf_.erase(0, k_think_begin.size());
                at_start_ = false;
            }
            const size_t end = buf_.find(k_think_end);
            size_t n = end != std::string::npos ? end : final ? buf_.size() : buf_.size() - held_prefix(buf_, k_think_end);
            const size_t body_end = n;
            // newlines right before </think> belong to the format, not to the reasoning
            while (n > 0 && buf_[n - 1] == '\n') n--;
            emit_reasoning(d, std::string_view(buf_).substr(0, n));
            if (end != std::string::npos) {
                buf_.erase(0, end + k_think_end.size());
                state_ = state::content_start;
                return true;
            }
            buf_.erase(0, final ? body_end : n);
            return false;
        }
        case state::content_start: {  // the answer follows "</think>\n\n": its leading newlines are not content
            size_t i = 0;
            while (i < buf_.size() && buf_[i] == '\n') i++;
            buf_.erase(0, i);
            if (buf_.empty()) return false;
            state_ = state::content;
            return true;
        }
        case state::content: {
            if (!opt_.tools) {
                emit_content(d, buf_);
                buf_.clear();
                return false;
            }
            const size_t pos = buf_.find(k_call_begin);
            if (pos != std::string::npos) {
                size_t n = pos;
                while (n > 0 && is_space(buf_[n - 1])) n--;  // whitespace before a call is layout
                emit_content(d, std::string_view(buf_).substr(0, n));
                raw_call_ = buf_.substr(n, pos + k_call_begin.size() - n);  // given back if it is not a call
                buf_.erase(0, pos + k_call_begin.size());
                state_ = state::tool_header;
                return true;
            }
            size_t n = buf_.size();
            if (!final) {
                n -= held_prefix(buf_, k_call_begin);
                while (n > 0 && is_space(buf_[n - 1])) n--;
            }
            emit_content(d, std::string_view(buf_).substr(0, n));
            buf_.erase(0, n);
            return false;
        }
        case state::tool_header: {
            const size_t i = skip_space(buf_);
            const std::string_view rest = std::string_view(buf_).substr(i);
            bool ok = true;
            if (rest.size() < k_function.size()) {
                if (!final && k_function.substr(0, rest.size()) == rest) return false;
                ok = false;
            } else if (rest.substr(0, k_function.size()) != k_function) {
                ok = false;
            }
            size_t gt = std::string::npos;
            if (ok) {
                gt = rest.find('>', k_function.size());
                const size_t nl = rest.find('\n', k_function.size());
                if (gt == std::string::npos) {
                    if (!final && nl == std::string::npos && rest.size() <= k_function.size() + k_max_name) return false;
                    ok = false;
                } else if (nl < gt || gt - k_function.size() > k_max_name) {
                    ok = false;
                }
            }
            std::string name;
            if (ok) {
                name = std::string(rest.substr(k_function.size(), gt - k_function.size()));
                while (!name.empty() && is_space(name.back())) name.pop_back();
                while (!name.empty() && is_space(name.front())) name.erase(0, 1);
                ok = !name.empty();
            }
            if (!ok) {  // not a call after all: its tag is content text, and so is what follows
                emit_content(d, raw_call_);
                raw_call_.clear();
                state_ = state::content;
                return true;
            }
            calls_.push_back(parsed_tool_call{name, "", false});
            n_params_ = 0;
            emit_args(d, "", name);
            buf_.erase(0, i + gt + 1);
            state_ = state::tool_body;
            return true;
        }
        case state::tool_body: {
            const size_t i = skip_space(buf_);
            const std::string_view rest = std::string_view(buf_).substr(i);
            if (rest.empty()) {
                buf_.clear();
                return false;
            }
            if (rest.substr(0, k_param.size()) == k_param) {
                const size_t gt = rest.find('>');
                const size_t nl = rest.find('\n');
                if (gt != std::string::npos && (nl == std::string::npos || gt < nl)) {
                    open_param(d, std::string(rest.substr(k_param.size(), gt - k_param.size())));
                    buf_.erase(0, i + gt + 1);
                    state_ = state::param_value;
                    return true;
                }
                if (!final && nl == std::string::npos && rest.size() <= k_param.size() + k_max_name) return false;
            } else if (rest.substr(0, k_function_end.size()) == k_function_end) {
                buf_.erase(0, i + k_function_end.size());
                return true;
            } else if (rest.substr(0, k_call_end.size()) == k_call_end) {
                buf_.erase(0, i + k_call_end.size());
                close_call(d, true);
                state_ = state::after_call;
                return true;
            } else if (!final) {
                for (std::string_view tag : {k_param, k_function_end, k_call_end})
                    if (rest.size() < tag.size() && tag.substr(0, rest.size()) == rest) return false;
            }
            if (final) return false;
            // stray text inside a call (not in the format): skipped up to the next tag
            const size_t next = rest.find('<', 1);
            buf_.erase(0, next == std::string::npos ? buf_.size() : i + next);
            return true;
        }
        case state::param_value: {
            if (!param_started_) {
                if (buf_.empty()) return false;
                if (buf_[0] == '\n') buf_.erase(0, 1);
                param_started_ = true;
            }
            // </parameter> ends a value; so does any tag that can only come after it (a model that forgot it)
            size_t pos = std::string::npos, tag_len = 0;
            for (std::string_view tag : {k_param_end, k_param, k_function_end, k_call_end}) {
                const size_t p = buf_.find(tag);
                if (p < pos) pos = p, tag_len = tag == k_param_end ? tag.size() : 0;
            }
            if (pos != std::string::npos) {
                std::string tail = buf_.substr(0, pos);
                if (!tail.empty() && tail.back() == '\n') tail.pop_back();
                close_param(d, std::move(tail));
                buf_.erase(0, pos + tag_len);
                state_ = state::tool_body;
                return true;
            }
            if (final) return false;
            size_t hold = 0;
            for (std::string_view tag : {k_param_end, k_param, k_function_end, k_call_end})
                hold = std::max(hold, held_prefix(buf_, tag));
            size_t n = buf_.size() - hold;
            if (n > 0 && buf_[n - 1] == '\n') n--;  // may be the newline before </parameter>
            const std::string piece = buf_.substr(0, n);
            buf_.erase(0, n);
            if (is_string_type(param_type_)) {
                param_value_ += piece;
                if (!piece.empty()) emit_args(d, json_escape(piece));
            } else {
                param_value_ += piece;
            }
            return false;
        }
        case state::after_call: {
            const size_t i = skip_space(buf_);
            buf_.erase(0, i);
            if (buf_.empty()) return false;
            if (buf_.compare(0, k_call_begin.size(), k_call_begin) == 0) {
                buf_.erase(0, k_call_begin.size());
                raw_call_ = std::string(k_call_begin);
                state_ = state::tool_header;
                return true;
            }
            if (!final && buf_.size() < k_call_begin.size() && k_call_begin.substr(0, buf_.size()) == buf_) return false;
            state_ = state::content;  // text after the calls: content
            return true;
        }
    }
    return false;
}

parsed_delta output_parser::push(std::string_view text) {
    buf_ += text;
    parsed_delta d;
    while (step(d, false)) {
    }
    return d;
}

parsed_delta output_parser::finish() {
    parsed_delta d;
    while (step(d, true)) {
    }
    if (state_ == state::param_value) {  // cut inside a value: keep what was generated, minus a partial tag
        std::string tail = param_started_ ? buf_ : (buf_.size() && buf_[0] == '\n' ? buf_.substr(1) : buf_);
        size_t hold = 0;
        for (std::string_view tag : {k_param_end, k_param, k_function_end, k_call_end})
            hold = std::max(hold, held_prefix(tail, tag));
        tail.resize(tail.size() - hold);
        if (!tail.empty() && tail.back() == '\n') tail.pop_back();
        close_param(d, std::move(tail));
        close_call(d, false);
        state_ = state::after_call;
    } else if (state_ == state::tool_body) {
        close_call(d, false);
        state_ = state::after_call;
    }
    buf_.clear();
    return d;
}

}  // namespace tansy
