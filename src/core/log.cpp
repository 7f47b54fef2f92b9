#include "core/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace tansy {

static std::atomic<int> g_level{(int)log_level::warn};

void set_log_level(log_level l) { g_level = (int)l; }
log_level get_log_level() { return (log_level)g_level.load(); }

void log_msg(log_level l, const char* fmt, ...) {
    if ((int)l > g_level.load()) return;
    static const char* tag[] = {"error", "warning", "info", "debug"};
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "tansy: %s: %s\n", tag[(int)l], buf);
}

}  // namespace tansy
