#include "core/dtype.h"

#include "core/check.h"

namespace tansy {

namespace {
struct dtype_info {
    dtype t;
    const char* name;
    size_t size;
};
constexpr dtype_info k_dtypes[] = {
    {dtype::f32, "F32", 4},     {dtype::f16, "F16", 2},       {dtype::bf16, "BF16", 2},  {dtype::u32, "U32", 4},
    {dtype::i32, "I32", 4},     {dtype::i64, "I64", 8},       {dtype::u8, "U8", 1},      {dtype::i8, "I8", 1},
    {dtype::u16, "U16", 2},     {dtype::i16, "I16", 2},       {dtype::u64, "U64", 8},    {dtype::f64, "F64", 8},
    {dtype::boolean, "BOOL", 1}, {dtype::f8_e4m3, "F8_E4M3", 1}, {dtype::f8_e5m2, "F8_E5M2", 1},
};
}  // namespace

size_t dtype_size(dtype t) {
    for (const auto& d : k_dtypes)
        if (d.t == t) return d.size;
    TANSY_ABORT("unknown dtype %d", (int)t);
}

const char* dtype_name(dtype t) {
    for (const auto& d : k_dtypes)
        if (d.t == t) return d.name;
    TANSY_ABORT("unknown dtype %d", (int)t);
}

bool dtype_from_name(const char* s, size_t n, dtype* out) {
    for (const auto& d : k_dtypes) {
        if (strlen(d.name) == n && memcmp(d.name, s, n) == 0) {
            *out = d.t;
            return true;
        }
    }
    return false;
}

}  // namespace tansy
