#include "server/responses.h"

#include <chrono>
#include <cstdio>
#include <set>

#include "core/check.h"
#include "server/openai_internal.h"

namespace tansy {

using namespace openai_detail;

// ---- store

response_store::response_store(size_t max_entries, size_t max_bytes) : max_entries_(max_entries), max_bytes_(max_bytes) {}

void response_store::put(const std::string& id, stored_response r) {
    const size_t b = id.size() + dump(r.items).size() + dump(r.response).size();
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = index_.find(id); it != index_.end()) {
        bytes_ -= it->second->bytes;
        lru_.erase(it->second);
        index_.erase(it);
    }
    if (b > max_bytes_ || max_entries_ == 0) return;  // larger than the whole budget: not kept
    lru_.push_front(entry{id, std::move(r), b});
    index_[id] = lru_.begin();
    bytes_ += b;
    while (lru_.size() > max_entries_ || bytes_ > max_bytes_) {
        bytes_ -= lru_.back().bytes;
        index_.erase(lru_.back().id);
        lru_.pop_back();
    }
}

std::optional<stored_response> response_store::get(const std::string& id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(id);
    if (it == index_.end()) return std::nullopt;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->r;
}

bool response_store::erase(const std::string& id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(id);
    if (it == index_.end()) return false;
    bytes_ -= it->second->bytes;
    lru_.erase(it->second);
    index_.erase(it);
    return true;
}

size_t response_store::size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return lru_.size();
}

size_t response_store::bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return bytes_;
}

api_error response_not_found(const std::string& id, const char* param) {
    if (*param) return api_error(404, "Previous response with id '" + id + "' not found.", param, "", "invalid_request_error");
    return api_error(404, "Response with id '" + id + "' not found.", "", "", "invalid_request_error");
}

// ---- request

namespace {

std::string str_field(const ojson& o, const char* k, const std::string& where, bool required = true) {
    const ojson* v = field(o, k);
    if (!v) {
        if (required) bad(where + "." + k, where + "." + k + " is required");
        return "";
    }
    if (!v->is_string()) bad(where + "." + k, where + "." + k + " must be a string, got " + v->type_name());
    return v->get<std::string>();
}

// The text of a message's content: a string, or the concatenation of its text parts (as the chat template
// joins chat's parts). Images, files and audio are refused: this server is text only.
std::string content_text(const ojson& c, const std::string& where) {
    if (c.is_string()) return c.get<std::string>();
    std::string out;
    for_each_content_part(c, where, [&](const ojson& part, const std::string& w, const std::string& t) {
        if (t == "input_text" || t == "output_text" || t == "text" || t == "summary_text" || t == "reasoning_text") {
            out += str_field(part, "text", w);
        } else if (t == "refusal") {
            out += str_field(part, "refusal", w);
        } else if (t == "input_image" || t == "input_file" || t == "input_audio" || t == "image_url" || t == "file") {
            bad(w, "content parts of type '" + t + "' are not supported (this server is text only)", "unsupported_content");
        } else {
            bad(w, w + " has an unknown type '" + t + "'");
        }
    });
    return out;
}

constexpr const char* k_fields[] = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "stop", "ignore_eos", "stream", "parallel_tool_calls", "previous_response_id", "store", "include",
    "top_logprobs", "chat_template_kwargs", "background", "conversation", "prompt",
    // no-ops: bookkeeping, caching and routing hints that do not change the output of this server
    "metadata", "user", "truncation", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "stream_options", "max_tool_calls"};

// The same policy as the chat endpoints (openai.cpp): unknown fields are ignored, warned about once per name.
std::vector<std::string> unknown_fields(const ojson& j) {
    std::vector<std::string> out;
    for (const auto& [k, v] : j.items()) {
        bool known = false;
        for (const char* f : k_fields) known = known || k == f;
        if (!known) out.push_back(k);
    }
    static std::mutex mu;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lk(mu);
    for (const std::string& k : out) {
        if (warned.size() >= 1000 || !warned.insert(k).second) continue;
        const std::string shown = dump(ojson(k.size() > 64 ? k.substr(0, 64) + "..." : k));
        fprintf(stderr, "tansy serve: warning: ignoring unknown request field %s (/v1/responses; shown once per name)\n",
                shown.c_str());
    }
    return out;
}

// Responses tools ({"type": "function", "name", ...}, flat) -> chat tools ({"type": "function", "function": {...}}).
ojson translate_tools(const ojson& t) {
    if (!t.is_array()) bad("tools", std::string("'tools' must be an array, got ") + t.type_name());
    ojson out = ojson::array();
    for (size_t i = 0; i < t.size(); i++) {
        const ojson& tool = t[i];
        const std::string w = "tools[" + std::to_string(i) + "]";
        if (!tool.is_object()) bad(w, w + " must be an object");
        const std::string type = str_field(tool, "type", w);
        if (type != "function")
            bad(w + ".type", "tools of type '" + type + "' are not supported (only \"function\" tools)", "unsupported_value");
        if (field(tool, "function"))  // the chat shape sent here by mistake: say so rather than "name is required"
            bad(w + ".name", w + ": Responses tools are flat ({\"type\": \"function\", \"name\", \"parameters\"}), not "
                                 "chat's {\"function\": {...}}");
        ojson f = {{"name", str_field(tool, "name", w)}};
        for (const char* k : {"description", "parameters", "strict"})
            if (const ojson* v = field(tool, k)) f[k] = *v;
        out.push_back({{"type", "function"}, {"function", f}});
    }
    return out;
}

ojson translate_tool_choice(const ojson& tc) {
    if (tc.is_string()) return tc;  // auto / none / required: the chat parser checks the value
    if (!tc.is_object()) bad("tool_choice", "'tool_choice' must be a string or an object");
    const ojson* type = field(tc, "type");
    const std::string t = type && type->is_string() ? type->get<std::string>() : "";
    if (t != "function")
        bad("tool_choice", "tool_choice of type '" + t + "' is not supported (\"auto\", \"none\", \"required\" or "
                           "{\"type\": \"function\", \"name\": ...})", "unsupported_value");
    const ojson* name = field(tc, "name");
    if (!name || !name->is_string()) bad("tool_choice", "a named tool_choice is {\"type\": \"function\", \"name\": ...}");
    return {{"type", "function"}, {"function", {{"name", *name}}}};
}

ojson translate_format(const ojson& text) {
    if (!text.is_object()) bad("text", "'text' must be an object");
    if (const ojson* v = field(text, "verbosity");
        v && !(v->is_string() && (*v == "low" || *v == "medium" || *v == "high")))
        bad("text.verbosity", "text.verbosity must be \"low\", \"medium\" or \"high\"");
    const ojson* f = field(text, "format");
    if (!f) return nullptr;
    if (!f->is_object()) bad("text.format", "text.format must be an object");
    const ojson* type = field(*f, "type");
    const std::string t = type && type->is_string() ? type->get<std::string>() : "";
    if (t == "text" || t == "json_object") return {{"type", t}};
    if (t == "json_schema") {
        const ojson* schema = field(*f, "schema");
        if (!schema || !schema->is_object()) bad("text.format.schema", "text.format.schema must be a JSON schema object");
        const ojson* name = field(*f, "name");
        if (name && !name->is_string()) bad("text.format.name", "text.format.name must be a string");
        ojson js = {{"name", name ? *name : ojson("response")}, {"schema", *schema}};
        for (const char* k : {"description", "strict"})
            if (const ojson* v = field(*f, k)) js[k] = *v;
        return {{"type", "json_schema"}, {"json_schema", js}};
    }
    bad("text.format.type", "text.format.type must be \"text\", \"json_object\" or \"json_schema\"");
}

}  // namespace

// The chat parser's error, named as the Responses API names things.
api_error as_responses_error(const api_error& e) {
    static const std::pair<const char*, const char*> k_names[] = {
        {"max_completion_tokens", "max_output_tokens"}, {"response_format", "text.format"},
        {"reasoning_effort", "reasoning.effort"}, {"messages", "input"}, {".function.", "."}};
    auto fix = [](std::string s) {
        for (const auto& [from, to] : k_names)
            for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + std::string(to).size()))
                s.replace(p, std::string(from).size(), to);
        return s;
    };
    std::string param = fix(e.param);
    if (param.rfind("input[", 0) == 0) param = "input";  // message indices are not item indices
    return api_error(e.status, fix(e.what()), param, e.code, e.type);
}

ojson responses_items_to_messages(const ojson& items, const std::string& instructions) {
    if (!items.is_array()) bad("input", std::string("'input' must be a string or an array of items, got ") + items.type_name());
    ojson out = ojson::array();
    if (!instructions.empty()) out.push_back({{"role", "system"}, {"content", instructions}});
    ojson turn = nullptr;  // the assistant turn being gathered
    std::set<std::string> call_ids;
    auto flush = [&] {
        // a turn of reasoning alone is dropped (no assistant output followed it)
        if (!turn.is_null() && (turn.contains("content") || turn.contains("tool_calls"))) out.push_back(std::move(turn));
        turn = nullptr;
    };
    auto start_turn = [&] {
        if (turn.is_null()) turn = {{"role", "assistant"}};
    };
    for (size_t i = 0; i < items.size(); i++) {
        const ojson& it = items[i];
        const std::string w = "input[" + std::to_string(i) + "]";
        if (!it.is_object()) bad(w, w + " must be an object, got " + it.type_name());
        const ojson* type = field(it, "type");
        if (type && !type->is_string()) bad(w + ".type", w + ".type must be a string");
        const std::string t = type ? type->get<std::string>() : "message";  // EasyInputMessage has no type
        if (t == "message") {
            std::string role = str_field(it, "role", w);
            const ojson* c = field(it, "content");
            if (!c) bad(w + ".content", w + ".content is required");
            std::string text = content_text(*c, w + ".content");
            if (role == "assistant") {
                if (!turn.is_null() && (turn.contains("content") || turn.contains("tool_calls"))) flush();
                start_turn();
                turn["content"] = std::move(text);
                continue;
            }
            if (role == "developer") role = "system";
            if (role != "user" && role != "system")
                bad(w + ".role", w + ": unknown role '" + role + "' (expected user, system, developer or assistant)");
            flush();
            out.push_back({{"role", role}, {"content", std::move(text)}});
        } else if (t == "function_call") {
            const std::string call_id = str_field(it, "call_id", w), name = str_field(it, "name", w);
            const std::string args = str_field(it, "arguments", w);
            start_turn();
            if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
            turn["tool_calls"].push_back(
                {{"id", call_id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", args}}}});
            call_ids.insert(call_id);
        } else if (t == "function_call_output") {
            const std::string call_id = str_field(it, "call_id", w);
            if (!call_ids.count(call_id))
                bad(w + ".call_id", "No tool call found for function call output with call_id " + call_id + ".");
            const ojson* o = field(it, "output");
            if (!o) bad(w + ".output", w + ".output is required");
            std::string text = content_text(*o, w + ".output");
            flush();
            out.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", std::move(text)}});
        } else if (t == "reasoning") {
            // its reasoning_text content, or else its summary (encrypted_content cannot be read here)
            std::string text;
            if (const ojson* c = field(it, "content"); c && c->is_array() && !c->empty()) text = content_text(*c, w + ".content");
            else if (const ojson* s = field(it, "summary")) text = content_text(*s, w + ".summary");
            if (!turn.is_null() && (turn.contains("content") || turn.contains("tool_calls"))) flush();
            start_turn();
            std::string r = turn.value("reasoning_content", "");
            turn["reasoning_content"] = r.empty() ? text : r + "\n" + text;
        } else if (t == "item_reference") {
            bad(w + ".type", "input items of type 'item_reference' are not supported; send the item itself or use "
                             "previous_response_id", "unsupported_value");
        } else {
            bad(w + ".type", "input items of type '" + t + "' are not supported (message, function_call, "
                             "function_call_output and reasoning are)", "unsupported_value");
        }
    }
    flush();
    return out;
}

responses_request parse_responses_request(const std::string& body, const sampling_params& defaults,
                                          response_store& store) {
    const ojson j = parse_request_body(body);
    responses_request rr;
    const std::vector<std::string> unknown = unknown_fields(j);
    ojson cj = ojson::object();  // the chat request this one becomes
    for (const char* k : {"model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                          "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "ignore_eos", "stream",
                          "parallel_tool_calls", "chat_template_kwargs"})
        if (const ojson* v = field(j, k)) cj[k] = *v;
    if (const ojson* v = field(j, "max_output_tokens")) cj["max_completion_tokens"] = *v;

    // refused: what this server does not do
    if (const ojson* b = field(j, "background"); b && !(b->is_boolean() && !b->get<bool>()))
        bad("background", "background responses are not supported", "unsupported_value");
    if (field(j, "conversation"))
        bad("conversation", "conversations are not supported; use previous_response_id", "unsupported_value");
    if (field(j, "prompt")) bad("prompt", "prompt templates are not supported", "unsupported_value");
    if (const ojson* t = field(j, "truncation");
        t && !(t->is_string() && (*t == "disabled" || *t == "auto")))
        bad("truncation", "'truncation' must be \"auto\" or \"disabled\"");

    std::string instructions;
    if (const ojson* v = field(j, "instructions")) {
        if (!v->is_string()) bad("instructions", "'instructions' must be a string");
        instructions = v->get<std::string>();
    }
    ojson items = ojson::array();
    std::string prev_id;
    if (const ojson* p = field(j, "previous_response_id")) {
        if (!p->is_string()) bad("previous_response_id", "'previous_response_id' must be a string");
        prev_id = p->get<std::string>();
        std::optional<stored_response> prev = store.get(prev_id);
        if (!prev) throw response_not_found(prev_id, "previous_response_id");
        items = prev->items;
    }
    const ojson* in = field(j, "input");
    if (!in && prev_id.empty()) bad("input", "'input' is required");
    if (in && in->is_string()) items.push_back({{"type", "message"}, {"role", "user"}, {"content", *in}});
    else if (in && in->is_array()) items.insert(items.end(), in->begin(), in->end());
    else if (in) bad("input", std::string("'input' must be a string or an array of items, got ") + in->type_name());
    // the new items' errors are named by their index in this request's input
    const size_t n_prev = prev_id.empty() ? 0 : items.size() - (in ? (in->is_string() ? 1 : in->size()) : 0);
    try {
        cj["messages"] = responses_items_to_messages(items, instructions);
    } catch (const api_error& e) {
        // "input[N]" counts the previous response's items too: name the item as this request numbers it
        std::string param = e.param, msg = e.what();
        if (n_prev && param.rfind("input[", 0) == 0) {
            const size_t close = param.find(']');
            const size_t n = std::stoul(param.substr(6, close - 6));
            const std::string from = param.substr(0, close + 1);
            const std::string to = n < n_prev ? "previous_response_id" : "input[" + std::to_string(n - n_prev) + "]";
            for (size_t p = msg.find(from); p != std::string::npos; p = msg.find(from, p + to.size()))
                msg.replace(p, from.size(), to);
            param = n < n_prev ? to : to + param.substr(close + 1);
        }
        throw api_error(e.status, msg, param, e.code, e.type);
    }

    ojson echo_tools = ojson::array();
    if (const ojson* t = field(j, "tools")) {
        ojson ct = translate_tools(*t);
        echo_tools = *t;
        if (!ct.empty()) cj["tools"] = std::move(ct);
    }
    ojson echo_choice = "auto";
    if (const ojson* tc = field(j, "tool_choice")) {
        cj["tool_choice"] = translate_tool_choice(*tc);
        echo_choice = *tc;
    }
    ojson echo_text = {{"format", {{"type", "text"}}}};
    if (const ojson* t = field(j, "text")) {
        ojson rf = translate_format(*t);
        if (!rf.is_null()) cj["response_format"] = std::move(rf);
        for (const auto& [k, v] : t->items()) echo_text[k] = v;
    }
    ojson echo_reasoning = {{"effort", nullptr}, {"summary", nullptr}};
    if (const ojson* r = field(j, "reasoning")) {
        if (!r->is_object()) bad("reasoning", "'reasoning' must be an object");
        if (const ojson* e = field(*r, "effort")) {
            // xhigh: as high (the model has no budget to scale; only none/minimal vs the rest matters)
            cj["reasoning_effort"] = e->is_string() && *e == "xhigh" ? ojson("high") : *e;
            echo_reasoning["effort"] = *e;
        }
        for (const char* k : {"summary", "generate_summary"})  // no-op: reasoning is returned whole, as reasoning_text
            if (const ojson* s = field(*r, k)) {
                if (!s->is_string()) bad(std::string("reasoning.") + k, std::string("reasoning.") + k + " must be a string");
                echo_reasoning["summary"] = *s;
            }
    }
    int64_t top_logprobs = 0;
    bool want_logprobs = false;
    if (const ojson* t = field(j, "top_logprobs")) {
        if (!t->is_number_integer() || t->get<int64_t>() < 0 || t->get<int64_t>() > 20)
            bad("top_logprobs", "'top_logprobs' must be an integer in [0, 20]");
        top_logprobs = t->get<int64_t>();
        want_logprobs = top_logprobs > 0;
    }
    if (const ojson* inc = field(j, "include")) {
        if (!inc->is_array()) bad("include", "'include' must be an array of strings");
        for (const ojson& x : *inc) {
            if (!x.is_string()) bad("include", "'include' must be an array of strings");
            // others (reasoning.encrypted_content, *_call results, image urls) name things never made here: no-ops
            if (x == "message.output_text.logprobs") want_logprobs = true;
        }
    }
    if (want_logprobs) {
        cj["logprobs"] = true;
        cj["top_logprobs"] = top_logprobs;
    }
    try {
        rr.chat = parse_chat_request(dump(cj), defaults);
    } catch (const api_error& e) {
        throw as_responses_error(e);
    }
    rr.chat.unknown_fields = unknown;
    rr.store = true;
    if (const ojson* s = field(j, "store")) {
        if (!s->is_boolean()) bad("store", "'store' must be a boolean");
        rr.store = s->get<bool>();
    }
    const ojson* meta = field(j, "metadata");
    if (meta && !meta->is_object()) bad("metadata", "'metadata' must be an object");
    const ojson* user = field(j, "user");
    const ojson* ptc = field(j, "parallel_tool_calls");  // checked by the chat parser
    const ojson* trunc = field(j, "truncation");
    rr.items = std::move(items);
    rr.echo = {{"instructions", instructions.empty() ? ojson(nullptr) : ojson(instructions)},
               {"max_output_tokens", rr.chat.max_tokens > 0 ? ojson(rr.chat.max_tokens) : ojson(nullptr)},
               {"parallel_tool_calls", ptc ? *ptc : ojson(true)},
               {"previous_response_id", prev_id.empty() ? ojson(nullptr) : ojson(prev_id)},
               {"reasoning", echo_reasoning},
               {"store", rr.store},
               {"temperature", rr.chat.sampling.temperature},
               {"text", echo_text},
               {"tool_choice", echo_choice},
               {"tools", echo_tools},
               {"top_logprobs", top_logprobs},
               {"top_p", rr.chat.sampling.top_p},
               {"truncation", trunc ? *trunc : ojson("disabled")},
               {"user", user ? *user : ojson(nullptr)},
               {"metadata", meta ? *meta : ojson::object()}};
    return rr;
}

// ---- response and events

responses_writer::responses_writer(responses_request r, response_meta meta, response_store* store)
    : req_(std::move(r)), meta_(std::move(meta)), store_(store) {}

ojson responses_writer::item_json(const item& it) const {
    const char* status = it.open ? "in_progress" : it.incomplete ? "incomplete" : "completed";
    switch (it.kind) {
        case item::reasoning: {
            ojson content = ojson::array();
            if (!it.open) content.push_back({{"type", "reasoning_text"}, {"text", it.text}});
            return {{"id", it.id}, {"type", "reasoning"}, {"summary", ojson::array()}, {"content", content}, {"status", status}};
        }
        case item::message: {
            ojson content = ojson::array();
            if (!it.open)
                content.push_back({{"type", "output_text"}, {"text", it.text}, {"annotations", ojson::array()}, {"logprobs", it.logprobs}});
            return {{"id", it.id}, {"type", "message"}, {"status", status}, {"role", "assistant"}, {"content", content}};
        }
        case item::call:
            return {{"id", it.id}, {"type", "function_call"}, {"status", status}, {"arguments", it.open ? "" : it.text},
                    {"call_id", it.call_id}, {"name", it.name}};
    }
    TANSY_ABORT("responses item kind %d", (int)it.kind);
}

ojson responses_writer::response_json(const char* status) const {
    ojson output = ojson::array();
    for (const item& it : items_)
        if (!it.open) output.push_back(item_json(it));
    ojson o = {{"id", meta_.id},
               {"object", "response"},
               {"created_at", meta_.created},
               {"status", status},
               {"background", false},
               {"error", error_},
               {"incomplete_details", incomplete_details_},
               {"model", meta_.model},
               {"output", output}};
    for (const auto& [k, v] : req_.echo.items()) o[k] = v;
    o["usage"] = usage_;
    return o;
}

std::string responses_writer::event(const char* type, ojson data) {
    ojson e = {{"type", type}};
    for (auto& [k, v] : data.items()) e[k] = std::move(v);
    e["sequence_number"] = seq_++;
    return std::string("event: ") + type + "\ndata: " + dump(e) + "\n\n";
}

void responses_writer::close_current(std::string& out) {
    if (items_.empty() || !items_.back().open) return;
    item& it = items_.back();
    const int64_t idx = (int64_t)items_.size() - 1;
    it.open = false;
    switch (it.kind) {
        case item::reasoning: {
            const ojson part = {{"type", "reasoning_text"}, {"text", it.text}};
            out += event("response.reasoning_text.done", {{"item_id", it.id}, {"output_index", idx}, {"content_index", 0}, {"text", it.text}});
            out += event("response.content_part.done", {{"item_id", it.id}, {"output_index", idx}, {"content_index", 0}, {"part", part}});
            break;
        }
        case item::message: {
            const ojson part = {{"type", "output_text"}, {"text", it.text}, {"annotations", ojson::array()}, {"logprobs", it.logprobs}};
            out += event("response.output_text.done", {{"item_id", it.id}, {"output_index", idx}, {"content_index", 0},
                                                       {"text", it.text}, {"logprobs", it.logprobs}});
            out += event("response.content_part.done", {{"item_id", it.id}, {"output_index", idx}, {"content_index", 0}, {"part", part}});
            break;
        }
        case item::call:
            out += event("response.function_call_arguments.done",
                         {{"item_id", it.id}, {"output_index", idx}, {"name", it.name}, {"arguments", it.text}});
            break;
    }
    out += event("response.output_item.done", {{"output_index", idx}, {"item", item_json(it)}});
}

responses_writer::item& responses_writer::open_item(item::kind_t k, std::string& out, const std::string& name) {
    close_current(out);
    item it;
    it.kind = k;
    it.id = new_id(k == item::reasoning ? "rs_" : k == item::message ? "msg_" : "fc_");
    if (k == item::call) it.name = name, it.call_id = new_id("call_");
    items_.push_back(std::move(it));
    item& cur = items_.back();
    const int64_t idx = (int64_t)items_.size() - 1;
    out += event("response.output_item.added", {{"output_index", idx}, {"item", item_json(cur)}});
    if (k == item::reasoning)
        out += event("response.content_part.added", {{"item_id", cur.id}, {"output_index", idx}, {"content_index", 0},
                                                     {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
    if (k == item::message)
        out += event("response.content_part.added",
                     {{"item_id", cur.id}, {"output_index", idx}, {"content_index", 0},
                      {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", ojson::array()}, {"logprobs", ojson::array()}}}});
    return cur;
}

std::string responses_writer::begin() {
    const ojson r = response_json("in_progress");
    std::string out = event("response.created", {{"response", r}});  // (two statements: sequence numbers in order)
    return out + event("response.in_progress", {{"response", r}});
}

std::string responses_writer::add(const parsed_delta& d, const ojson& logprobs) {
    std::string out;
    auto current = [&](item::kind_t k) { return !items_.empty() && items_.back().open && items_.back().kind == k; };
    if (!d.reasoning.empty()) {
        item& it = current(item::reasoning) ? items_.back() : open_item(item::reasoning, out);
        it.text += d.reasoning;
        out += event("response.reasoning_text.delta", {{"item_id", it.id}, {"output_index", (int64_t)items_.size() - 1},
                                                       {"content_index", 0}, {"delta", d.reasoning}});
    }
    if (!d.content.empty()) {
        item& it = current(item::message) ? items_.back() : open_item(item::message, out);
        it.text += d.content;
        const ojson lp = logprobs.is_array() ? logprobs : ojson::array();
        it.logprobs.insert(it.logprobs.end(), lp.begin(), lp.end());
        out += event("response.output_text.delta", {{"item_id", it.id}, {"output_index", (int64_t)items_.size() - 1},
                                                    {"content_index", 0}, {"delta", d.content}, {"logprobs", lp}});
    }
    for (const tool_call_delta& t : d.tool_calls) {
        if (!t.name.empty()) {
            open_item(item::call, out, t.name);
            if ((size_t)t.index >= call_items_.size()) call_items_.resize((size_t)t.index + 1, SIZE_MAX);
            call_items_[(size_t)t.index] = items_.size() - 1;
        }
        if ((size_t)t.index >= call_items_.size() || call_items_[(size_t)t.index] == SIZE_MAX) continue;  // never named
        const size_t idx = call_items_[(size_t)t.index];
        item& it = items_[idx];
        if (t.arguments.empty() || !it.open) continue;
        it.text += t.arguments;
        out += event("response.function_call_arguments.delta",
                     {{"item_id", it.id}, {"output_index", (int64_t)idx}, {"delta", t.arguments}});
    }
    return out;
}

ojson responses_writer::finish(bool incomplete, int64_t input_tokens, int64_t output_tokens, int64_t reasoning_tokens) {
    std::string ignored;
    if (incomplete && !items_.empty() && items_.back().open) items_.back().incomplete = true;
    close_current(ignored);
    usage_ = {{"input_tokens", input_tokens},
              {"input_tokens_details", {{"cached_tokens", cached_tokens_}}},
              {"output_tokens", output_tokens},
              {"output_tokens_details", {{"reasoning_tokens", reasoning_tokens}}},
              {"total_tokens", input_tokens + output_tokens}};
    if (incomplete) incomplete_details_ = {{"reason", "max_output_tokens"}};
    ojson r = response_json(incomplete ? "incomplete" : "completed");
    const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count();
    r["completed_at"] = incomplete ? ojson(nullptr) : ojson(now);
    if (store_ && req_.store) {
        stored_response s{req_.items, r};
        for (const ojson& it : r["output"]) s.items.push_back(it);
        store_->put(meta_.id, std::move(s));
    }
    return r;
}

std::string responses_writer::finish_events(bool incomplete, int64_t input_tokens, int64_t output_tokens,
                                            int64_t reasoning_tokens) {
    std::string out;
    if (incomplete && !items_.empty() && items_.back().open) items_.back().incomplete = true;
    close_current(out);
    const ojson r = finish(incomplete, input_tokens, output_tokens, reasoning_tokens);
    out += event(incomplete ? "response.incomplete" : "response.completed", {{"response", r}});
    return out;
}

std::string responses_writer::failed(const api_error& e) {
    std::string out = event("error", {{"code", e.code.empty() ? ojson("server_error") : ojson(e.code)},
                                      {"message", e.what()},
                                      {"param", e.param.empty() ? ojson(nullptr) : ojson(e.param)}});
    for (item& it : items_) it.open = false, it.incomplete = true;  // no done events: the response failed
    error_ = {{"code", "server_error"}, {"message", e.what()}};
    out += event("response.failed", {{"response", response_json("failed")}});
    return out;
}

}  // namespace tansy
