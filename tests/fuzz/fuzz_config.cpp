// libFuzzer target: arbitrary bytes as config.json. Accepted or tansy::error, nothing else.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/check.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        tansy::parse_model_config(std::string_view((const char*)data, size), "fuzz");
    } catch (const tansy::error&) {
    }
    return 0;
}
