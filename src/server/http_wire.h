// The HTTP/1.1 wire format for http.cpp: request heads parsed with bounds (sizes, counts, strict syntax) and
// response heads written. Plain text, no sockets and no Asio. Internal to src/server.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/http.h"

namespace tansy::http_wire {

char ascii_lower(char c);

// A parsed request head. Errors are (status, message) for the server to answer itself.
struct request_head {
    std::string method, path;
    int minor = 1;                                             // HTTP/1.minor
    std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
    size_t content_length = 0;
    bool chunked = false;  // Transfer-Encoding: chunked body (decoded as it arrives, counted against the limit)
    bool keep_alive = true, expect_continue = false;
    int status = 0;  // != 0: the error to answer
    std::string error;

    const std::string* find(std::string_view name) const {
        for (const auto& [k, v] : headers)
            if (k == name) return &v;
        return nullptr;
    }
    void fail(int s, std::string m) {
        if (!status) status = s, error = std::move(m);
    }
};

// Parses "METHOD target HTTP/1.x\r\n(name: value\r\n)*" (the block without its final empty line).
request_head parse_head(std::string_view block, const http_options& o);

// body_len: >= 0 Content-Length; -1 chunked; -2 ended by closing the connection
std::string response_head(int status, const std::string& content_type, int64_t body_len, bool keep_alive,
                          const std::vector<std::pair<std::string, std::string>>& headers);

}  // namespace tansy::http_wire
