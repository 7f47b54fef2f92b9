#include "server/auth.h"

#include <cctype>

namespace tansy {

bool bearer_ok(std::string_view h, const std::string& key) {
    if (key.empty()) return true;
    size_t i = 0;
    while (i < h.size() && h[i] == ' ') i++;
    static constexpr std::string_view scheme = "bearer ";
    if (h.size() - i < scheme.size()) return false;
    for (size_t k = 0; k < scheme.size(); k++)
        if (std::tolower((unsigned char)h[i + k]) != scheme[k]) return false;
    i += scheme.size();
    while (i < h.size() && h[i] == ' ') i++;
    std::string_view token = h.substr(i);
    while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
    unsigned diff = token.size() != key.size();
    for (size_t k = 0; k < key.size(); k++) diff |= (unsigned char)key[k] ^ (unsigned char)(k < token.size() ? token[k] : 0);
    return diff == 0;
}

}  // namespace tansy
