// The OpenAI wire format: request validation (status, param, code of every error), defaults, and the exact
// shapes of responses and stream chunks. Also bearer auth.
#include <gtest/gtest.h>

#include <random>
#include <typeinfo>

#include "server/auth.h"
#include "server/openai.h"
#include "tokenizer/chat_template.h"

namespace tansy {
namespace {

sampling_params greedy() { return sampling_params{}; }

// The api_error a chat body gives (status 0 when it parses).
api_error chat_error(const std::string& body) {
    try {
        parse_chat_request(body, greedy());
    } catch (const api_error& e) {
        return e;
    }
    return api_error(0, "");
}

api_error completion_error(const std::string& body) {
    try {
        parse_completion_request(body, greedy());
    } catch (const api_error& e) {
        return e;
    }
    return api_error(0, "");
}

const std::string k_hi = R"("messages": [{"role": "user", "content": "hi"}])";

TEST(server_openai, minimal_chat_request_and_defaults) {
    completion_request r = parse_chat_request("{" + k_hi + "}", greedy());
    EXPECT_TRUE(r.chat);
    EXPECT_EQ(r.max_tokens, -1);
    EXPECT_EQ(r.sampling.temperature, 0.0f);
    EXPECT_FALSE(r.stream);
    EXPECT_TRUE(r.thinking);
    EXPECT_EQ(r.logprobs, -1);
    EXPECT_EQ(r.tool_choice, tool_choice_mode::automatic);
    EXPECT_EQ(r.messages.size(), 1u);
}

TEST(server_openai, every_field_is_read) {
    completion_request r = parse_chat_request(R"({"model": "m", )" + k_hi + R"(, "max_completion_tokens": 7,
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 42, "stop": ["a", "b"], "stream": true,
        "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 3, "n": 1, "user": "x",
        "response_format": {"type": "json_object"}, "reasoning_effort": "none", "some_future_field": {"x": 1}})",
                                              greedy());
    EXPECT_EQ(r.max_tokens, 7);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
    EXPECT_EQ(r.sampling.top_k, 20);
    EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
    EXPECT_EQ(r.sampling.seed, 42u);
    EXPECT_FLOAT_EQ(r.penalties.presence, 0.5f);
    EXPECT_FLOAT_EQ(r.penalties.frequency, -0.5f);
    EXPECT_FLOAT_EQ(r.penalties.repetition, 1.1f);
    EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "b"}));
    EXPECT_TRUE(r.stream);
    EXPECT_TRUE(r.include_usage);
    EXPECT_EQ(r.logprobs, 3);
    EXPECT_TRUE(r.json_mode);
    EXPECT_FALSE(r.thinking) << "reasoning_effort none turns thinking off";
    EXPECT_EQ(r.template_kwargs["enable_thinking"], false);
}

// Issue 36: every field is read, a documented no-op, or a 400 naming it; others are listed (and warned about).
TEST(server_openai, field_policy) {
    completion_request r = parse_chat_request("{" + k_hi + R"(, "user": "u", "metadata": {"a": "b"}, "store": false,
        "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "parallel_tool_calls": false,
        "prediction": {"type": "content", "content": "x"}, "modalities": ["text"], "some_future_field": 1,
        "other_one": null})", greedy());
    EXPECT_EQ(r.unknown_fields, (std::vector<std::string>{"some_future_field", "other_one"}));
    testing::internal::CaptureStderr();
    parse_chat_request("{" + k_hi + R"(, "field_policy_probe": 1})", greedy());
    parse_chat_request("{" + k_hi + R"(, "field_policy_probe": 2})", greedy());
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("field_policy_probe"), std::string::npos) << log;
    EXPECT_EQ(log.find("field_policy_probe"), log.rfind("field_policy_probe")) << "warned once per name: " << log;
    EXPECT_TRUE(parse_completion_request(R"({"prompt": "x", "user": "u", "metadata": {}})", greedy()).unknown_fields.empty());
    EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "messages": []})", greedy()).unknown_fields,
              (std::vector<std::string>{"messages"}));
    // refused, naming the field
    for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
             {R"("modalities": ["text", "audio"])", "modalities"},
             {R"("audio": {"voice": "alloy", "format": "wav"})", "audio"},
             {R"("web_search_options": {})", "web_search_options"},
             {R"("parallel_tool_calls": "yes")", "parallel_tool_calls"}}) {
        const api_error e = chat_error("{" + k_hi + ", " + body + "}");
        EXPECT_EQ(e.status, 400) << body;
        EXPECT_EQ(e.param, param) << body;
    }
    // reasoning_effort: none / minimal off, low / medium / high on
    for (const char* e : {"none", "minimal"})
        EXPECT_FALSE(parse_chat_request("{" + k_hi + R"(, "reasoning_effort": ")" + e + "\"}", greedy()).thinking) << e;
    for (const char* e : {"low", "medium", "high"})
        EXPECT_TRUE(parse_chat_request("{" + k_hi + R"(, "reasoning_effort": ")" + e + "\"}", greedy()).thinking) << e;
}

// Issue 36: the legacy functions / function_call fields are tools / tool_choice.
TEST(server_openai, legacy_functions_map_onto_tools) {
    const std::string fs = R"("functions": [{"name": "f", "parameters": {"type": "object"}}, {"name": "g"}])";
    completion_request r = parse_chat_request("{" + k_hi + ", " + fs + "}", greedy());
    ASSERT_TRUE(r.tools.is_array());
    ASSERT_EQ(r.tools.size(), 2u);
    EXPECT_EQ(r.tools[0]["type"], "function");
    EXPECT_EQ(r.tools[1]["function"]["name"], "g");
    EXPECT_EQ(r.tool_choice, tool_choice_mode::automatic);
    EXPECT_EQ(parse_chat_request("{" + k_hi + ", " + fs + R"(, "function_call": "none"})", greedy()).tool_choice,
              tool_choice_mode::none);
    EXPECT_EQ(parse_chat_request("{" + k_hi + ", " + fs + R"(, "function_call": "auto"})", greedy()).tool_choice,
              tool_choice_mode::automatic);
    r = parse_chat_request("{" + k_hi + ", " + fs + R"(, "function_call": {"name": "g"}})", greedy());
    EXPECT_EQ(r.tool_choice, tool_choice_mode::named);
    EXPECT_EQ(r.tool_name, "g");
    EXPECT_EQ(chat_error("{" + k_hi + ", " + fs + R"(, "function_call": {"name": "h"}})").param, "function_call");
    EXPECT_EQ(chat_error("{" + k_hi + ", " + fs + R"(, "function_call": "required"})").param, "function_call");
    EXPECT_EQ(chat_error("{" + k_hi + R"(, "functions": [{"name": ""}]})").param, "functions[0].name");
    EXPECT_EQ(chat_error("{" + k_hi + R"(, "functions": 3})").param, "functions");
    // tool names: what the Qwen tags carry and the output parser reads back as is
    for (const std::string& bad : std::vector<std::string>{"\" f \"", "\"a b\"", "\"<x>\"", "\"" + std::string(65, 'n') + "\""})
        EXPECT_EQ(chat_error("{" + k_hi + R"(, "functions": [{"name": )" + bad + "}]}").param, "functions[0].name") << bad;
    for (const std::string& good : std::vector<std::string>{"get_weather", "mcp.server:read-file", std::string(64, 'n')})
        EXPECT_NO_THROW(parse_chat_request("{" + k_hi + R"(, "functions": [{"name": ")" + good + "\"}]}", greedy())) << good;
    EXPECT_EQ(chat_error("{" + k_hi + ", " + fs + R"(, "tools": []})").param, "functions");
    EXPECT_TRUE(r.unknown_fields.empty());
}

TEST(server_openai, thinking_switches) {
    EXPECT_FALSE(parse_chat_request("{" + k_hi + R"(, "chat_template_kwargs": {"enable_thinking": false}})", greedy()).thinking);
    EXPECT_TRUE(parse_chat_request("{" + k_hi + R"(, "chat_template_kwargs": {"enable_thinking": 0}})", greedy()).thinking)
        << "only the boolean false turns thinking off, as in the template";
    EXPECT_TRUE(parse_chat_request("{" + k_hi + R"(, "reasoning_effort": "high"})", greedy()).thinking);
    EXPECT_TRUE(parse_chat_request("{" + k_hi + R"(, "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": true}})", greedy()).thinking)
        << "explicit template kwargs win over reasoning_effort";
}

TEST(server_openai, messages_in_every_allowed_form) {
    completion_request r = parse_chat_request(R"({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{\"city\": \"Paris\", \"n\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})",
                                              greedy());
    EXPECT_EQ(r.messages[0]["role"], "system") << "developer is the system turn";
    const auto& args = r.messages[2]["tool_calls"][0]["function"]["arguments"];
    ASSERT_TRUE(args.is_object()) << "JSON-string arguments are parsed for the template";
    EXPECT_EQ(args["city"], "Paris");
    EXPECT_EQ(args.begin().key(), "city") << "key order is kept";
}

TEST(server_openai, request_errors_have_status_param_and_code) {
    struct c {
        std::string body, param, code;
    };
    const std::vector<c> cases = {
        {"", "", ""},
        {"{not json", "", "invalid_json"},
        {"[1, 2]", "", ""},
        {"\"text\"", "", ""},
        {"{}", "messages", ""},
        {R"({"messages": []})", "messages", ""},
        {R"({"messages": "hi"})", "messages", ""},
        {R"({"messages": [1]})", "messages[0]", ""},
        {R"({"messages": [{"content": "hi"}]})", "messages[0].role", ""},
        {R"({"messages": [{"role": "wizard", "content": "hi"}]})", "messages[0].role", ""},
        {R"({"messages": [{"role": "user"}]})", "messages[0].content", ""},
        {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content", ""},
        {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
         "messages[0].content[0]", "unsupported_content"},
        {R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"type":
            "function", "function": {"name": "f", "arguments": "{not json"}}]}]})", "messages", "invalid_tool_call_arguments"},
        {R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"type":
            "function", "function": {"name": "f", "arguments": "[1]"}}]}]})", "messages", "invalid_tool_call_arguments"},
        {R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"type":
            "function", "function": {"name": "f", "arguments": "{\"a\": 1e999}"}}]}]})", "messages",
         "invalid_tool_call_arguments"},
        {"{" + k_hi + R"(, "n": 2})", "n", "unsupported_value"},
        {"{" + k_hi + R"(, "temperature": "hot"})", "temperature", ""},
        {"{" + k_hi + R"(, "temperature": 3})", "temperature", ""},
        {"{" + k_hi + R"(, "top_p": 0})", "top_p", ""},
        {"{" + k_hi + R"(, "max_tokens": 0})", "max_tokens", ""},
        {"{" + k_hi + R"(, "max_tokens": 1.5})", "max_tokens", ""},
        {"{" + k_hi + R"(, "max_tokens": true})", "max_tokens", ""},
        {"{" + k_hi + R"(, "stop": 3})", "stop", ""},
        {"{" + k_hi + R"(, "stop": ["a", 1]})", "stop", ""},
        {"{" + k_hi + R"(, "stream": "yes"})", "stream", ""},
        {"{" + k_hi + R"(, "tools": {}})", "tools", ""},
        {"{" + k_hi + R"(, "tools": [{"type": "function"}]})", "tools[0].function", ""},
        {"{" + k_hi + R"(, "tool_choice": "always"})", "tool_choice", ""},
        {"{" + k_hi + R"(, "tool_choice": "required"})", "tool_choice", ""},
        {"{" + k_hi + R"(, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}})", "tool_choice", ""},
        {"{" + k_hi + R"(, "response_format": {"type": "yaml"}})", "response_format", ""},
        {"{" + k_hi + R"(, "top_logprobs": 2})", "top_logprobs", ""},
        {"{" + k_hi + R"(, "logprobs": true, "top_logprobs": 21})", "top_logprobs", ""},
        {"{" + k_hi + R"(, "reasoning_effort": "extreme"})", "reasoning_effort", ""},
        {"{" + k_hi + R"(, "chat_template_kwargs": []})", "chat_template_kwargs", ""},
        {"{" + k_hi + R"(, "model": 5})", "model", ""},
    };
    for (const c& x : cases) {
        const api_error e = chat_error(x.body);
        EXPECT_EQ(e.status, 400) << x.body;
        EXPECT_EQ(e.param, x.param) << x.body << " -> " << e.what();
        if (!x.code.empty()) {
            EXPECT_EQ(e.code, x.code) << x.body;
        }
        EXPECT_FALSE(std::string(e.what()).empty());
    }
}

TEST(server_openai, invalid_utf8_is_a_clear_400) {
    const api_error e = chat_error("{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}");
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "invalid_utf8");
    const api_error s = chat_error(R"({"messages": [{"role": "user", "content": "\ud800"}]})");
    EXPECT_EQ(s.status, 400) << "a lone surrogate escape is not text";
}

TEST(server_openai, completion_requests) {
    completion_request r = parse_completion_request(R"({"prompt": "Once upon", "max_tokens": 5, "logprobs": 2})", greedy());
    EXPECT_FALSE(r.chat);
    EXPECT_EQ(r.prompt_text, "Once upon");
    EXPECT_EQ(r.max_tokens, 5);
    EXPECT_EQ(r.logprobs, 2);
    EXPECT_EQ(parse_completion_request(R"({"prompt": ["one"]})", greedy()).prompt_text, "one");
    EXPECT_EQ(parse_completion_request(R"({"prompt": "x"})", greedy()).max_tokens, 16) << "the legacy default";
    completion_request ids = parse_completion_request(R"({"prompt": [1, 2, 3]})", greedy());
    EXPECT_TRUE(ids.prompt_is_ids);
    EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
    EXPECT_EQ(completion_error("{}").param, "prompt");
    // issue 36: a list of prompts, one choice each
    completion_request many = parse_completion_request(R"({"prompt": ["a", "b", "c"]})", greedy());
    ASSERT_EQ(many.prompts.size(), 3u);
    EXPECT_EQ(many.prompts[2].text, "c");
    EXPECT_FALSE(many.prompts[1].is_ids);
    completion_request many_ids = parse_completion_request(R"({"prompt": [[1, 2], [3]]})", greedy());
    ASSERT_EQ(many_ids.prompts.size(), 2u);
    EXPECT_TRUE(many_ids.prompts[1].is_ids);
    EXPECT_EQ(many_ids.prompts[1].ids, (std::vector<int32_t>{3}));
    EXPECT_EQ(parse_completion_request(R"({"prompt": [1, 2]})", greedy()).prompts.size(), 1u);
    EXPECT_EQ(completion_error(R"({"prompt": ["a", 5]})").param, "prompt");
    EXPECT_EQ(completion_error(R"({"prompt": ["a", [1, -1]]})").param, "prompt");
    std::string lots = "[";
    for (size_t i = 0; i <= k_max_prompts; i++) lots += i ? ", \"x\"" : "\"x\"";
    EXPECT_EQ(completion_error(R"({"prompt": )" + lots + "]}").param, "prompt");
    EXPECT_EQ(completion_error(R"({"prompt": [1, -2]})").param, "prompt");
    EXPECT_EQ(completion_error(R"({"prompt": "x", "echo": true})").param, "echo");
    EXPECT_EQ(completion_error(R"({"prompt": "x", "n": 3})").param, "n");
    EXPECT_EQ(completion_error(R"({"prompt": "x", "best_of": 2})").param, "best_of");
}

TEST(server_openai, error_body_shape) {
    const ojson e = ojson::parse(error_body(400, "bad thing", "messages", "context_length_exceeded"));
    ASSERT_TRUE(e.contains("error"));
    EXPECT_EQ(e["error"]["message"], "bad thing");
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
    EXPECT_EQ(e["error"]["param"], "messages");
    EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
    const ojson a = ojson::parse(error_body(401, "no"));
    EXPECT_EQ(a["error"]["type"], "authentication_error");
    EXPECT_TRUE(a["error"]["param"].is_null());
    EXPECT_TRUE(a["error"]["code"].is_null());
}

TEST(server_openai, chat_response_and_chunks_have_openai_shape) {
    output_parser p;
    p.push("Because.\n</think>\n\n<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>");
    p.finish();
    const response_meta m{"chatcmpl-1", 1700000000, "tiny"};
    const ojson r = chat_response(m, p, {"call_a"}, "tool_calls", usage_json(10, 20, 5), nullptr);
    EXPECT_EQ(r["object"], "chat.completion");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
    const ojson& msg = r["choices"][0]["message"];
    EXPECT_EQ(msg["role"], "assistant");
    EXPECT_TRUE(msg["content"].is_null()) << "no text besides the call";
    EXPECT_EQ(msg["reasoning_content"], "Because.");
    EXPECT_EQ(msg["tool_calls"][0]["id"], "call_a");
    EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
    EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "f");
    EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], R"({"a": "x"})");
    EXPECT_EQ(r["usage"]["total_tokens"], 30);
    EXPECT_EQ(r["usage"]["completion_tokens_details"]["reasoning_tokens"], 5);

    std::vector<std::string> ids;
    parsed_delta d;
    d.tool_calls.push_back({0, "f", ""});
    d.tool_calls.push_back({0, "", "{\"a\""});
    const ojson delta = chat_delta(d, ids);
    ASSERT_EQ(ids.size(), 1u);
    EXPECT_EQ(delta["tool_calls"][0]["id"], ids[0]);
    EXPECT_EQ(delta["tool_calls"][0]["index"], 0);
    const ojson c = chat_chunk(m, delta, "", nullptr, true);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(c.contains("usage") && c["usage"].is_null());
    const ojson u = usage_chunk(m, true, usage_json(1, 2, 0));
    EXPECT_TRUE(u["choices"].empty());
    EXPECT_EQ(u["usage"]["completion_tokens"], 2);
    EXPECT_EQ(sse(ojson{{"a", 1}}), "data: {\"a\":1}\n\n");
}

// No body, however broken, may get anything but an api_error out of the parsers (the handlers answer 400
// with it; anything else would be a 500).
TEST(server_openai, mangled_bodies_only_give_api_errors) {
    const std::vector<std::string> seeds = {
        R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": [1, {\"b\": null}]}"}}]},
            {"role": "tool", "content": "ok"}], "tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object"}}}], "tool_choice": {"type": "function", "function": {"name": "f"}},
            "stop": ["x"], "max_tokens": 5, "temperature": 0.5, "logprobs": true, "top_logprobs": 2,
            "response_format": {"type": "json_object"}, "stream": true, "stream_options": {"include_usage": true}})",
        R"({"prompt": [[1, 2, 3]], "max_tokens": 3, "logprobs": 1, "stop": "a", "seed": -1})"};
    const std::vector<std::string> fragments = {"null", "[]", "{}", "-1", "1e999", "\"", "\\u0000", "\\ud800", "true",
                                                "\"role\"", ",", ":", "\xff", "[[[[", "0.5"};
    std::mt19937 rng(1234);
    int parsed = 0, refused = 0;
    for (int i = 0; i < 4000; i++) {
        std::string b = seeds[(size_t)i % seeds.size()];
        const int edits = 1 + (int)(rng() % 4);
        for (int e = 0; e < edits && !b.empty(); e++) {
            const size_t at = rng() % b.size();
            switch (rng() % 4) {
                case 0: b[at] = (char)(rng() % 256); break;
                case 1: b.erase(at, 1 + rng() % 8); break;
                case 2: b.insert(at, fragments[rng() % fragments.size()]); break;
                case 3: b.resize(at); break;
            }
        }
        for (bool chat : {true, false}) {
            try {
                if (chat) parse_chat_request(b, greedy());
                else parse_completion_request(b, greedy());
                parsed++;
            } catch (const api_error& e) {
                EXPECT_EQ(e.status, 400) << b;
                refused++;
            } catch (const std::exception& e) {
                ADD_FAILURE() << "escaped as " << typeid(e).name() << ": " << e.what() << "\nbody: " << b;
            }
        }
    }
    EXPECT_GT(refused, 1000);
    EXPECT_GT(parsed, 10);
}

// Issue 29: a body nesting 100,000 levels deep killed the server (the copy of the parsed tree recursed once per
// level). The depth is checked on the raw text before anything is parsed or copied.
TEST(server_openai, deep_nesting_is_a_400_naming_the_limit) {
    const int n = 100000;
    const std::string deep = std::string(n, '[') + std::string(n, ']');
    for (const std::string& body :
         {R"({"messages": [{"role": "user", "content": "hi", "extra": )" + deep + R"(}], "model": "m"})",
          R"({"messages": [{"role": "user", "content": "hi"}], "x": )" + deep + R"(, "temperature": 0.5})",
          R"({"chat_template_kwargs": {"k": )" + deep + R"(}, "messages": [{"role": "user", "content": "hi"}]})"}) {
        const api_error e = chat_error(body);
        EXPECT_EQ(e.status, 400);
        EXPECT_EQ(e.code, "json_too_deep");
        EXPECT_NE(std::string(e.what()).find(std::to_string(k_max_json_depth)), std::string::npos) << e.what();
    }
    const api_error c = completion_error(R"({"prompt": "hi", "logit_bias": )" + deep + "}");
    EXPECT_EQ(c.code, "json_too_deep");
    // tool-call arguments are JSON inside a JSON string: they get the same limit
    const std::string args = R"({\"a\": )" + std::string(n, '[') + std::string(n, ']') + "}";
    const api_error a = chat_error(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ")" + args + R"("}}]}]})");
    EXPECT_EQ(a.status, 400);
    EXPECT_EQ(a.code, "invalid_tool_call_arguments");
    // right at the limit is fine
    const std::string ok = std::string(k_max_json_depth - 3, '[') + std::string(k_max_json_depth - 3, ']');
    EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "hi"}], "x": )" + ok + "}").status, 0);
}

TEST(server_openai, json_depth_scan_ignores_brackets_in_strings) {
    EXPECT_FALSE(json_depth_exceeds("[[1]]", 2));
    EXPECT_TRUE(json_depth_exceeds("[[[1]]]", 2));
    EXPECT_TRUE(json_depth_exceeds("{\"a\": {\"b\": []}}", 2));
    EXPECT_FALSE(json_depth_exceeds("[\"[[[[{{{{\"]", 1));
    EXPECT_FALSE(json_depth_exceeds("[\"\\\"[[[[\"]", 1));  // an escaped quote does not end the string
    EXPECT_TRUE(json_depth_exceeds("[\"\\\\\", [[1]]]", 2));  // an escaped backslash does
    EXPECT_FALSE(json_depth_exceeds("[][][][][]", 1));
}

TEST(server_openai, logit_bias_is_parsed_and_checked) {
    const completion_request r =
        parse_chat_request("{" + k_hi + R"(, "logit_bias": {"42": 100, "7": -2.5, "0": 0}})", greedy());
    ASSERT_EQ(r.logit_bias.size(), 3u);
    EXPECT_EQ(r.logit_bias[0], (std::pair<int32_t, float>{42, 100.0f}));
    EXPECT_EQ(r.logit_bias[1], (std::pair<int32_t, float>{7, -2.5f}));
    EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "logit_bias": {"5": 1}})", greedy()).logit_bias.size(), 1u);
    EXPECT_TRUE(parse_chat_request("{" + k_hi + R"(, "logit_bias": null})", greedy()).logit_bias.empty());
    for (const char* lb : {R"([1])", R"({"42": 101})", R"({"42": -100.5})", R"({"x": 1})", R"({"-1": 1})",
                           R"({"1.5": 1})", R"({"": 1})", R"({"99999999999": 1})", R"({"42": "1"})", R"({"42": null})"}) {
        const api_error e = chat_error("{" + k_hi + R"(, "logit_bias": )" + lb + "}");
        EXPECT_EQ(e.status, 400) << lb;
        EXPECT_EQ(e.param, "logit_bias") << lb;
    }
}

TEST(server_openai, special_tokens_opt_in_is_for_completions_only) {
    EXPECT_FALSE(parse_completion_request(R"({"prompt": "x"})", greedy()).allow_special_tokens);
    EXPECT_TRUE(parse_completion_request(R"({"prompt": "x", "allow_special_tokens": true})", greedy()).allow_special_tokens);
    const api_error e = chat_error("{" + k_hi + R"(, "allow_special_tokens": true})");
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "allow_special_tokens");
    EXPECT_EQ(chat_error("{" + k_hi + R"(, "allow_special_tokens": false})").status, 0);
}

TEST(server_openai, bearer_auth) {
    EXPECT_TRUE(bearer_ok("", ""));
    EXPECT_TRUE(bearer_ok("anything", ""));
    EXPECT_TRUE(bearer_ok("Bearer sk-test", "sk-test"));
    EXPECT_TRUE(bearer_ok("bearer  sk-test ", "sk-test"));
    EXPECT_FALSE(bearer_ok("Bearer sk-tes", "sk-test"));
    EXPECT_FALSE(bearer_ok("Bearer sk-test2", "sk-test"));
    EXPECT_FALSE(bearer_ok("sk-test", "sk-test"));
    EXPECT_FALSE(bearer_ok("", "sk-test"));
    EXPECT_FALSE(bearer_ok("Basic sk-test", "sk-test"));
}

}  // namespace
}  // namespace tansy
