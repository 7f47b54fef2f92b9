#include "server/tokenize_api.h"

#include "core/check.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/utf8.h"

namespace tansy {

namespace {

ojson parse_object(const std::string& body) {
    if (body.empty()) throw api_error(400, "the request body is empty; expected a JSON object");
    if (json_depth_exceeds(body))
        throw api_error(400, strprintf("the request body nests JSON deeper than the limit of %d levels", k_max_json_depth),
                        "", "json_too_deep");
    ojson j = ojson::parse(body, nullptr, false);
    if (j.is_discarded()) {
        if (utf8_find_invalid(body) >= 0) throw api_error(400, "the request body is not valid UTF-8", "", "invalid_utf8");
        throw api_error(400, "the request body is not valid JSON", "", "invalid_json");
    }
    if (!j.is_object()) throw api_error(400, std::string("the request body must be a JSON object, got ") + j.type_name());
    return j;
}

bool flag(const ojson& j, const char* key, bool dflt) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) throw api_error(400, strprintf("'%s' must be a boolean", key), key);
    return it->get<bool>();
}

}  // namespace

tokenize_request parse_tokenize_request(const std::string& body) {
    const ojson j = parse_object(body);
    tokenize_request r;
    auto it = j.find("content");
    if (it == j.end() || !it->is_string()) throw api_error(400, "'content' must be a string", "content");
    r.content = it->get<std::string>();
    r.add_special = flag(j, "add_special", false);
    r.parse_special = flag(j, "parse_special", true);
    r.with_pieces = flag(j, "with_pieces", false);
    return r;
}

ojson tokenize_response(const tokenizer& tok, const std::vector<int32_t>& ids, bool with_pieces) {
    ojson tokens = ojson::array();
    for (int32_t id : ids) {
        if (!with_pieces) {
            tokens.push_back(id);
            continue;
        }
        const std::string_view b = tok.token_bytes(id);
        ojson piece;
        if (utf8_find_invalid(b) < 0) {
            piece = std::string(b);
        } else {
            piece = ojson::array();
            for (unsigned char c : b) piece.push_back((int)c);
        }
        tokens.push_back(ojson{{"id", id}, {"piece", piece}});
    }
    return ojson{{"tokens", tokens}};
}

std::vector<int32_t> parse_detokenize_request(const std::string& body, int64_t vocab) {
    const ojson j = parse_object(body);
    auto it = j.find("tokens");
    if (it == j.end() || !it->is_array()) throw api_error(400, "'tokens' must be an array of token ids", "tokens");
    std::vector<int32_t> ids;
    ids.reserve(it->size());
    for (const ojson& t : *it) {
        if (!t.is_number_integer())
            throw api_error(400, strprintf("'tokens' must hold integers, got %s", t.type_name()), "tokens");
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= vocab)
            throw api_error(400, strprintf("token id %lld is outside the vocabulary of %lld", (long long)id,
                                           (long long)vocab), "tokens");
        ids.push_back((int32_t)id);
    }
    return ids;
}

}  // namespace tansy
