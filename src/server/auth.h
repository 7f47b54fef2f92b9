// Bearer-token check for --api-key (OpenAI clients send "Authorization: Bearer KEY").
#pragma once
#include <string>
#include <string_view>

namespace tansy {

// True when no key is configured, or the header carries exactly that key. The comparison takes the same time
// whatever the mismatch, so the key cannot be guessed byte by byte from response times.
bool bearer_ok(std::string_view authorization_header, const std::string& api_key);

}  // namespace tansy
