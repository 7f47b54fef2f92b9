#include "core/json_util.h"

#include "core/check.h"

namespace tansy {

nlohmann::json parse_json_object(std::string_view text, const std::string& what, const char* not_json,
                                 const char* not_object) {
    nlohmann::json root;
    try {
        root = nlohmann::json::parse(text.begin(), text.end());
    } catch (const nlohmann::json::exception& e) {
        fail("%s: %s: %s", what.c_str(), not_json, e.what());
    }
    if (!root.is_object()) fail("%s: %s", what.c_str(), not_object);
    return root;
}

}  // namespace tansy
