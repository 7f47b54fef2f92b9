// What chat_template.cpp and py_semantics.cpp share: UTF-8 decoding as the template's Python string methods see it.
// Internal to src/tokenizer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tansy::chat_template_detail {

// Lenient: an invalid byte counts as one non-space, non-printable unit, so nothing crashes.
struct code_point {
    int32_t cp;  // -1 for an invalid byte
    size_t len;  // bytes
};

code_point decode_at(std::string_view s, size_t i);

}  // namespace tansy::chat_template_detail
