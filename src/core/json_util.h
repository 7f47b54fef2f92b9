// JSON text read from a file (config.json, tokenizer.json, a safetensors header), parsed with errors that name it.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tansy {

// Parses text that must hold one JSON object; otherwise throws tansy::error "<what>: <not_json>: <the parser's
// message>" or "<what>: <not_object>".
nlohmann::json parse_json_object(std::string_view text, const std::string& what, const char* not_json,
                                 const char* not_object);

}  // namespace tansy
