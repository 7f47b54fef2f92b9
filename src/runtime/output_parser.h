// Splits generated text, as it streams, into reasoning (before </think>), content, and tool calls in the Qwen
// XML form (MODEL.md §12.2):
//
//   <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>
//
// Each tool call becomes {name, arguments}, arguments being the JSON object text OpenAI clients expect. Values
// are typed by the tool's JSON schema when it is given (integer, number, boolean, object, array, null; as
// vLLM's qwen3_coder parser does), strings otherwise; one newline after <parameter=..> and one before
// </parameter> are part of the format, not of the value. String values stream as they are generated.
//
// Robust to: text before a call (content), several calls, multi-line values, a <tool_call> inside reasoning
// (reasoning text), a <tool_call> not followed by <function=...> (content text), missing </parameter> or
// </function> before the next tag, and output that ends anywhere (finish() closes a call whose name is known,
// with the values seen so far, so its arguments are still valid JSON; a call cut before its name is content).
//
// Text that may still turn into a tag, trailing newlines of reasoning and whitespace before a possible
// <tool_call> are held back until the next push() or finish() decides, so the streamed deltas concatenate to
// exactly what the non-streamed accessors return. Used by `tansy serve` and usable by `tansy run --chat`.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tansy {

struct output_parser_options {
    bool reasoning = true;  // the output starts inside <think> (the prompt ended with "<think>\n")
    bool tools = true;      // parse <tool_call> blocks in the content (false: they stay content text)
    // OpenAI "tools" array (or null): gives the JSON schema type of each function's parameters.
    nlohmann::ordered_json tool_schemas;
};

// One piece of a tool call, OpenAI streaming style: the first piece of call `index` carries its name, later
// pieces extend its arguments text.
struct tool_call_delta {
    int index = 0;
    std::string name;       // non-empty only on the call's first piece
    std::string arguments;  // text to append to the call's arguments
};

struct parsed_delta {
    std::string reasoning, content;
    std::vector<tool_call_delta> tool_calls;
    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct parsed_tool_call {
    std::string name;
    std::string arguments;  // a JSON object, e.g. {"name": "heapq.heappush"}
    bool complete = false;  // false: the output ended inside the call
};

// The type the parser reads a tool parameter as, from its property schema: "type" (lowercased), or the first
// non-null of a list; "" without one. Values of string types (see tool_param_is_string) stay raw text.
std::string tool_param_type(const nlohmann::ordered_json& prop);
bool tool_param_is_string(const std::string& type);

class output_parser {
  public:
    explicit output_parser(output_parser_options opt = {});

    parsed_delta push(std::string_view text);
    // The output has ended: releases what was held back and closes an unfinished call.
    parsed_delta finish();

    // Everything so far (after finish(): the whole result).
    const std::string& reasoning() const { return reasoning_; }
    const std::string& content() const { return content_; }
    const std::vector<parsed_tool_call>& tool_calls() const { return calls_; }
    bool in_reasoning() const { return state_ == state::reasoning; }

  private:
    enum class state { reasoning, content_start, content, tool_header, tool_body, param_value, after_call };

    bool step(parsed_delta& d, bool final);  // consumes what it can from buf_; false when it needs more text
    void emit_reasoning(parsed_delta& d, std::string_view s);
    void emit_content(parsed_delta& d, std::string_view s);
    void emit_args(parsed_delta& d, const std::string& s, const std::string& name = "");
    void open_param(parsed_delta& d, const std::string& name);
    void close_param(parsed_delta& d, std::string value_tail);
    void close_call(parsed_delta& d, bool complete);
    std::string param_type(const std::string& param) const;

    output_parser_options opt_;
    std::map<std::string, std::map<std::string, std::string>> types_;  // function -> parameter -> schema type
    state state_;
    bool at_start_ = true;     // nothing of the reasoning seen yet (a leading "<think>" is dropped)
    std::string buf_;          // text not yet consumed
    std::string raw_call_;     // text of the call being parsed (given back as content if it is not a call)
    std::string reasoning_, content_;
    std::vector<parsed_tool_call> calls_;
    // the parameter being read
    std::string param_type_, param_value_;
    bool param_started_ = false;  // its first character has been seen (the format's leading newline is skipped)
    int n_params_ = 0;            // parameters written into the current call's arguments
};

}  // namespace tansy
