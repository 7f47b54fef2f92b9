// Qwen3.6 chat template, hand-written (see chat_template.h); the Python semantics it relies on (str, repr,
// json.dumps, strip) are in py_semantics.cpp. "T:NN" comments give the line of qwen3_6.jinja
// (fixtures/chat_template/) that the code reproduces. Jinja facts the code depends on:
//  - `x.key` on a dict is x['key']; on anything else (string, list, number, null) it is undefined. None of the
//    keys read (role, content, ...) is also a Python dict/str/list method name, so no attribute shadows a key.
//  - An undefined value prints as "", is falsy, and `'str' + undefined` raises.
//  - `'k' in x` is key membership for a dict, substring for a string, element equality for a list, and a
//    TypeError for numbers, booleans and None.
//  - `{{ x }}` prints Python str(x); `|trim` is str.strip(); `is true`/`is false` are identity with True/False.
#include "tokenizer/chat_template.h"

#include <cstdint>
#include <cstdio>

#include "core/check.h"
#include "tokenizer/chat_template_internal.h"

namespace tansy {

using json = nlohmann::ordered_json;

using namespace chat_template_detail;

namespace {

// ---------------------------------------------------------------------------------------------------------
// Python string methods used by the template (T:95-96)

std::string lstrip_newlines(std::string_view s) {
    size_t b = s.find_first_not_of('\n');
    return b == std::string_view::npos ? std::string() : std::string(s.substr(b));
}

std::string rstrip_newlines(std::string_view s) {
    size_t e = s.find_last_not_of('\n');
    return e == std::string_view::npos ? std::string() : std::string(s.substr(0, e + 1));
}

// s.split(sep)[0]
std::string_view before_first(std::string_view s, std::string_view sep) {
    size_t p = s.find(sep);
    return p == std::string_view::npos ? s : s.substr(0, p);
}

// s.split(sep)[-1]
std::string_view after_last(std::string_view s, std::string_view sep) {
    size_t p = s.rfind(sep);
    return p == std::string_view::npos ? s : s.substr(p + sep.size());
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
    return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}


// ---------------------------------------------------------------------------------------------------------
// Jinja value semantics on JSON

// `obj.key`: nullptr means undefined.
const json* attr(const json& obj, const char* key) {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
}

bool is_str(const json* v, std::string_view s) { return v && v->is_string() && v->get_ref<const std::string&>() == s; }

// Python bool(x); undefined is falsy.
bool truthy(const json* v) {
    if (!v) return false;
    switch (v->type()) {
        case json::value_t::null: return false;
        case json::value_t::boolean: return v->get<bool>();
        case json::value_t::number_integer: return v->get<int64_t>() != 0;
        case json::value_t::number_unsigned: return v->get<uint64_t>() != 0;
        case json::value_t::number_float: return v->get<double>() != 0.0;
        // note: nlohmann's empty() is false for every string, so strings are checked by hand
        case json::value_t::string: return !v->get_ref<const std::string&>().empty();
        case json::value_t::array:
        case json::value_t::object: return !v->empty();
        default: return true;
    }
}

// `x is true` / `x is false`: identity with the booleans, so 1 / 0 / "false" do not count.
bool is_bool(const json* v, bool b) { return v && v->is_boolean() && v->get<bool>() == b; }

// `{{ x }}`: Python str(x); undefined prints nothing.
std::string print(const json* v) { return v ? py_str(*v) : std::string(); }

std::string_view type_word(const json& v) {
    if (v.is_number()) return "a number";
    if (v.is_boolean()) return "a boolean";
    if (v.is_null()) return "null";
    if (v.is_string()) return "a string";
    if (v.is_array()) return "a list";
    return "an object";
}

// `'needle' in item` for a content part (T:7, T:19, T:30).
bool part_has(const json& item, const char* needle) {
    switch (item.type()) {
        case json::value_t::object: return item.contains(needle);
        case json::value_t::string: return item.get_ref<const std::string&>().find(needle) != std::string::npos;
        case json::value_t::array:
            for (const json& e : item)
                if (is_str(&e, needle)) return true;
            return false;
        default:  // Python: TypeError: argument of type 'int' is not iterable
            fail("chat template: a content part is %s, not an object (Unexpected item type in content.)",
                 std::string(type_word(item)).c_str());
    }
}

[[noreturn]] void raise_exception(const char* msg) { fail("chat template: %s", msg); }

// T:53 (one string literal of the template, verbatim)
constexpr const char* k_tool_instructions =
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>";

// One render: holds the template's global namespaces (image_count, video_count, ns).
class chat_renderer {
  public:
    chat_renderer(const json& messages, const json& tools, const chat_options& opt)
        : msgs_(messages), tools_(tools), opt_(opt) {}

    rendered_chat render() {
        if (msgs_.empty()) raise_exception("No messages provided.");  // T:42-44
        render_system_block();
        find_last_query();
        for (size_t i = 0; i < msgs_.size(); i++) render_message(i);
        if (opt_.add_generation_prompt) render_generation_prompt();
        return {std::move(out_), std::move(client_)};
    }

  private:
    const json* kwarg(const char* name) const { return attr(opt_.kwargs, name); }
    const json* role(size_t i) const { return attr(msgs_[i], "role"); }

    // macro render_content (T:3-41), before `|trim`.
    std::string render_content(const json* content, bool do_vision_count, bool is_system_content) {
        if (!content || content->is_null()) return "";                          // T:36-37
        if (content->is_string()) return content->get<std::string>();           // T:4-5
        if (!content->is_array()) raise_exception("Unexpected content type.");  // T:38-39
        std::string out;
        for (const json& item : *content) render_part(item, do_vision_count, is_system_content, out);
        return out;
    }

    void render_part(const json& item, bool do_vision_count, bool is_system_content, std::string& out) {
        const json* type = attr(item, "type");
        if (part_has(item, "image") || part_has(item, "image_url") || is_str(type, "image")) {  // T:8-18
            if (is_system_content) raise_exception("System message cannot contain images.");
            if (do_vision_count) image_count_++;
            if (truthy(kwarg("add_vision_id"))) out += "Picture " + std::to_string(image_count_) + ": ";
            out += "<|vision_start|><|image_pad|><|vision_end|>";
        } else if (part_has(item, "video") || is_str(type, "video")) {  // T:19-29
            if (is_system_content) raise_exception("System message cannot contain videos.");
            if (do_vision_count) video_count_++;
            if (truthy(kwarg("add_vision_id"))) out += "Video " + std::to_string(video_count_) + ": ";
            out += "<|vision_start|><|video_pad|><|vision_end|>";
        } else if (part_has(item, "text")) {  // T:30-31 (a string part containing "text" prints nothing)
            out += print(attr(item, "text"));
        } else {
            raise_exception("Unexpected item type in content.");  // T:32-33
        }
    }

    // `tools and tools is iterable and tools is not mapping` (T:45), then the block of T:46-60.
    void render_system_block() {
        const bool has_system = is_str(role(0), "system");
        if (truthy(&tools_) && (tools_.is_array() || tools_.is_string())) {
            out_ += "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>";
            for_each_tool([&](const json& tool) {
                out_ += '\n';
                client(py_json_dumps(tool));
            });
            out_ += "\n</tools>";
            out_ += k_tool_instructions;
            if (has_system) {
                std::string content = py_strip(render_content(attr(msgs_[0], "content"), false, true));
                if (!content.empty()) {
                    out_ += "\n\n";
                    client(content);
                }
            }
            out_ += "<|im_end|>\n";
        } else if (has_system) {  // T:61-65: an empty system message still gets its turn
            out_ += "<|im_start|>system\n";
            client(py_strip(render_content(attr(msgs_[0], "content"), false, true)));
            out_ += "<|im_end|>\n";
        }
    }

    // Iterating a string yields its characters, each dumped as a JSON string (what Jinja does with tools="ab").
    template <class F>
    void for_each_tool(F&& f) {
        if (tools_.is_array()) {
            for (const json& t : tools_) f(t);
            return;
        }
        const std::string& s = tools_.get_ref<const std::string&>();
        for (size_t i = 0; i < s.size();) {
            const size_t n = decode_at(s, i).len;
            f(json(s.substr(i, n)));
            i += n;
        }
    }

    // T:67-80: the last user message that is not a wrapped <tool_response>, scanning from the end.
    void find_last_query() {
        for (size_t k = msgs_.size(); k-- > 0;) {
            if (!is_str(role(k), "user")) continue;
            std::string content = py_strip(render_content(attr(msgs_[k], "content"), false, false));
            if (!(starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>"))) {
                last_query_index_ = (int64_t)k;
                return;
            }
        }
        raise_exception("No user query found in messages.");
    }

    // T:81-146
    void render_message(size_t i) {
        // note: content is rendered (and images counted) before the role is looked at, as in T:82.
        std::string content = py_strip(render_content(attr(msgs_[i], "content"), true, false));
        const json* r = role(i);
        if (is_str(r, "system")) {
            if (i != 0 && !opt_.system_anywhere) raise_exception("System message must be at the beginning.");
            if (i != 0) {  // chat_options::system_anywhere: a system turn of its own, where it was sent
                out_ += "<|im_start|>system\n";
                client(content);
                out_ += "<|im_end|>\n";
            }
        } else if (is_str(r, "user")) {
            out_ += "<|im_start|>user\n";
            client(content);
            out_ += "<|im_end|>\n";
        } else if (is_str(r, "assistant")) {
            render_assistant(i, std::move(content));
        } else if (is_str(r, "tool")) {
            render_tool(i, content);
        } else {
            raise_exception("Unexpected message role.");
        }
    }

    // T:89-130
    void render_assistant(size_t i, std::string content) {
        const json& m = msgs_[i];
        std::string reasoning;
        if (const json* rc = attr(m, "reasoning_content"); rc && rc->is_string()) {  // T:91-92: kept verbatim
            reasoning = rc->get<std::string>();
        } else if (content.find("</think>") != std::string::npos) {  // T:94-97
            // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
            reasoning = lstrip_newlines(after_last(rstrip_newlines(before_first(content, "</think>")), "<think>"));
            content = lstrip_newlines(after_last(content, "</think>"));
        }
        reasoning = py_strip(reasoning);  // T:99
        // T:100: only turns after the last real user query keep their reasoning, unless preserve_thinking is true
        const bool preserve =
            opt_.variant == chat_template_variant::qwen3_6 && is_bool(kwarg("preserve_thinking"), true);
        out_ += "<|im_start|>assistant\n";
        if (preserve || (int64_t)i > last_query_index_) {
            out_ += "<think>\n";
            client(reasoning);
            out_ += "\n</think>\n\n";
        }
        client(content);
        const json* calls = attr(m, "tool_calls");
        if (truthy(calls) && (calls->is_array() || calls->is_string())) render_tool_calls(i, *calls, content);
        out_ += "<|im_end|>\n";
    }

    // T:105-129
    void render_tool_calls(size_t i, const json& calls, const std::string& content) {
        if (calls.is_string())  // Jinja would iterate its characters, and fail on the first one's missing name
            fail("chat template: messages[%zu].tool_calls is a string; it must be a list of objects", i);
        for (size_t k = 0; k < calls.size(); k++) {
            const json* call = &calls[k];
            if (const json* f = attr(*call, "function")) call = f;  // T:107-109: OpenAI form, else flat form
            const json* name = attr(*call, "name");
            if (!name || !name->is_string())  // `'<function=' + tool_call.name` raises unless it is a string
                fail("chat template: messages[%zu].tool_calls[%zu] has no string 'name'", i, k);
            if (k > 0)
                out_ += '\n';
            else if (!py_strip(content).empty())
                out_ += "\n\n";
            out_ += "<tool_call>\n<function=";
            client(name->get_ref<const std::string&>());
            out_ += ">\n";
            if (const json* args = attr(*call, "arguments"))
                render_arguments(*args, strprintf("messages[%zu].tool_calls[%zu] ('%s')", i, k,
                                                  name->get_ref<const std::string&>().c_str()));
            out_ += "</function>\n</tool_call>";
        }
    }

    // T:119-126: `tool_call.arguments|items` needs a mapping.
    void render_arguments(const json& args, const std::string& where) {
        if (!args.is_object())
            fail("chat template: %s: arguments is %s, not a JSON object (Can only get item pairs from a mapping.)%s",
                 where.c_str(), std::string(type_word(args)).c_str(),
                 args.is_string() ? "; OpenAI-style string arguments must be parsed into an object first" : "");
        for (const auto& [key, value] : args.items()) {
            out_ += "<parameter=";
            client(key);
            out_ += ">\n";
            client(argument_value(value));
            out_ += "\n</parameter>\n";
        }
    }

    // T:122: 3.6 prints strings raw and everything else as JSON; 3.5 prints scalars with Python str().
    std::string argument_value(const json& v) const {
        if (v.is_string()) return v.get<std::string>();
        if (opt_.variant == chat_template_variant::qwen3_5 && !v.is_object() && !v.is_array()) return py_str(v);
        return py_json_dumps(v);
    }

    // T:131-142: consecutive tool results share one user turn.
    void render_tool(size_t i, const std::string& content) {
        // `loop.previtem and loop.previtem.role != "tool"`: a tool message first gets no user header (a quirk)
        if (i > 0 && truthy(&msgs_[i - 1]) && !is_str(role(i - 1), "tool")) out_ += "<|im_start|>user";
        out_ += "\n<tool_response>\n";
        client(content);
        out_ += "\n</tool_response>";
        if (i + 1 == msgs_.size() || !is_str(role(i + 1), "tool")) out_ += "<|im_end|>\n";
    }

    // T:147-154
    void render_generation_prompt() {
        out_ += "<|im_start|>assistant\n";
        out_ += is_bool(kwarg("enable_thinking"), false) ? "<think>\n\n</think>\n\n" : "<think>\n";
    }

    const json& msgs_;
    const json& tools_;
    const chat_options& opt_;
    // Text from the request (contents, names, arguments, tool schemas) is appended with client(), which notes
    // its bytes; everything appended to out_ directly is the template's own text.
    void client(std::string_view s) {
        if (s.empty()) return;
        if (!client_.empty() && client_.back().end == out_.size())
            client_.back().end += s.size();
        else
            client_.push_back({out_.size(), out_.size() + s.size()});
        out_ += s;
    }

    std::string out_;
    std::vector<byte_range> client_;
    int64_t image_count_ = 0, video_count_ = 0;  // T:1-2
    int64_t last_query_index_ = -1;              // T:67 ns.last_query_index
};

}  // namespace


// ---------------------------------------------------------------------------------------------------------
// Limits

bool json_depth_exceeds(std::string_view text, int max_depth) {
    int depth = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); i++) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\')
                i++;  // the escaped character cannot end the string
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth) return true;
        } else if (c == ']' || c == '}') {
            depth--;  // unbalanced text is the parser's to reject; a negative depth only makes this lenient
        }
    }
    return false;
}

// ---------------------------------------------------------------------------------------------------------
// Entry points

rendered_chat render_chat_marked(const json& messages, const json& tools, const chat_options& opt) {
    if (!messages.is_array()) fail("chat template: messages must be a list, got %s", messages.type_name());
    return chat_renderer(messages, tools, opt).render();
}

std::string render_chat(const json& messages, const json& tools, const chat_options& opt) {
    return render_chat_marked(messages, tools, opt).text;
}

std::string render_chat_request(const json& request) {
    if (!request.is_object()) fail("chat request: must be a JSON object, got %s", request.type_name());
    auto it = request.find("messages");
    if (it == request.end()) fail("chat request: 'messages' is required");
    if (!it->is_array()) fail("chat request: 'messages' must be an array, got %s", it->type_name());
    const json& messages = *it;

    json tools = nullptr;
    if (auto t = request.find("tools"); t != request.end() && !t->is_null()) {
        if (!t->is_array()) fail("chat request: 'tools' must be an array, got %s", t->type_name());
        tools = *t;
    }
    chat_options opt;
    if (auto g = request.find("add_generation_prompt"); g != request.end()) {
        if (!g->is_boolean()) fail("chat request: 'add_generation_prompt' must be a boolean, got %s", g->type_name());
        opt.add_generation_prompt = g->get<bool>();
    }
    if (auto k = request.find("chat_template_kwargs"); k != request.end() && !k->is_null()) {
        if (!k->is_object()) fail("chat request: 'chat_template_kwargs' must be an object, got %s", k->type_name());
        opt.kwargs = *k;
        // vLLM merges chat_template_kwargs over its own template arguments, so this key wins there too.
        if (auto g = opt.kwargs.find("add_generation_prompt"); g != opt.kwargs.end()) {
            opt.add_generation_prompt = truthy(&*g);
            opt.kwargs.erase(g);
        }
    }
    return render_chat(messages, tools, opt);
}

json normalize_openai_tool_calls(const json& messages) {
    if (!messages.is_array()) fail("chat request: 'messages' must be an array, got %s", messages.type_name());
    json out = messages;
    for (size_t i = 0; i < out.size(); i++) {
        json& m = out[i];
        if (!m.is_object() || !m.contains("tool_calls") || !m["tool_calls"].is_array()) continue;
        json& calls = m["tool_calls"];
        for (size_t k = 0; k < calls.size(); k++) {
            json* call = &calls[k];
            if (!call->is_object()) continue;
            if (call->contains("function")) call = &(*call)["function"];  // same choice as the template (T:107)
            if (!call->is_object() || !call->contains("arguments") || !(*call)["arguments"].is_string()) continue;
            const std::string& text = (*call)["arguments"].get_ref<const std::string&>();
            if (json_depth_exceeds(text))
                fail("chat request: messages[%zu].tool_calls[%zu]: arguments nest JSON deeper than %d levels", i, k,
                     k_max_json_depth);
            json parsed;
            try {
                parsed = json::parse(text);
            } catch (const json::parse_error& e) {
                fail("chat request: messages[%zu].tool_calls[%zu]: arguments is not valid JSON (byte %zu)", i, k,
                     (size_t)e.byte);
            } catch (const json::exception& e) {  // e.g. out_of_range for a number like 1e999
                fail("chat request: messages[%zu].tool_calls[%zu]: arguments is not usable JSON: %s", i, k, e.what());
            }
            if (!parsed.is_object())
                fail("chat request: messages[%zu].tool_calls[%zu]: arguments must be a JSON object, got %s", i, k,
                     parsed.type_name());
            (*call)["arguments"] = std::move(parsed);
        }
    }
    return out;
}

}  // namespace tansy
