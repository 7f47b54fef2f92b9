// POST /v1/responses: the translation of Responses requests into chat requests (items, tools, tool_choice,
// text.format, reasoning), its errors (status, param), the response store, and the response object and stream
// events the writer builds.
#include <gtest/gtest.h>

#include "server/responses.h"

namespace tansy {
namespace {

sampling_params greedy() { return sampling_params{}; }

responses_request parse(const std::string& body, response_store& store) {
    return parse_responses_request(body, greedy(), store);
}

responses_request parse(const std::string& body) {
    response_store store;
    return parse(body, store);
}

api_error error_of(const std::string& body, response_store* store = nullptr) {
    response_store empty;
    try {
        parse_responses_request(body, greedy(), store ? *store : empty);
    } catch (const api_error& e) {
        return e;
    }
    return api_error(0, "");
}

// The events of an SSE text: their types in order; checks event/data agree and sequence numbers count up.
std::vector<std::string> event_types(const std::string& sse, int64_t* next_seq) {
    std::vector<std::string> out;
    size_t p = 0;
    while ((p = sse.find("event: ", p)) != std::string::npos) {
        const size_t e = sse.find('\n', p);
        const std::string type = sse.substr(p + 7, e - p - 7);
        EXPECT_EQ(sse.compare(e + 1, 6, "data: "), 0);
        const size_t end = sse.find("\n\n", e);
        const ojson data = ojson::parse(sse.substr(e + 7, end - e - 7));
        EXPECT_EQ(data["type"], type);
        EXPECT_EQ(data["sequence_number"].get<int64_t>(), (*next_seq)++);
        out.push_back(type);
        p = end;
    }
    return out;
}

TEST(server_responses, string_input_and_instructions) {
    responses_request r = parse(R"({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 9,
                                    "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": true, "metadata": {"a": "b"},
                                    "store": false, "truncation": "disabled", "user": "u", "parallel_tool_calls": false,
                                    "some_future_field": 1})");
    const ojson& m = r.chat.messages;
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[0]["role"], "system");
    EXPECT_EQ(m[0]["content"], "be brief");
    EXPECT_EQ(m[1]["role"], "user");
    EXPECT_EQ(m[1]["content"], "hi");
    EXPECT_TRUE(r.chat.chat);
    EXPECT_EQ(r.chat.model, "m");
    EXPECT_EQ(r.chat.max_tokens, 9);
    EXPECT_FLOAT_EQ(r.chat.sampling.temperature, 0.5f);
    EXPECT_EQ(r.chat.sampling.seed, 3u);
    EXPECT_TRUE(r.chat.stream);
    EXPECT_FALSE(r.store);
    EXPECT_EQ(r.chat.unknown_fields, std::vector<std::string>{"some_future_field"});
    // the settings the response repeats
    EXPECT_EQ(r.echo["instructions"], "be brief");
    EXPECT_EQ(r.echo["max_output_tokens"], 9);
    EXPECT_EQ(r.echo["metadata"]["a"], "b");
    EXPECT_EQ(r.echo["parallel_tool_calls"], false);
    EXPECT_EQ(r.echo["tool_choice"], "auto");
    EXPECT_EQ(r.echo["tools"], ojson::array());
    EXPECT_EQ(r.echo["text"]["format"]["type"], "text");
    EXPECT_EQ(r.echo["user"], "u");
    // the conversation kept for previous_response_id: the input as an item, not the instructions
    ASSERT_EQ(r.items.size(), 1u);
    EXPECT_EQ(r.items[0]["type"], "message");
}

TEST(server_responses, items_become_chat_messages) {
    const ojson items = ojson::parse(R"([
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped: no assistant turn follows"}]},
        {"role": "user", "content": "next"}])");
    const ojson m = responses_items_to_messages(items, "");
    ASSERT_EQ(m.size(), 6u) << m.dump();
    EXPECT_EQ(m[0], ojson::parse(R"({"role": "system", "content": "sys"})"));
    EXPECT_EQ(m[1]["content"], "ab");
    EXPECT_EQ(m[2]["role"], "assistant");
    EXPECT_EQ(m[2]["content"], "let me look");
    EXPECT_EQ(m[2]["reasoning_content"], "think");
    ASSERT_EQ(m[2]["tool_calls"].size(), 2u);
    EXPECT_EQ(m[2]["tool_calls"][0]["id"], "call_1");
    EXPECT_EQ(m[2]["tool_calls"][0]["function"]["name"], "f");
    EXPECT_EQ(m[2]["tool_calls"][0]["function"]["arguments"], "{\"x\": 1}");
    EXPECT_EQ(m[3], ojson::parse(R"({"role": "tool", "tool_call_id": "call_1", "content": "one"})"));
    EXPECT_EQ(m[4]["content"], "two");
    EXPECT_EQ(m[5], ojson::parse(R"({"role": "user", "content": "next"})"));
    // through the whole parser: the arguments become objects for the template, as chat's do
    response_store store;
    responses_request r = parse(R"({"input": )" + items.dump() + "}", store);
    EXPECT_TRUE(r.chat.messages[2]["tool_calls"][0]["function"]["arguments"].is_object());
}

TEST(server_responses, tools_tool_choice_format_reasoning) {
    const std::string tools = R"("tools": [{"type": "function", "name": "f", "description": "d", "strict": true,
                                            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}])";
    responses_request r = parse(R"({"input": "hi", )" + tools + R"(, "tool_choice": {"type": "function", "name": "f"},
                                    "reasoning": {"effort": "none", "summary": "auto"}})");
    ASSERT_TRUE(r.chat.tools.is_array());
    EXPECT_EQ(r.chat.tools[0]["function"]["name"], "f");
    EXPECT_EQ(r.chat.tools[0]["function"]["parameters"]["properties"]["x"]["type"], "integer");
    EXPECT_EQ(r.chat.tool_choice, tool_choice_mode::named);
    EXPECT_EQ(r.chat.tool_name, "f");
    EXPECT_FALSE(r.chat.thinking);
    EXPECT_EQ(r.echo["tools"][0]["name"], "f");  // repeated in the Responses shape
    EXPECT_EQ(r.echo["tool_choice"]["name"], "f");
    EXPECT_EQ(r.echo["reasoning"]["effort"], "none");
    EXPECT_EQ(r.echo["reasoning"]["summary"], "auto");
    EXPECT_EQ(parse(R"({"input": "hi", )" + tools + R"(, "tool_choice": "required"})").chat.tool_choice,
              tool_choice_mode::required);
    EXPECT_TRUE(parse(R"({"input": "hi", "reasoning": {"effort": "high"}})").chat.thinking);
    EXPECT_TRUE(parse(R"({"input": "hi", "text": {"format": {"type": "json_object"}}})").chat.json_mode);
    responses_request js = parse(R"({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p",
        "schema": {"type": "object"}, "strict": true}, "verbosity": "low"}})");
    EXPECT_TRUE(js.chat.json_mode);
    EXPECT_EQ(js.echo["text"]["format"]["name"], "p");
    EXPECT_EQ(js.echo["text"]["verbosity"], "low");
    EXPECT_FALSE(parse(R"({"input": "hi", "text": {"format": {"type": "text"}}})").chat.json_mode);
    // explicit nulls are "not given", as in chat
    responses_request nulls = parse(R"({"input": "hi", "parallel_tool_calls": null, "truncation": null, "tools": null,
        "tool_choice": null, "text": null, "reasoning": null, "metadata": null, "user": null, "store": null,
        "instructions": null, "previous_response_id": null, "max_output_tokens": null, "temperature": null})");
    EXPECT_EQ(nulls.echo["parallel_tool_calls"], true);
    EXPECT_EQ(nulls.echo["truncation"], "disabled");
    EXPECT_TRUE(nulls.store);
    EXPECT_EQ(error_of(R"({"input": "hi", "text": {"format": {"type": "json_schema", "name": 3, "schema": {}}}})").param,
              "text.format.name");
    responses_request lp = parse(R"({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2})");
    EXPECT_EQ(lp.chat.logprobs, 2);
    EXPECT_EQ(parse(R"({"input": "hi", "include": ["reasoning.encrypted_content"]})").chat.logprobs, -1);
}

TEST(server_responses, errors_name_the_param) {
    struct tc {
        const char* body;
        int status;
        const char* param;
        const char* code;
    };
    const tc cases[] = {
        {R"({})", 400, "input", ""},
        {R"({"input": 3})", 400, "input", ""},
        {R"({"input": []})", 400, "input", ""},
        {R"({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})", 400,
         "input[0].content[0]", "unsupported_content"},
        {R"({"input": [{"type": "web_search_call"}]})", 400, "input[0].type", "unsupported_value"},
        {R"({"input": [{"type": "item_reference", "id": "x"}]})", 400, "input[0].type", "unsupported_value"},
        {R"({"input": [{"role": "robot", "content": "x"}]})", 400, "input[0].role", ""},
        {R"({"input": [{"role": "user"}]})", 400, "input[0].content", ""},
        {R"({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]})", 400, "input[0].call_id", ""},
        {R"({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]})", 400, "input[0].arguments", ""},
        {R"({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]})", 400, "input",
         "invalid_tool_call_arguments"},
        {R"({"input": "hi", "tools": [{"type": "web_search"}]})", 400, "tools[0].type", "unsupported_value"},
        {R"({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]})", 400, "tools[0].name", ""},
        {R"({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]})", 400, "tools[0].parameters", ""},
        {R"({"input": "hi", "tool_choice": {"type": "web_search_preview"}})", 400, "tool_choice", "unsupported_value"},
        {R"({"input": "hi", "tool_choice": {"type": "function", "name": "g"}})", 400, "tool_choice", ""},
        {R"({"input": "hi", "tool_choice": "required"})", 400, "tool_choice", ""},
        {R"({"input": "hi", "text": {"format": {"type": "xml"}}})", 400, "text.format.type", ""},
        {R"({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}})", 400, "text.format.schema", ""},
        {R"({"input": "hi", "reasoning": {"effort": "extreme"}})", 400, "reasoning.effort", ""},
        {R"({"input": "hi", "max_output_tokens": 0})", 400, "max_output_tokens", ""},
        {R"({"input": "hi", "temperature": 3})", 400, "temperature", ""},
        {R"({"input": "hi", "background": true})", 400, "background", "unsupported_value"},
        {R"({"input": "hi", "conversation": "conv_1"})", 400, "conversation", "unsupported_value"},
        {R"({"input": "hi", "truncation": "sometimes"})", 400, "truncation", ""},
        {R"({"input": "hi", "store": "yes"})", 400, "store", ""},
        {R"({"input": "hi", "previous_response_id": "resp_gone"})", 404, "previous_response_id", ""},
    };
    for (const tc& c : cases) {
        const api_error e = error_of(c.body);
        EXPECT_EQ(e.status, c.status) << c.body << ": " << e.what();
        EXPECT_EQ(e.param, c.param) << c.body << ": " << e.what();
        EXPECT_EQ(e.code, c.code) << c.body << ": " << e.what();
    }
    EXPECT_STREQ(error_of(R"({"input": "hi", "previous_response_id": "resp_gone"})").what(),
                 "Previous response with id 'resp_gone' not found.");
    // the chat parser's words are the Responses API's
    EXPECT_NE(std::string(error_of(R"({"input": "hi", "max_output_tokens": 0})").what()).find("max_output_tokens"),
              std::string::npos);
}

TEST(server_responses, store_is_bounded_lru) {
    response_store s(2, 1 << 20);
    s.put("a", {ojson::array(), ojson::object()});
    s.put("b", {ojson::array(), ojson::object()});
    EXPECT_TRUE(s.get("a"));  // a is now the most recently used: b goes first
    s.put("c", {ojson::array(), ojson::object()});
    EXPECT_EQ(s.size(), 2u);
    EXPECT_FALSE(s.get("b"));
    EXPECT_TRUE(s.get("a") && s.get("c"));
    EXPECT_TRUE(s.erase("a"));
    EXPECT_FALSE(s.erase("a"));
    // the byte budget: an entry larger than the budget is not kept, others are evicted to fit
    response_store small(100, 300);
    small.put("x", {ojson::array({std::string(200, 'x')}), ojson::object()});
    EXPECT_EQ(small.size(), 1u);
    small.put("y", {ojson::array({std::string(200, 'y')}), ojson::object()});
    EXPECT_EQ(small.size(), 1u);
    EXPECT_TRUE(small.get("y"));
    small.put("z", {ojson::array({std::string(400, 'z')}), ojson::object()});
    EXPECT_FALSE(small.get("z"));
    EXPECT_LE(small.bytes(), 300u);
}

parsed_delta reasoning_delta(const std::string& s) {
    parsed_delta d;
    d.reasoning = s;
    return d;
}

parsed_delta content_delta(const std::string& s) {
    parsed_delta d;
    d.content = s;
    return d;
}

parsed_delta call_delta(int index, const std::string& name, const std::string& args) {
    parsed_delta d;
    d.tool_calls.push_back(tool_call_delta{index, name, args});
    return d;
}

TEST(server_responses, stream_events_and_response_object) {
    response_store store;
    responses_request r = parse(R"({"input": "hi", "tools": [{"type": "function", "name": "f"}]})", store);
    responses_writer w(std::move(r), response_meta{"resp_1", 100, "m"}, &store);
    int64_t seq = 0;
    EXPECT_EQ(event_types(w.begin(), &seq), (std::vector<std::string>{"response.created", "response.in_progress"}));
    EXPECT_EQ(event_types(w.add(reasoning_delta("th")), &seq),
              (std::vector<std::string>{"response.output_item.added", "response.content_part.added",
                                        "response.reasoning_text.delta"}));
    EXPECT_EQ(event_types(w.add(reasoning_delta("ink")), &seq), std::vector<std::string>{"response.reasoning_text.delta"});
    EXPECT_EQ(event_types(w.add(content_delta("Hel")), &seq),
              (std::vector<std::string>{"response.reasoning_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta"}));
    EXPECT_EQ(event_types(w.add(content_delta("lo")), &seq), std::vector<std::string>{"response.output_text.delta"});
    EXPECT_EQ(event_types(w.add(call_delta(0, "f", "{\"a\"")), &seq),
              (std::vector<std::string>{"response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.output_item.added",
                                        "response.function_call_arguments.delta"}));
    EXPECT_EQ(event_types(w.add(call_delta(0, "", ": 1}")), &seq),
              std::vector<std::string>{"response.function_call_arguments.delta"});
    const std::string end = w.finish_events(false, 5, 7, 2);
    EXPECT_EQ(event_types(end, &seq),
              (std::vector<std::string>{"response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"}));
    const size_t d = end.rfind("data: ");
    const ojson resp = ojson::parse(end.substr(d + 6))["response"];
    EXPECT_EQ(resp["id"], "resp_1");
    EXPECT_EQ(resp["object"], "response");
    EXPECT_EQ(resp["status"], "completed");
    EXPECT_TRUE(resp["incomplete_details"].is_null());
    EXPECT_TRUE(resp["error"].is_null());
    const ojson& out = resp["output"];
    ASSERT_EQ(out.size(), 3u);
    EXPECT_EQ(out[0]["type"], "reasoning");
    EXPECT_EQ(out[0]["summary"], ojson::array());
    EXPECT_EQ(out[0]["content"][0], ojson::parse(R"({"type": "reasoning_text", "text": "think"})"));
    EXPECT_EQ(out[1]["type"], "message");
    EXPECT_EQ(out[1]["role"], "assistant");
    EXPECT_EQ(out[1]["content"][0]["type"], "output_text");
    EXPECT_EQ(out[1]["content"][0]["text"], "Hello");
    EXPECT_EQ(out[2]["type"], "function_call");
    EXPECT_EQ(out[2]["name"], "f");
    EXPECT_EQ(out[2]["arguments"], "{\"a\": 1}");
    EXPECT_EQ(out[2]["status"], "completed");
    EXPECT_EQ(out[2]["call_id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(out[2]["id"].get<std::string>().rfind("fc_", 0), 0u);
    EXPECT_EQ(resp["usage"]["input_tokens"], 5);
    EXPECT_EQ(resp["usage"]["output_tokens"], 7);
    EXPECT_EQ(resp["usage"]["total_tokens"], 12);
    EXPECT_EQ(resp["usage"]["output_tokens_details"]["reasoning_tokens"], 2);
    EXPECT_EQ(resp["usage"]["input_tokens_details"]["cached_tokens"], 0);
    EXPECT_EQ(resp["tools"][0]["name"], "f");

    // stored: a follow-up continues the conversation (input, then the output items, then the new input)
    ASSERT_TRUE(store.get("resp_1"));
    const std::string call_id = out[2]["call_id"];
    responses_request next = parse(R"({"previous_response_id": "resp_1", "input": [{"type": "function_call_output",
        "call_id": ")" + call_id + R"(", "output": "42"}]})", store);
    const ojson& m = next.chat.messages;
    ASSERT_EQ(m.size(), 3u) << m.dump();
    EXPECT_EQ(m[0]["content"], "hi");
    EXPECT_EQ(m[1]["content"], "Hello");
    EXPECT_EQ(m[1]["reasoning_content"], "think");
    EXPECT_EQ(m[1]["tool_calls"][0]["id"], call_id);
    EXPECT_EQ(m[2]["role"], "tool");
    EXPECT_EQ(next.echo["previous_response_id"], "resp_1");
    EXPECT_EQ(next.items.size(), 5u);
    // an error in the new input is named by its index in this request
    EXPECT_EQ(error_of(R"({"previous_response_id": "resp_1", "input": [{"type": "nope"}]})", &store).param, "input[0].type");
}

TEST(server_responses, incomplete_and_failed) {
    response_store store;
    responses_writer w(parse(R"({"input": "hi", "max_output_tokens": 3})"), response_meta{"resp_2", 1, "m"}, &store);
    w.add(content_delta("abc"));
    const ojson r = w.finish(true, 1, 3, 0);
    EXPECT_EQ(r["status"], "incomplete");
    EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
    EXPECT_EQ(r["output"][0]["status"], "incomplete");
    EXPECT_EQ(r["output"][0]["content"][0]["text"], "abc");
    EXPECT_TRUE(store.get("resp_2"));

    responses_writer nostore(parse(R"({"input": "hi", "store": false})"), response_meta{"resp_3", 1, "m"}, nullptr);
    nostore.finish(false, 1, 1, 0);

    responses_writer f(parse(R"({"input": "hi"})"), response_meta{"resp_4", 1, "m"}, &store);
    int64_t seq = 0;
    event_types(f.begin(), &seq);
    event_types(f.add(content_delta("x")), &seq);
    EXPECT_EQ(event_types(f.failed(api_error(500, "generation failed: boom")), &seq),
              (std::vector<std::string>{"error", "response.failed"}));
    EXPECT_FALSE(store.get("resp_4"));
}

}  // namespace
}  // namespace tansy
