// The OpenAI wire format: request bodies of /v1/chat/completions and /v1/completions parsed and validated into
// a completion_request, and responses, stream chunks, usage and errors built in OpenAI's exact shapes.
// Parsing throws api_error (status, message, param, code); the handlers turn it into the error JSON.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/output_parser.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

using ojson = nlohmann::ordered_json;

struct api_error : std::runtime_error {
    int status;
    std::string param, code, type;
    api_error(int status, const std::string& message, std::string param = "", std::string code = "", std::string type = "");
};

// {"error": {"message", "type", "param", "code"}}; type defaults from the status (invalid_request_error, ...).
std::string error_body(int status, const std::string& message, const std::string& param = "",
                       const std::string& code = "", const std::string& type = "");
std::string error_body(const api_error& e);
// JSON text that never throws (invalid UTF-8 is replaced; stream_decoder never produces it anyway).
std::string dump(const ojson& j);

enum class tool_choice_mode { automatic, none, required, named };

// A request body, parsed and validated: the generation's settings (generation_params: max_tokens -1 when absent,
// stop_ids left to the server, which adds the end-of-turn ids unless ignore_eos) and what the HTTP layer renders,
// constrains and returns.
struct completion_request : generation_params {
    bool chat = true;
    std::string model;  // as the request names it ("" when absent); the server checks it against its names
    // chat
    ojson messages;          // validated; tool-call arguments parsed into objects (ready for render_chat)
    ojson tools;             // array, or null
    ojson template_kwargs = ojson::object();
    bool thinking = true;    // the rendered prompt opens <think> (enable_thinking not false)
    tool_choice_mode tool_choice = tool_choice_mode::automatic;
    std::string tool_name;   // tool_choice named
    bool json_mode = false;  // response_format json_object / json_schema
    // response_format json_schema: its "schema" (null for json_object, or json_schema without one) and "strict"
    ojson json_schema;
    bool json_schema_strict = false;
    bool parallel_tool_calls = true;  // false: at most one tool call
    // completions
    std::string prompt_text;
    std::vector<int32_t> prompt_ids;  // a prompt given as token ids
    bool prompt_is_ids = false;
    // every prompt of the request (the first is also in prompt_text / prompt_ids above): "prompt" may be a
    // list of strings or of token-id lists; each is its own sequence and its own choice (index in order)
    struct prompt_item {
        std::string text;
        std::vector<int32_t> ids;
        bool is_ids = false;
    };
    std::vector<prompt_item> prompts;
    // Trusted raw prompts: the text of special and added tokens in the prompt becomes those tokens
    // ("<|im_start|>" -> its id). Off by default: client text is tokenised as plain text (issue 29).
    bool allow_special_tokens = false;
    // both (besides generation_params; logit_bias ids are checked against the vocabulary by the server)
    std::vector<std::string> stop;
    // vLLM's extension: the end-of-turn tokens do not end the sequence (it runs to max_tokens; they are still
    // left out of the text). For benchmarks that need every completion to have the same length.
    bool ignore_eos = false;
    bool stream = false, include_usage = false;
    // Fields the server does not know, ignored (warned about on stderr once per name). The documented
    // no-ops (user, metadata, store, service_tier, prompt_cache_key, safety_identifier, parallel_tool_calls,
    // prediction) are not listed here.
    std::vector<std::string> unknown_fields;
};

// A request body as a JSON object (size, depth and UTF-8 checked); api_error 400 otherwise.
ojson parse_request_body(const std::string& body);

// `defaults`: the model's sampling defaults (generation_config.json), used for fields the request omits.
completion_request parse_chat_request(const std::string& body, const sampling_params& defaults);
completion_request parse_completion_request(const std::string& body, const sampling_params& defaults);

// The model's recommended sampling (generation_config.json: do_sample, temperature, top_p, top_k, min_p);
// greedy when it says do_sample false or has no file.
sampling_params load_sampling_defaults(const std::string& model_dir);

// ---- responses

struct response_meta {
    std::string id;  // chatcmpl-... / cmpl-...
    int64_t created = 0;
    std::string model;
};

std::string new_id(const char* prefix);  // prefix + 24 random hex digits

// prompt_tokens_details.cached_tokens: prompt tokens restored from the prefix cache (OpenAI's field).
ojson usage_json(int64_t prompt, int64_t completion, int64_t reasoning, int64_t cached = 0);

// Chat: the "logprobs" object {"content": [...]} for these tokens.
ojson chat_logprobs(const tokenizer& tok, const std::vector<token_event>& tokens);
// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, text_offset counted from `offset0`.
ojson completion_logprobs(const tokenizer& tok, const std::vector<token_event>& tokens, int64_t offset0);

// A finished chat completion.
ojson chat_response(const response_meta& m, const output_parser& p, const std::vector<std::string>& call_ids,
                    const std::string& finish, const ojson& usage, const ojson& logprobs);
ojson chat_response(const response_meta& m, const std::string& reasoning, const std::string& content,
                    const std::vector<parsed_tool_call>& calls, const std::vector<std::string>& call_ids,
                    const std::string& finish, const ojson& usage, const ojson& logprobs);
// One chat.completion.chunk: `delta` as given; finish null when empty; usage included when include_usage.
ojson chat_chunk(const response_meta& m, const ojson& delta, const std::string& finish, const ojson& logprobs,
                 bool include_usage);
// The delta of a parser step (reasoning_content, content, tool_calls with ids for new calls).
ojson chat_delta(const parsed_delta& d, std::vector<std::string>& call_ids);

ojson completion_response(const response_meta& m, const std::string& text, const std::string& finish,
                          const ojson& usage, const ojson& logprobs);
ojson completion_chunk(const response_meta& m, const std::string& text, const std::string& finish,
                       const ojson& logprobs, bool include_usage, int index = 0);
// One choice of a text completion, and a response with several (one per prompt).
ojson completion_choice(int index, const std::string& text, const std::string& finish, const ojson& logprobs);
ojson completion_response(const response_meta& m, const ojson& choices, const ojson& usage);
constexpr size_t k_max_prompts = 64;  // prompts in one /v1/completions request
// The final usage-only chunk of a stream (choices empty).
ojson usage_chunk(const response_meta& m, bool chat, const ojson& usage);

std::string sse(const ojson& j);  // "data: {json}\n\n"

}  // namespace tansy
