// Request-parsing helpers that openai.cpp (chat, completions) and responses.cpp (the Responses API) share.
// Internal to src/server.
#pragma once
#include <string>

#include "server/openai.h"

namespace tansy::openai_detail {

// A 400 that names the request parameter.
[[noreturn]] inline void bad(const std::string& param, const std::string& msg, const std::string& code = "") {
    throw api_error(400, msg, param, code);
}

// A field, or nullptr when absent or null (OpenAI treats an explicit null as "not given").
inline const ojson* field(const ojson& o, const char* k) {
    auto it = o.find(k);
    return it == o.end() || it->is_null() ? nullptr : &*it;
}

// A message's content given as parts (`where` names it): a 400 unless it is an array of objects, then
// f(part, where_part, type) for each part, type being its "type" ("" when absent or not a string).
template <class F>
void for_each_content_part(const ojson& c, const std::string& where, F&& f) {
    if (!c.is_array()) bad(where, where + " must be a string or an array of content parts, got " + c.type_name());
    for (size_t k = 0; k < c.size(); k++) {
        const ojson& part = c[k];
        const std::string w = where + "[" + std::to_string(k) + "]";
        if (!part.is_object()) bad(w, w + " must be an object");
        const ojson* type = field(part, "type");
        f(part, w, type && type->is_string() ? type->get<std::string>() : std::string());
    }
}

}  // namespace tansy::openai_detail
