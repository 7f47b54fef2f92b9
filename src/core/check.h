// Error handling, two kinds (STYLE.md "Errors"):
//  - tansy::error: a problem with the user's input (bad file, unsupported config, bad request). Thrown, caught
//    at the CLI/HTTP boundary, reported in one line. Never a crash.
//  - TANSY_CHECK / TANSY_ABORT: a broken internal invariant (a bug). Prints file:line and aborts.
#pragma once
#include <stdexcept>
#include <string>

namespace tansy {

struct error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws tansy::error with a printf-formatted message.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void abort_at(const char* file, int line, const char* what, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace tansy

#define TANSY_CHECK(cond, ...)                                                  \
    do {                                                                        \
        if (!(cond)) ::tansy::abort_at(__FILE__, __LINE__, #cond, __VA_ARGS__); \
    } while (0)

#define TANSY_ABORT(...) ::tansy::abort_at(__FILE__, __LINE__, nullptr, __VA_ARGS__)
