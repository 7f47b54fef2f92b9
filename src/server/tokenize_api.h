// The JSON of llama.cpp's utility endpoints on `tansy serve` (same shapes, so its clients work unchanged):
//   POST /tokenize    {"content", "add_special", "parse_special", "with_pieces"} -> {"tokens": [...]}
//   POST /detokenize  {"tokens": [...]} -> {"content": "..."}
//   GET  /props       what is being served (server.cpp fills it)
// Bad bodies are api_error 400 (openai.h), like the OpenAI endpoints' errors.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "server/openai.h"
#include "tokenizer/tokenizer.h"

namespace tansy {

struct tokenize_request {
    std::string content;
    bool add_special = false;   // accepted for llama.cpp clients; Qwen prepends no BOS, so it adds nothing
    bool parse_special = true;  // special-token text ("<|im_start|>") becomes its id, as in llama.cpp
    bool with_pieces = false;   // [{"id", "piece"}] instead of bare ids
};

tokenize_request parse_tokenize_request(const std::string& body);
// {"tokens": ids}, or with pieces: a piece is the token's text, or its byte values when they are not valid UTF-8
// on their own (part of a multi-byte character), as llama.cpp answers.
ojson tokenize_response(const tokenizer& tok, const std::vector<int32_t>& ids, bool with_pieces);

// The ids of a /detokenize body; each must be in [0, vocab) (else 400 naming the first that is not).
std::vector<int32_t> parse_detokenize_request(const std::string& body, int64_t vocab);

}  // namespace tansy
