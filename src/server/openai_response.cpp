// The OpenAI wire format, answer side (openai.h): ids, usage, log-probs, responses, stream chunks and SSE events in
// OpenAI's exact shapes. The request side (parsing and validation, errors) is openai.cpp.
#include "server/openai.h"

#include <cstdio>
#include <random>

#include "server/text_stream.h"
#include "tokenizer/utf8.h"

namespace tansy {

std::string new_id(const char* prefix) {
    static thread_local std::mt19937_64 rng(std::random_device{}() ^ (uint64_t)(uintptr_t)&rng);
    char b[32];
    snprintf(b, sizeof b, "%016llx%08llx", (unsigned long long)rng(), (unsigned long long)(rng() & 0xffffffffu));
    return std::string(prefix) + b;
}

ojson usage_json(int64_t prompt, int64_t completion, int64_t reasoning, int64_t cached) {
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}},
            {"completion_tokens_details", {{"reasoning_tokens", reasoning}}}};
}

namespace {

ojson bytes_of(std::string_view s) {
    ojson b = ojson::array();
    for (unsigned char c : s) b.push_back((int)c);
    return b;
}

std::string token_text(const tokenizer& tok, int32_t id) { return utf8_lossy(token_bytes_or_unknown(tok, id)); }

}  // namespace

ojson chat_logprobs(const tokenizer& tok, const std::vector<token_event>& tokens) {
    ojson content = ojson::array();
    for (const token_event& e : tokens) {
        ojson top = ojson::array();
        for (const auto& [id, lp] : e.top)
            top.push_back({{"token", token_text(tok, id)}, {"logprob", lp}, {"bytes", bytes_of(token_bytes_or_unknown(tok, id))}});
        content.push_back({{"token", token_text(tok, e.id)},
                           {"logprob", e.logprob},
                           {"bytes", bytes_of(token_bytes_or_unknown(tok, e.id))},
                           {"top_logprobs", top}});
    }
    return {{"content", content}};
}

ojson completion_logprobs(const tokenizer& tok, const std::vector<token_event>& tokens, int64_t offset0) {
    ojson toks = ojson::array(), lps = ojson::array(), tops = ojson::array(), offs = ojson::array();
    int64_t off = offset0;
    for (const token_event& e : tokens) {
        const std::string t = token_text(tok, e.id);
        toks.push_back(t);
        lps.push_back(e.logprob);
        ojson top = ojson::object();
        for (const auto& [id, lp] : e.top) top[token_text(tok, id)] = lp;
        tops.push_back(top);
        offs.push_back(off);
        off += (int64_t)t.size();
    }
    return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

ojson chat_response(const response_meta& m, const output_parser& p, const std::vector<std::string>& call_ids,
                    const std::string& finish, const ojson& usage, const ojson& logprobs) {
    return chat_response(m, p.reasoning(), p.content(), p.tool_calls(), call_ids, finish, usage, logprobs);
}

ojson chat_response(const response_meta& m, const std::string& reasoning, const std::string& content,
                    const std::vector<parsed_tool_call>& tool_calls, const std::vector<std::string>& call_ids,
                    const std::string& finish, const ojson& usage, const ojson& logprobs) {
    ojson msg = {{"role", "assistant"},
                 {"content", content.empty() && !tool_calls.empty() ? ojson(nullptr) : ojson(content)},
                 {"reasoning_content", reasoning.empty() ? ojson(nullptr) : ojson(reasoning)}};
    if (!tool_calls.empty()) {
        ojson calls = ojson::array();
        for (size_t i = 0; i < tool_calls.size(); i++) {
            const parsed_tool_call& c = tool_calls[i];
            calls.push_back({{"id", i < call_ids.size() ? call_ids[i] : new_id("call_")},
                             {"type", "function"},
                             {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
        }
        msg["tool_calls"] = calls;
    }
    return {{"id", m.id},
            {"object", "chat.completion"},
            {"created", m.created},
            {"model", m.model},
            {"choices", ojson::array({{{"index", 0}, {"message", msg}, {"logprobs", logprobs}, {"finish_reason", finish}}})},
            {"usage", usage},
            {"system_fingerprint", nullptr}};
}

ojson chat_delta(const parsed_delta& d, std::vector<std::string>& call_ids) {
    ojson delta = ojson::object();
    if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
    if (!d.content.empty()) delta["content"] = d.content;
    if (!d.tool_calls.empty()) {
        ojson calls = ojson::array();
        for (const tool_call_delta& t : d.tool_calls) {
            ojson c = {{"index", t.index}};
            ojson f = ojson::object();
            if (!t.name.empty()) {
                while ((int)call_ids.size() <= t.index) call_ids.push_back(new_id("call_"));
                c["id"] = call_ids[(size_t)t.index];
                c["type"] = "function";
                f["name"] = t.name;
            }
            f["arguments"] = t.arguments;
            c["function"] = f;
            calls.push_back(c);
        }
        delta["tool_calls"] = calls;
    }
    return delta;
}

ojson chat_chunk(const response_meta& m, const ojson& delta, const std::string& finish, const ojson& logprobs,
                 bool include_usage) {
    ojson c = {{"id", m.id},
               {"object", "chat.completion.chunk"},
               {"created", m.created},
               {"model", m.model},
               {"system_fingerprint", nullptr},
               {"choices", ojson::array({{{"index", 0},
                                          {"delta", delta},
                                          {"logprobs", logprobs},
                                          {"finish_reason", finish.empty() ? ojson(nullptr) : ojson(finish)}}})}};
    if (include_usage) c["usage"] = nullptr;
    return c;
}

ojson completion_choice(int index, const std::string& text, const std::string& finish, const ojson& logprobs) {
    return {{"index", index}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", finish}};
}

ojson completion_response(const response_meta& m, const ojson& choices, const ojson& usage) {
    return {{"id", m.id},
            {"object", "text_completion"},
            {"created", m.created},
            {"model", m.model},
            {"choices", choices},
            {"usage", usage},
            {"system_fingerprint", nullptr}};
}

ojson completion_response(const response_meta& m, const std::string& text, const std::string& finish,
                          const ojson& usage, const ojson& logprobs) {
    return completion_response(m, ojson::array({completion_choice(0, text, finish, logprobs)}), usage);
}

ojson completion_chunk(const response_meta& m, const std::string& text, const std::string& finish,
                       const ojson& logprobs, bool include_usage, int index) {
    ojson c = {{"id", m.id},
               {"object", "text_completion"},
               {"created", m.created},
               {"model", m.model},
               {"system_fingerprint", nullptr},
               {"choices", ojson::array({{{"index", index},
                                          {"text", text},
                                          {"logprobs", logprobs},
                                          {"finish_reason", finish.empty() ? ojson(nullptr) : ojson(finish)}}})}};
    if (include_usage) c["usage"] = nullptr;
    return c;
}

ojson usage_chunk(const response_meta& m, bool chat, const ojson& usage) {
    return {{"id", m.id},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"created", m.created},
            {"model", m.model},
            {"system_fingerprint", nullptr},
            {"choices", ojson::array()},
            {"usage", usage}};
}

std::string sse(const ojson& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace tansy
