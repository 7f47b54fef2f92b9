// The OpenAI wire format, request side (openai.h): bodies of /v1/chat/completions and /v1/completions parsed and
// validated into a completion_request, errors in OpenAI's shape, and the model's sampling defaults. The answer
// side (responses, stream chunks, usage) is openai_response.cpp.
#include "server/openai.h"

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <set>

#include "core/check.h"
#include "model/config.h"
#include "server/openai_internal.h"
#include "server/text_stream.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/utf8.h"

namespace tansy {

using namespace openai_detail;

api_error::api_error(int st, const std::string& message, std::string p, std::string c, std::string t)
    : std::runtime_error(message), status(st), param(std::move(p)), code(std::move(c)), type(std::move(t)) {}

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

static const char* default_type(int status) {
    switch (status) {
        case 401: return "authentication_error";
        case 403: return "permission_error";
        case 404: return "not_found_error";
        case 429: return "rate_limit_error";
        case 500: return "server_error";
        case 503: return "service_unavailable";
        default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

std::string error_body(int status, const std::string& message, const std::string& param, const std::string& code,
                       const std::string& type) {
    ojson e = {{"message", message},
               {"type", type.empty() ? default_type(status) : type},
               {"param", param.empty() ? ojson(nullptr) : ojson(param)},
               {"code", code.empty() ? ojson(nullptr) : ojson(code)}};
    return dump(ojson{{"error", e}});
}

std::string error_body(const api_error& e) { return error_body(e.status, e.what(), e.param, e.code, e.type); }

namespace {

ojson parse_body(const std::string& body) {
    if (body.empty()) bad("", "the request body is empty; expected a JSON object");
    // before parsing: every later copy and walk of the tree recurses once per level
    if (json_depth_exceeds(body))
        bad("", strprintf("the request body nests JSON arrays/objects deeper than the limit of %d levels",
                          k_max_json_depth), "json_too_deep");
    ojson j;
    try {
        j = ojson::parse(body);
    } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e999
        // nlohmann reports ill-formed UTF-8 inside strings as a parse error too
        const std::string what = e.what();
        if (what.find("UTF-8") != std::string::npos || what.find("utf-8") != std::string::npos ||
            utf8_find_invalid(body) >= 0)
            bad("", "the request body is not valid UTF-8 (" + what + ")", "invalid_utf8");
        bad("", "the request body is not valid JSON: " + what, "invalid_json");
    }
    if (!j.is_object()) bad("", std::string("the request body must be a JSON object, got ") + j.type_name());
    return j;
}

std::string type_of(const ojson& v) { return v.type_name(); }

double number(const ojson& o, const char* k, double dflt, double lo, double hi, bool lo_open = false) {
    const ojson* v = field(o, k);
    if (!v) return dflt;
    if (!v->is_number()) bad(k, std::string("'") + k + "' must be a number, got " + type_of(*v));
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
        bad(k, strprintf("'%s' must be in %c%g, %g], got %g", k, lo_open ? '(' : '[', lo, hi, x));
    return x;
}

int64_t integer(const ojson& o, const char* k, int64_t dflt, int64_t lo, int64_t hi) {
    const ojson* v = field(o, k);
    if (!v) return dflt;
    if (!v->is_number()) bad(k, std::string("'") + k + "' must be an integer, got " + type_of(*v));
    if (v->is_number_float()) {
        const double d = v->get<double>();
        if (!std::isfinite(d) || d != std::floor(d)) bad(k, std::string("'") + k + "' must be an integer");
        if (d < (double)lo || d > (double)hi) bad(k, strprintf("'%s' must be in [%lld, %lld]", k, (long long)lo, (long long)hi));
        return (int64_t)d;
    }
    if (v->is_number_unsigned() && v->get<uint64_t>() > (uint64_t)INT64_MAX)
        bad(k, strprintf("'%s' must be in [%lld, %lld]", k, (long long)lo, (long long)hi));
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) bad(k, strprintf("'%s' must be in [%lld, %lld], got %lld", k, (long long)lo, (long long)hi, (long long)x));
    return x;
}

bool boolean(const ojson& o, const char* k, bool dflt) {
    const ojson* v = field(o, k);
    if (!v) return dflt;
    if (!v->is_boolean()) bad(k, std::string("'") + k + "' must be a boolean, got " + type_of(*v));
    return v->get<bool>();
}

// ---- field policy (issue 36): every field is read below, is a documented no-op here, or is refused with a 400
// naming it. Anything else is ignored with a warning on stderr, once per field name per process.
constexpr const char* k_common_fields[] = {
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "ignore_eos", "stream", "stream_options",
    "max_tokens", "logprobs", "allow_special_tokens", "cache_prompt",
    // no-ops: bookkeeping, caching and routing hints that do not change the output of this server
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"};
constexpr const char* k_chat_fields[] = {
    "messages", "tools", "tool_choice", "functions", "function_call", "response_format", "chat_template_kwargs",
    "reasoning_effort", "top_logprobs", "max_completion_tokens", "modalities", "audio", "web_search_options",
    // parallel_tool_calls: enforced only where tool calls are constrained (tool_choice required / named, or auto
    // with a response_format); no-op: prediction
    // (predicted outputs only speed up generation elsewhere; the output is the same)
    "parallel_tool_calls", "prediction"};
constexpr const char* k_completion_fields[] = {"prompt", "echo", "suffix"};

template <size_t N>
bool in(const char* const (&list)[N], const std::string& k) {
    for (const char* x : list)
        if (k == x) return true;
    return false;
}

std::vector<std::string> unknown_fields(const ojson& j, bool chat) {
    std::vector<std::string> out;
    for (const auto& [k, v] : j.items())
        if (!in(k_common_fields, k) && !(chat ? in(k_chat_fields, k) : in(k_completion_fields, k))) out.push_back(k);
    static std::mutex mu;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lk(mu);
    for (const std::string& k : out) {
        if (warned.size() >= 1000 || !warned.insert(k).second) continue;  // bounded: names come from clients
        const std::string shown = dump(ojson(k.size() > 64 ? k.substr(0, 64) + "..." : k));  // quoted, escaped
        fprintf(stderr, "tansy serve: warning: ignoring unknown request field %s (%s; shown once per name)\n",
                shown.c_str(), chat ? "/v1/chat/completions" : "/v1/completions");
    }
    return out;
}

// Fields shared by both endpoints: sampling, penalties, stop, stream, n (and those it does not know).
completion_request parse_common(const ojson& j, bool chat, const sampling_params& d) {
    completion_request r;
    r.chat = chat;
    r.unknown_fields = unknown_fields(j, chat);
    if (const ojson* m = field(j, "model")) {
        if (!m->is_string()) bad("model", "'model' must be a string");
        r.model = m->get<std::string>();
    }
    if (integer(j, "n", 1, INT64_MIN, INT64_MAX) != 1) bad("n", "only n = 1 is supported", "unsupported_value");
    if (integer(j, "best_of", 1, INT64_MIN, INT64_MAX) != 1) bad("best_of", "only best_of = 1 is supported", "unsupported_value");
    r.sampling.temperature = (float)number(j, "temperature", d.temperature, 0.0, 2.0);
    r.sampling.top_p = (float)number(j, "top_p", d.top_p, 0.0, 1.0, /*lo_open=*/true);
    const int64_t top_k = integer(j, "top_k", d.top_k, -1, 1 << 30);
    r.sampling.top_k = top_k < 0 ? 0 : (int)top_k;  // -1: off (vLLM's spelling)
    r.sampling.min_p = (float)number(j, "min_p", d.min_p, 0.0, 1.0);
    if (r.sampling.min_p >= 1.0f) bad("min_p", "'min_p' must be below 1");
    if (const ojson* s = field(j, "seed")) {
        if (!s->is_number_integer()) bad("seed", "'seed' must be an integer");
        r.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : (uint64_t)s->get<int64_t>();
    } else {
        r.sampling.seed = std::random_device{}() ^ ((uint64_t)std::random_device{}() << 32);
    }
    r.penalties.presence = (float)number(j, "presence_penalty", 0.0, -2.0, 2.0);
    r.penalties.frequency = (float)number(j, "frequency_penalty", 0.0, -2.0, 2.0);
    r.penalties.repetition = (float)number(j, "repetition_penalty", 1.0, 0.0, 10.0, /*lo_open=*/true);
    if (const ojson* lb = field(j, "logit_bias")) {
        if (!lb->is_object()) bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
        for (const auto& [key, v] : lb->items()) {
            int64_t id = -1;
            const bool digits = !key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == std::string::npos;
            if (digits) id = std::stoll(key);
            if (!digits || id > INT32_MAX)
                bad("logit_bias", "logit_bias keys must be token ids (non-negative integers as strings), got '" + key + "'");
            if (!v.is_number()) bad("logit_bias", "logit_bias['" + key + "'] must be a number, got " + type_of(v));
            const double x = v.get<double>();
            if (!std::isfinite(x) || x < -100.0 || x > 100.0)
                bad("logit_bias", strprintf("logit_bias['%s'] must be in [-100, 100], got %g", key.c_str(), x));
            r.logit_bias.emplace_back((int32_t)id, (float)x);
        }
    }
    if (const ojson* s = field(j, "stop")) {
        if (s->is_string()) {
            r.stop.push_back(s->get<std::string>());
        } else if (s->is_array()) {
            if (s->size() > 16) bad("stop", "at most 16 stop sequences are supported");
            for (const ojson& x : *s) {
                if (!x.is_string()) bad("stop", "'stop' must be a string or an array of strings");
                r.stop.push_back(x.get<std::string>());
            }
        } else {
            bad("stop", "'stop' must be a string or an array of strings, got " + type_of(*s));
        }
        for (const std::string& x : r.stop)
            if (x.size() > 1024) bad("stop", "a stop sequence is longer than 1024 bytes");
    }
    r.ignore_eos = boolean(j, "ignore_eos", false);
    r.cache_prompt = boolean(j, "cache_prompt", true);
    r.stream = boolean(j, "stream", false);
    if (const ojson* so = field(j, "stream_options")) {
        if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
        r.include_usage = boolean(*so, "include_usage", false);
    }
    return r;
}

int64_t max_tokens_field(const ojson& j, int64_t dflt) {
    const int64_t a = integer(j, "max_completion_tokens", -2, 1, INT64_MAX / 4);
    if (a != -2) return a;
    return integer(j, "max_tokens", dflt, 1, INT64_MAX / 4);
}

// Checks a message's content: a string, or an array of text parts (other part types are refused clearly).
void check_content(const ojson& c, const std::string& where) {
    if (c.is_string()) return;
    for_each_content_part(c, where, [](const ojson& part, const std::string& w, const std::string& t) {
        if (t == "text" || t == "input_text" || (t.empty() && part.contains("text"))) {
            const ojson* text = field(part, "text");
            if (!text || !text->is_string()) bad(w, w + ".text must be a string");
            return;
        }
        if (t == "image_url" || t == "image" || t == "input_image" || t == "video" || t == "video_url" ||
            t == "input_audio" || t == "file")
            bad(w, "content parts of type '" + t + "' are not supported (this server is text only)", "unsupported_content");
        bad(w, w + " has an unknown type '" + t + "'");
    });
}

// Checks every message and returns the list the template wants: roles known, contents well typed, assistant
// tool calls with JSON-string arguments parsed into objects (a 400 when they do not parse).
ojson parse_messages(const ojson& j) {
    const ojson* ms = field(j, "messages");
    if (!ms) bad("messages", "'messages' is required");
    if (!ms->is_array()) bad("messages", "'messages' must be an array, got " + type_of(*ms));
    if (ms->empty()) bad("messages", "'messages' must contain at least one message");
    ojson out = ojson::array();
    for (size_t i = 0; i < ms->size(); i++) {
        const ojson& m = (*ms)[i];
        const std::string w = "messages[" + std::to_string(i) + "]";
        if (!m.is_object()) bad(w, w + " must be an object, got " + type_of(m));
        const ojson* role = field(m, "role");
        if (!role || !role->is_string()) bad(w + ".role", w + ".role is required and must be a string");
        std::string r = role->get<std::string>();
        if (r == "developer") r = "system";  // OpenAI's newer name for the system turn
        if (r != "system" && r != "user" && r != "assistant" && r != "tool")
            bad(w + ".role", w + ": unknown role '" + role->get<std::string>() +
                                 "' (expected system, developer, user, assistant or tool)");
        ojson mm = m;
        mm["role"] = r;
        const ojson* content = field(m, "content");
        const ojson* calls = field(m, "tool_calls");
        if (content) {
            check_content(*content, w + ".content");
        } else if (r != "assistant") {
            bad(w + ".content", w + ".content is required for role '" + r + "'");
        }
        if (calls) {
            if (r != "assistant") bad(w + ".tool_calls", "only assistant messages carry tool_calls");
            if (!calls->is_array()) bad(w + ".tool_calls", w + ".tool_calls must be an array");
            for (size_t k = 0; k < calls->size(); k++) {
                const ojson& c = (*calls)[k];
                const std::string wc = w + ".tool_calls[" + std::to_string(k) + "]";
                if (!c.is_object()) bad(wc, wc + " must be an object");
                const ojson* f = field(c, "function");
                if (!f || !f->is_object()) bad(wc + ".function", wc + ".function must be an object");
                const ojson* name = field(*f, "name");
                if (!name || !name->is_string() || name->get<std::string>().empty())
                    bad(wc + ".function.name", wc + ".function.name must be a non-empty string");
                const ojson* args = field(*f, "arguments");
                if (args && !args->is_string() && !args->is_object())
                    bad(wc + ".function.arguments", wc + ".function.arguments must be a JSON string");
            }
        }
        if (const ojson* rc = field(m, "reasoning_content"); rc && !rc->is_string())
            bad(w + ".reasoning_content", w + ".reasoning_content must be a string");
        if (!mm.contains("reasoning_content"))
            if (const ojson* rc = field(m, "reasoning"); rc && rc->is_string()) mm["reasoning_content"] = *rc;
        out.push_back(std::move(mm));
    }
    try {
        return normalize_openai_tool_calls(out);
    } catch (const error& e) {
        std::string msg = e.what();
        const std::string prefix = "chat request: ";
        if (msg.rfind(prefix, 0) == 0) msg.erase(0, prefix.size());
        bad("messages", msg, "invalid_tool_call_arguments");
    } catch (const nlohmann::json::exception& e) {
        // note: normalize_openai_tool_calls lets nlohmann's out_of_range through (arguments "{\"a\": 1e999}")
        bad("messages", std::string("tool-call arguments are not valid JSON: ") + e.what(), "invalid_tool_call_arguments");
    }
}

ojson parse_tools(const ojson& j) {
    const ojson* t = field(j, "tools");
    if (!t) return nullptr;
    if (!t->is_array()) bad("tools", "'tools' must be an array, got " + type_of(*t));
    for (size_t i = 0; i < t->size(); i++) {
        const ojson& tool = (*t)[i];
        const std::string w = "tools[" + std::to_string(i) + "]";
        if (!tool.is_object()) bad(w, w + " must be an object");
        const ojson* type = field(tool, "type");
        if (type && (!type->is_string() || type->get<std::string>() != "function"))
            bad(w + ".type", w + ".type must be \"function\"");
        const ojson* f = field(tool, "function");
        if (!f || !f->is_object()) bad(w + ".function", w + ".function must be an object");
        const ojson* name = field(*f, "name");
        if (!name || !name->is_string() || name->get<std::string>().empty())
            bad(w + ".function.name", w + ".function.name must be a non-empty string");
        // OpenAI's rule, plus '.' and ':' (namespaced tools): the name is written into the Qwen tool-call tags
        // as is and read back by the output parser, so nothing it would trim or refuse may be in it
        const std::string n = name->get<std::string>();
        const bool ok_chars = std::all_of(n.begin(), n.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                   c == '.' || c == ':';
        });
        if (n.size() > 64 || !ok_chars)
            bad(w + ".function.name", w + ".function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':'");
        if (const ojson* p = field(*f, "parameters"); p && !p->is_object())
            bad(w + ".function.parameters", w + ".function.parameters must be a JSON schema object");
    }
    return t->empty() ? ojson(nullptr) : *t;
}

bool has_tool(const ojson& tools, const std::string& name) {
    if (!tools.is_array()) return false;
    for (const ojson& t : tools) {  // parse_tools has checked the shape
        const ojson* f = field(t, "function");
        const ojson* n = f ? field(*f, "name") : nullptr;
        if (n && n->is_string() && n->get<std::string>() == name) return true;
    }
    return false;
}

}  // namespace

ojson parse_request_body(const std::string& body) { return parse_body(body); }

completion_request parse_chat_request(const std::string& body, const sampling_params& defaults) {
    const ojson j = parse_body(body);
    completion_request r = parse_common(j, true, defaults);
    r.max_tokens = max_tokens_field(j, -1);
    r.messages = parse_messages(j);
    r.tools = parse_tools(j);
    // legacy: functions / function_call (before tools / tool_choice): the same, spelled differently
    ojson legacy_choice;
    if (const ojson* fs = field(j, "functions")) {
        if (field(j, "tools")) bad("functions", "give 'tools' or the legacy 'functions', not both");
        if (!fs->is_array()) bad("functions", "'functions' must be an array, got " + type_of(*fs));
        ojson wrapped = ojson::array();
        for (const ojson& f : *fs) wrapped.push_back({{"type", "function"}, {"function", f}});
        try {
            r.tools = parse_tools(ojson{{"tools", wrapped}});
        } catch (const api_error& e) {  // name the field the client sent
            std::string p = e.param;
            if (p.rfind("tools[", 0) == 0) p = "functions[" + p.substr(6);
            const size_t f = p.find(".function");
            if (f != std::string::npos) p.erase(f, 9);
            throw api_error(e.status, e.what(), p, e.code, e.type);
        }
    }
    if (const ojson* fc = field(j, "function_call")) {
        if (field(j, "tool_choice")) bad("function_call", "give 'tool_choice' or the legacy 'function_call', not both");
        if (fc->is_string() && (fc->get<std::string>() == "none" || fc->get<std::string>() == "auto"))
            legacy_choice = *fc;
        else if (fc->is_object() && field(*fc, "name"))
            legacy_choice = {{"type", "function"}, {"function", {{"name", (*fc)["name"]}}}};
        else
            bad("function_call", "'function_call' must be \"none\", \"auto\" or {\"name\": ...}");
    }
    const char* choice_param = legacy_choice.is_null() ? "tool_choice" : "function_call";
    if (const ojson* tc = legacy_choice.is_null() ? field(j, "tool_choice") : &legacy_choice) {
        if (tc->is_string()) {
            const std::string s = tc->get<std::string>();
            if (s == "auto") r.tool_choice = tool_choice_mode::automatic;
            else if (s == "none") r.tool_choice = tool_choice_mode::none;
            else if (s == "required") r.tool_choice = tool_choice_mode::required;
            else bad(choice_param, "'tool_choice' must be \"auto\", \"none\", \"required\" or a named function");
        } else if (tc->is_object()) {
            const ojson* f = field(*tc, "function");
            const ojson* name = f && f->is_object() ? field(*f, "name") : nullptr;
            if (!name || !name->is_string())
                bad(choice_param, "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}");
            r.tool_choice = tool_choice_mode::named;
            r.tool_name = name->get<std::string>();
            if (!has_tool(r.tools, r.tool_name))
                bad(choice_param, "tool_choice names '" + r.tool_name + "', which is not among 'tools'");
        } else {
            bad(choice_param, "'tool_choice' must be a string or an object");
        }
        if (r.tool_choice == tool_choice_mode::required && r.tools.is_null())
            bad(choice_param, "tool_choice \"required\" needs 'tools'");
    }
    if (const ojson* rf = field(j, "response_format")) {
        if (!rf->is_object()) bad("response_format", "'response_format' must be an object");
        const ojson* type = field(*rf, "type");
        const std::string t = type && type->is_string() ? type->get<std::string>() : "";
        if (t == "json_object" || t == "json_schema") r.json_mode = true;
        if (t == "json_schema") {
            const ojson* js = field(*rf, "json_schema");
            if (!js || !js->is_object())
                bad("response_format", "response_format.json_schema must be an object {\"name\", \"schema\", \"strict\"}");
            if (const ojson* sc = field(*js, "schema")) {
                if (!sc->is_object() && !sc->is_boolean())
                    bad("response_format", "response_format.json_schema.schema must be a JSON Schema object");
                r.json_schema = *sc;
            }
            if (const ojson* st = field(*js, "strict")) {
                if (!st->is_boolean() && !st->is_null()) bad("response_format", "response_format.json_schema.strict must be a boolean");
                r.json_schema_strict = st->is_boolean() && st->get<bool>();
            }
        } else if (t != "text" && t != "json_object") bad("response_format", "response_format.type must be \"text\", \"json_object\" or \"json_schema\"");
    }
    if (const ojson* k = field(j, "chat_template_kwargs")) {
        if (!k->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
        r.template_kwargs = *k;
    }
    if (const ojson* e = field(j, "reasoning_effort")) {
        if (!e->is_string()) bad("reasoning_effort", "'reasoning_effort' must be a string");
        const std::string s = e->get<std::string>();
        if (s != "none" && s != "minimal" && s != "low" && s != "medium" && s != "high")
            bad("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium or high");
        // none / minimal turn thinking off, low / medium / high on (the model has no budget to scale), unless
        // chat_template_kwargs.enable_thinking says otherwise explicitly
        if (!r.template_kwargs.contains("enable_thinking"))
            r.template_kwargs["enable_thinking"] = !(s == "none" || s == "minimal");
    }
    if (const ojson* m = field(j, "modalities")) {
        if (!m->is_array()) bad("modalities", "'modalities' must be an array");
        for (const ojson& x : *m)
            if (!x.is_string() || x.get<std::string>() != "text")
                bad("modalities", "only the \"text\" modality is supported", "unsupported_value");
    }
    if (field(j, "audio")) bad("audio", "audio output is not supported", "unsupported_value");
    if (field(j, "web_search_options")) bad("web_search_options", "web search is not supported", "unsupported_value");
    if (const ojson* p = field(j, "parallel_tool_calls")) {
        if (!p->is_boolean()) bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
        r.parallel_tool_calls = p->get<bool>();
    }
    if (boolean(j, "allow_special_tokens", false))
        bad("allow_special_tokens", "'allow_special_tokens' is only for /v1/completions: in chat requests only the "
                                    "chat template writes special tokens", "unsupported_value");
    const ojson* et = field(r.template_kwargs, "enable_thinking");
    r.thinking = !(et && et->is_boolean() && !et->get<bool>());  // the template's rule: only false turns it off
    if (boolean(j, "logprobs", false)) {
        r.logprobs = (int)integer(j, "top_logprobs", 0, 0, 20);
    } else if (field(j, "top_logprobs")) {
        integer(j, "top_logprobs", 0, 0, 20);
        bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    return r;
}

completion_request parse_completion_request(const std::string& body, const sampling_params& defaults) {
    const ojson j = parse_body(body);
    completion_request r = parse_common(j, false, defaults);
    r.max_tokens = max_tokens_field(j, 16);  // the legacy endpoint's default
    const ojson* p = field(j, "prompt");
    if (!p) bad("prompt", "'prompt' is required");
    auto one = [&](const ojson& x) {
        completion_request::prompt_item it;
        if (x.is_string()) {
            it.text = x.get<std::string>();
        } else if (x.is_array()) {
            it.is_ids = true;
            for (const ojson& t : x) {
                if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
                    bad("prompt", "a token-id prompt must be an array of non-negative integers");
                it.ids.push_back((int32_t)t.get<int64_t>());
            }
        } else {
            bad("prompt", "'prompt' must be a string, an array of token ids, or an array of those");
        }
        r.prompts.push_back(std::move(it));
    };
    if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
        if (p->size() > k_max_prompts) bad("prompt", strprintf("at most %zu prompts per request", k_max_prompts));
        for (const ojson& x : *p) {
            if (!x.is_string() && !x.is_array())
                bad("prompt", "a list of prompts holds strings or arrays of token ids, got " + type_of(x));
            one(x);
        }
    } else {
        one(*p);
    }
    r.prompt_text = r.prompts[0].text;
    r.prompt_ids = r.prompts[0].ids;
    r.prompt_is_ids = r.prompts[0].is_ids;
    r.allow_special_tokens = boolean(j, "allow_special_tokens", false);
    if (boolean(j, "echo", false)) bad("echo", "'echo' is not supported", "unsupported_value");
    if (const ojson* s = field(j, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
        bad("suffix", "'suffix' is not supported", "unsupported_value");
    if (field(j, "logprobs")) r.logprobs = (int)integer(j, "logprobs", 0, 0, 20);
    return r;
}

sampling_params load_sampling_defaults(const std::string& dir) {
    sampling_params p;  // greedy
    const std::string path = dir + "/generation_config.json";
    if (!file_exists(path)) return p;
    ojson g = ojson::parse(read_text_file(path), nullptr, false);
    if (!g.is_object()) return p;
    const ojson* ds = field(g, "do_sample");
    if (!ds || !ds->is_boolean() || !ds->get<bool>()) return p;
    auto num = [&](const char* k, double d) {
        const ojson* v = field(g, k);
        return v && v->is_number() ? v->get<double>() : d;
    };
    p.temperature = (float)num("temperature", 1.0);
    p.top_p = (float)num("top_p", 1.0);
    p.top_k = (int)num("top_k", 0);
    p.min_p = (float)num("min_p", 0.0);
    return p;
}

}  // namespace tansy
