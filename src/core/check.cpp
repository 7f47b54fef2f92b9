#include "core/check.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

namespace tansy {

static std::string vformat(const char* fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int n = std::vsnprintf(nullptr, 0, fmt, ap2);
    va_end(ap2);
    std::string s(n > 0 ? (size_t)n : 0, '\0');
    if (n > 0) std::vsnprintf(s.data(), (size_t)n + 1, fmt, ap);
    return s;
}

std::string strprintf(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    throw error(s);
}

void abort_at(const char* file, int line, const char* what, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "tansy: internal error at %s:%d: %s%s%s\n", file, line, what ? what : "",
                 what ? ": " : "", s.c_str());
    std::fflush(stderr);
    std::abort();
}

}  // namespace tansy
