// One-line logging to stderr. Level is process-wide; tests and --quiet lower it.
#pragma once

namespace tansy {

enum class log_level : int { error = 0, warn = 1, info = 2, debug = 3 };

void set_log_level(log_level l);
log_level get_log_level();
void log_msg(log_level l, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace tansy

#define TANSY_WARN(...) ::tansy::log_msg(::tansy::log_level::warn, __VA_ARGS__)
#define TANSY_INFO(...) ::tansy::log_msg(::tansy::log_level::info, __VA_ARGS__)
#define TANSY_DEBUG(...) ::tansy::log_msg(::tansy::log_level::debug, __VA_ARGS__)
