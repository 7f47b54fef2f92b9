// POST /v1/responses (OpenAI's Responses API, issue 36) on the chat path: the request is translated into the
// chat form of completion_request (messages + tools + tool_choice + response_format), so it shares the prompt
// template, constraints, scheduler and output parser with /v1/chat/completions; only the wire format differs.
//
// Input items -> chat messages:
//   message (role user/system/developer/assistant; content a string or input_text/output_text/refusal parts;
//            input_image/input_file/input_audio are refused with 400)   -> that role's message
//   function_call {call_id, name, arguments}                            -> a tool_call of the assistant turn
//   function_call_output {call_id, output}                              -> a "tool" message
//   reasoning {content: reasoning_text, or else summary: summary_text}  -> reasoning_content of the assistant
//            turn that follows it (message or function_call); dropped when no assistant turn follows, and the
//            chat template itself keeps only the reasoning after the last user message. encrypted_content is
//            ignored (this server never makes any).
// Consecutive assistant-side items (reasoning, assistant message, function calls) form one assistant turn;
// an assistant message after a function call starts a new one. `instructions` is a system message first (and,
// as OpenAI does, is not carried over through previous_response_id).
//
// Output: a reasoning item (summary [], content [reasoning_text]) when there was reasoning, a message item
// (one output_text part) when there is content, one function_call item per call; streamed as OpenAI's events
// (response.created ... response.completed / response.incomplete), item by item in output order.
//
// previous_response_id: responses are kept in a bounded in-memory store (response_store: LRU by count and
// bytes) with their whole conversation (input items + output items); a follow-up continues it. `store: false`
// responses are not kept. GET / DELETE /v1/responses/{id} read and drop stored ones.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/openai.h"

namespace tansy {

struct stored_response {
    ojson items;     // the conversation: input items (the previous response's included) then output items
    ojson response;  // the response object as it was returned
};

// Thread-safe; least recently used entries go first when either bound is passed.
class response_store {
  public:
    explicit response_store(size_t max_entries = 256, size_t max_bytes = (size_t)64 << 20);
    void put(const std::string& id, stored_response r);
    std::optional<stored_response> get(const std::string& id);  // a hit becomes the most recently used
    bool erase(const std::string& id);
    size_t size() const;
    size_t bytes() const;

  private:
    struct entry {
        std::string id;
        stored_response r;
        size_t bytes = 0;
    };
    size_t max_entries_, max_bytes_, bytes_ = 0;
    mutable std::mutex mu_;
    std::list<entry> lru_;  // front: most recently used
    std::unordered_map<std::string, std::list<entry>::iterator> index_;
};

struct responses_request {
    completion_request chat;  // the translated request (chat form): what the server runs
    ojson items;              // the conversation's input items (previous response's, then this request's)
    // The request's settings as the response object repeats them (instructions, tools, tool_choice, text,
    // reasoning, temperature, top_p, max_output_tokens, parallel_tool_calls, previous_response_id, store,
    // metadata, truncation, user, top_logprobs, ...).
    ojson echo = ojson::object();
    bool store = true;
};

// Parses and translates a /v1/responses body; throws api_error (param named as the Responses API names it).
// previous_response_id is looked up in `store` (404 when unknown or evicted).
// An error of the chat request path (parse, schema compile), named as the Responses API names things
// (response_format -> text.format, messages -> input, ...).
api_error as_responses_error(const api_error& e);

responses_request parse_responses_request(const std::string& body, const sampling_params& defaults,
                                          response_store& store);

// Input items -> chat messages, instructions (when not empty) as a system message first. Throws api_error with
// params "input[i]...". (Exposed for tests.)
ojson responses_items_to_messages(const ojson& items, const std::string& instructions);

// OpenAI's error for a response id the store does not have.
api_error response_not_found(const std::string& id, const char* param = "");

// One request's response object and stream events. Every delta goes through add() (the non-streamed path
// discards the events), so both paths build the same output items with the same ids.
class responses_writer {
  public:
    // `store`: where the finished response is kept (nullptr: store false)
    responses_writer(responses_request r, response_meta meta, response_store* store);

    // The next parser step; `logprobs`: the step's content tokens in the Responses shape (an array; may be
    // empty). Returns the SSE events it makes.
    std::string add(const parsed_delta& d, const ojson& logprobs = ojson::array());
    // response.created + response.in_progress
    std::string begin();
    // The sequence ended: closes the open item, builds the response (status completed, or incomplete when
    // max_output_tokens cut it), stores it. finish() returns the object; finish_events() the closing events
    // with response.completed / response.incomplete.
    ojson finish(bool incomplete, int64_t input_tokens, int64_t output_tokens, int64_t reasoning_tokens);
    // Prompt tokens restored from the prefix cache (usage.input_tokens_details.cached_tokens); before finish.
    void set_cached_tokens(int64_t n) { cached_tokens_ = n; }
    std::string finish_events(bool incomplete, int64_t input_tokens, int64_t output_tokens, int64_t reasoning_tokens);
    // The sequence failed after the stream began: an error event then response.failed.
    std::string failed(const api_error& e);

    const std::string& id() const { return meta_.id; }

  private:
    struct item {
        enum kind_t { reasoning, message, call } kind = message;
        std::string id, text;  // text: the reasoning, the content, or the call's arguments
        std::string name, call_id;
        ojson logprobs = ojson::array();
        bool open = true;
        bool incomplete = false;
    };
    ojson item_json(const item& it) const;
    ojson response_json(const char* status) const;
    std::string event(const char* type, ojson data);
    void close_current(std::string& out);
    item& open_item(item::kind_t k, std::string& out, const std::string& name = "");

    responses_request req_;
    response_meta meta_;
    response_store* store_;
    std::vector<item> items_;
    std::vector<size_t> call_items_;  // parser call index -> items_ index
    int64_t seq_ = 0;                 // sequence_number of the next event
    int64_t cached_tokens_ = 0;
    ojson usage_ = nullptr, incomplete_details_ = nullptr, error_ = nullptr;
};

}  // namespace tansy
