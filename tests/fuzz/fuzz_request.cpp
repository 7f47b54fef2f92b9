// libFuzzer target: arbitrary bytes as the body of /v1/chat/completions and /v1/completions, through the
// server's request path: parse and validate (server/openai.h) -> render the chat template with the client's
// byte ranges marked -> tokenise with those ranges as plain text. Each stage may refuse its input (api_error,
// tansy::error); anything else -- a crash, a sanitizer report, a stack overflow on deep JSON -- is a bug.
// Invariants checked: the marked rendering equals render_chat(), its client ranges are ordered and inside the
// text, and the ids are in the vocabulary (none for an empty text only).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/check.h"
#include "server/openai.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

std::unique_ptr<tansy::tokenizer> g_tok;

#define FUZZ_ASSERT(cond)                                                              \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "fuzz_request: %s failed at line %d\n", #cond, __LINE__); \
            abort();                                                                   \
        }                                                                              \
    } while (0)

void check_encoding(const std::string& text, const std::vector<tansy::byte_range>& plain) {
    const std::vector<int32_t> ids = g_tok->encode(text, std::span<const tansy::byte_range>(plain));
    for (int32_t id : ids) FUZZ_ASSERT(id >= 0 && id < g_tok->size());
    FUZZ_ASSERT(ids.empty() == text.empty());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    // the qwen3 tokenizer unpacked at configure time, else the tiny model's (same special tokens)
    for (const char* path : {TANSY_BINARY_DIR "/fixtures/tokenizers/qwen3/tokenizer.json",
                             TANSY_SOURCE_DIR "/models/tiny-chat-q4/tokenizer.json"}) {
        try {
            g_tok = std::make_unique<tansy::tokenizer>(tansy::tokenizer::load(path));
            return 0;
        } catch (const tansy::error&) {
        }
    }
    fprintf(stderr, "fuzz_request: no tokenizer found\n");
    abort();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string body((const char*)data, size);
    const tansy::sampling_params defaults;
    for (bool chat : {true, false}) {
        try {
            const tansy::completion_request r =
                chat ? tansy::parse_chat_request(body, defaults) : tansy::parse_completion_request(body, defaults);
            if (chat) {
                tansy::chat_options co;
                co.kwargs = r.template_kwargs;
                const tansy::rendered_chat rc = tansy::render_chat_marked(r.messages, r.tools, co);
                FUZZ_ASSERT(rc.text == tansy::render_chat(r.messages, r.tools, co));
                for (size_t i = 0; i < rc.client.size(); i++) {
                    FUZZ_ASSERT(rc.client[i].begin < rc.client[i].end && rc.client[i].end <= rc.text.size());
                    if (i) FUZZ_ASSERT(rc.client[i - 1].end < rc.client[i].begin);
                }
                check_encoding(rc.text, rc.client);
            } else if (!r.prompt_is_ids) {
                check_encoding(r.prompt_text, {tansy::byte_range{0, r.prompt_text.size()}});
            }
        } catch (const tansy::api_error&) {
        } catch (const tansy::error&) {
        }
    }
    return 0;
}
