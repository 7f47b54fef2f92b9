// What the HTTP worker does with a sequence's tokens: detokenise (stream_decoder), cut at stop strings (held
// back while they may still match, never emitted), and for chat split into reasoning / content / tool calls
// (output_parser). Also counts tokens the way usage reports them.
// Chat: stop strings are matched against the content only (after the parser), never against the reasoning
// or tool-call markup (issue 36); a match ends the answer there, and later tool calls are dropped.
// Completions: against the whole text.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "runtime/output_parser.h"
#include "runtime/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

// The text of an id the tokenizer does not know (a synthetic model's vocabulary can be larger than the
// tokenizer's, runtime/text_engine.h): U+FFFD, one per such token, so that every token still makes text.
inline constexpr std::string_view UNKNOWN_TOKEN_TEXT = "\xEF\xBF\xBD";
// The raw bytes of a token, or UNKNOWN_TOKEN_TEXT for an id outside the tokenizer (never throws).
std::string_view token_bytes_or_unknown(const tokenizer& tok, int32_t id);

// Cuts text at the first occurrence of any stop string, across pushes.
class stop_matcher {
  public:
    explicit stop_matcher(std::vector<std::string> stops);
    std::string push(std::string_view text);  // the text that can be shown now
    std::string flush();                      // at the end: what was held back (nothing after a match)
    bool matched() const { return matched_; }

  private:
    std::vector<std::string> stops_;
    std::string held_;
    bool matched_ = false;
};

struct text_options {
    bool chat = true;       // parse reasoning / tool calls (false: plain text, /v1/completions)
    bool thinking = false;  // the output starts inside <think>
    bool tools = false;     // parse tool calls
    nlohmann::ordered_json tool_schemas;
    std::vector<std::string> stop;
};

struct text_delta {
    parsed_delta parsed;                  // chat
    std::string text;                     // plain (completions)
    // tokens that became part of the output in this delta (chat: of the content, not reasoning or tool calls)
    std::vector<token_event> logprobs;
    bool empty() const { return parsed.empty() && text.empty() && logprobs.empty(); }
};

class completion_text {
  public:
    completion_text(const tokenizer& tok, std::vector<int32_t> eos, int32_t think_end, text_options opt);

    void push(const token_event& e, text_delta& out);  // ignores tokens after a stop string matched
    void finish(text_delta& out);

    bool stop_matched() const { return stop_.matched(); }
    int64_t completion_tokens() const { return n_tokens_; }
    int64_t reasoning_tokens() const { return n_reasoning_; }
    const output_parser& parser() const { return parser_; }
    const std::string& text() const { return text_; }  // plain mode: everything emitted
    // chat: everything emitted (the concatenated deltas; what the parser saw, cut at a stop string)
    const std::string& reasoning() const { return reasoning_; }
    const std::string& content() const { return content_; }
    const std::vector<parsed_tool_call>& tool_calls() const { return calls_; }

  private:
    void emit(const std::string& s, text_delta& out);
    void emit_parsed(parsed_delta d, text_delta& out);
    void settle_logprobs(bool content_grew, text_delta& out);

    const tokenizer& tok_;
    std::vector<int32_t> eos_;
    int32_t think_end_;
    text_options opt_;
    stream_decoder dec_;
    stop_matcher stop_;
    output_parser parser_;
    std::string text_, reasoning_, content_;
    std::vector<parsed_tool_call> calls_;
    bool in_reasoning_;
    int64_t n_tokens_ = 0, n_reasoning_ = 0;
    std::vector<token_event> held_logprobs_;  // chat: answer tokens whose text has not shown as content yet
    bool logprobs_closed_ = false;            // chat: a tool call began or a stop string matched
};

}  // namespace tansy
