// libFuzzer target: arbitrary bytes as a safetensors file. The parser must either accept them (and then every
// tensor lies inside the buffer) or throw tansy::error; anything else (crash, sanitizer report, other
// exception) is a bug. Built with -DTANSY_FUZZ=ON (clang); run by scripts/fuzz.sh and ctest -L fuzz.
#include <cstddef>
#include <cstdint>

#include "core/check.h"
#include "loader/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        tansy::st_header h = tansy::parse_safetensors_image(data, size, "fuzz");
        for (const tansy::st_tensor& t : h.tensors) {
            TANSY_CHECK(t.data >= data && t.data + t.nbytes() <= data + size, "tensor %s outside the buffer",
                        t.name.c_str());
            volatile uint8_t sink = t.nbytes() ? t.data[t.nbytes() - 1] : 0;  // touch the last byte
            (void)sink;
        }
    } catch (const tansy::error&) {
    }
    return 0;
}
