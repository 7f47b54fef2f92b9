// Shared test helpers: fixture lookup, seeded inputs, comparisons with named tolerances.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace tansy::test {

// A fixture file or directory: the committed copy under tests/fixtures (or unpacked from a committed
// tests/fixtures/*.tar.xz into build/fixtures) if present, else ../shared/fixtures
// (or $TANSY_SHARED_FIXTURES) when available; "" if neither has it.
std::string fixture(const std::string& name);
// The shared fixtures directory if present ("" otherwise).
std::string shared_fixtures_dir();
// A fresh temporary directory, removed at process exit.
std::string temp_dir(const std::string& tag);

#define TANSY_REQUIRE_FIXTURE(var, name)                                                          \
    const std::string var = ::tansy::test::fixture(name);                                          \
    if (var.empty()) GTEST_SKIP() << "fixture '" << name << "' is not shipped in tests/fixtures and " \
                                     "../shared/fixtures is absent";

std::vector<float> random_uniform(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f);
std::vector<float> random_normal(size_t n, uint32_t seed, float stddev = 1.0f);

// Relative Frobenius error ||a - b|| / ||b||.
double rel_error(const std::vector<float>& a, const std::vector<float>& b);
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);

// Runs a shell command, returns its exit status and captures stdout (and stderr, when merge_stderr).
int run_command(const std::string& cmd, std::string* output, bool merge_stderr = true);

// A TCP connection to 127.0.0.1:port (close-on-exec), or -1.
int connect_loopback(int port);
// An HTTP exchange with a server on 127.0.0.1:port through http_client: the status and the body parsed as JSON
// (discarded, i.e. is_discarded(), when it is not JSON).
struct json_reply {
    int status = 0;
    nlohmann::json body;
};
json_reply post_json(int port, const std::string& path, const std::string& body);
json_reply get_json(int port, const std::string& path);

}  // namespace tansy::test
