// The HTTP/1.1 wire format (http_wire.h): parsing a request head, writing a response head; and
// http_request::header (http.h), for the Asio server and the stub built without it alike.
#include "server/http_wire.h"

#include <algorithm>

namespace tansy {

std::string http_request::header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
        if (k == lower_name) return v;
    return "";
}

namespace http_wire {

char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c; }

namespace {

constexpr size_t MAX_TARGET_BYTES = 8192;

std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = ascii_lower(c);
    return out;
}

bool iequals(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); i++)
        if (ascii_lower(a[i]) != ascii_lower(b[i])) return false;
    return true;
}

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

// RFC 9110 tchar: what a method or header name may contain
bool is_tchar(char c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
    return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// Calls f(token) for each comma-separated token of a header value, trimmed.
template <class F>
void for_each_token(std::string_view v, F f) {
    while (!v.empty()) {
        const size_t c = v.find(',');
        f(trim(v.substr(0, c)));
        if (c == std::string_view::npos) break;
        v.remove_prefix(c + 1);
    }
}

const char* reason(int status) {
    switch (status) {
        case 100: return "Continue";
        case 200: return "OK";
        case 201: return "Created";
        case 204: return "No Content";
        case 400: return "Bad Request";
        case 401: return "Unauthorized";
        case 403: return "Forbidden";
        case 404: return "Not Found";
        case 405: return "Method Not Allowed";
        case 408: return "Request Timeout";
        case 411: return "Length Required";
        case 413: return "Content Too Large";
        case 414: return "URI Too Long";
        case 415: return "Unsupported Media Type";
        case 417: return "Expectation Failed";
        case 422: return "Unprocessable Content";
        case 429: return "Too Many Requests";
        case 431: return "Request Header Fields Too Large";
        case 500: return "Internal Server Error";
        case 501: return "Not Implemented";
        case 503: return "Service Unavailable";
        case 505: return "HTTP Version Not Supported";
        default: return status < 300 ? "OK" : status < 500 ? "Client Error" : "Server Error";
    }
}

}  // namespace

// Parses "METHOD target HTTP/1.x\r\n(name: value\r\n)*" (the block without its final empty line).
request_head parse_head(std::string_view block, const http_options& o) {
    request_head h;
    const size_t eol = block.find("\r\n");
    std::string_view line = block.substr(0, eol);
    std::string_view rest = eol == std::string_view::npos ? std::string_view() : block.substr(eol + 2);

    // 1. request line: exactly three parts separated by single spaces
    const size_t sp1 = line.find(' '), sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
        h.fail(400, "malformed request line");
        return h;
    }
    const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                           version = line.substr(sp2 + 1);
    if (method.empty() || method.size() > 32 || !std::all_of(method.begin(), method.end(), is_tchar)) {
        h.fail(400, "malformed request method");
        return h;
    }
    if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' || version[5] < '0' ||
        version[5] > '9' || version[7] < '0' || version[7] > '9') {
        h.fail(400, "malformed HTTP version");
        return h;
    }
    if (version[5] != '1') {
        h.fail(505, "only HTTP/1.0 and HTTP/1.1 are supported");
        return h;
    }
    h.minor = version[7] - '0';
    h.method = std::string(method);
    if (target.size() > MAX_TARGET_BYTES) {
        h.fail(414, "request target too long");
        return h;
    }
    for (char c : target)
        if ((unsigned char)c <= 0x20 || c == 0x7f) {
            h.fail(400, "malformed request target");
            return h;
        }
    if (target == "*" && method == "OPTIONS") {
        h.path = std::string(target);  // "*" (a literal here trips a false -Wrestrict in GCC 12)
    } else if (target.empty() || target[0] != '/') {
        h.fail(400, "request target must be an absolute path");
        return h;
    } else {
        h.path = std::string(target.substr(0, target.find_first_of("?#")));
    }

    // 2. header lines
    bool has_length = false, has_host = false;
    while (!rest.empty()) {
        const size_t e = rest.find("\r\n");
        line = rest.substr(0, e);
        rest = e == std::string_view::npos ? std::string_view() : rest.substr(e + 2);
        if ((int)h.headers.size() >= o.max_headers) {
            h.fail(431, "too many request headers");
            return h;
        }
        const size_t colon = line.find(':');
        if (colon == 0 || colon == std::string_view::npos) {
            h.fail(400, line.empty() || line[0] == ' ' || line[0] == '\t' ? "folded or empty header line"
                                                                          : "malformed header line");
            return h;
        }
        const std::string_view name = line.substr(0, colon), value = trim(line.substr(colon + 1));
        if (!std::all_of(name.begin(), name.end(), is_tchar)) {
            h.fail(400, "malformed header name");
            return h;
        }
        for (char c : value)
            if (((unsigned char)c < 0x20 && c != '\t') || c == 0x7f) {
                h.fail(400, "control character in a header value");
                return h;
            }
        std::string lname = lower(name);
        if (lname == "content-length") {
            // digits only: no sign, no list; more digits than any limit can hold is "too large", not malformed
            if (value.empty() ||
                !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
                h.fail(400, "malformed Content-Length");
                return h;
            }
            const size_t digits = value.size() - std::min(value.find_first_not_of('0'), value.size());
            size_t n = 0;
            if (digits > 18) {
                n = SIZE_MAX;
            } else {
                for (char c : value) n = n * 10 + (size_t)(c - '0');
            }
            if (has_length && n != h.content_length) {
                h.fail(400, "conflicting Content-Length headers");
                return h;
            }
            has_length = true;
            h.content_length = n;
        } else if (lname == "transfer-encoding") {
            // only a plain "chunked" is understood; other codings, or a repeated header, are refused
            if (!iequals(value, "chunked") || h.chunked)
                h.fail(501, "unsupported Transfer-Encoding: " + std::string(value));
            h.chunked = true;
        } else if (lname == "connection") {
            for_each_token(value, [&](std::string_view t) {
                if (iequals(t, "close")) h.keep_alive = false;
            });
        } else if (lname == "expect") {
            if (iequals(value, "100-continue")) {
                h.expect_continue = true;
            } else {
                h.fail(417, "unsupported Expect");
            }
        } else if (lname == "host") {
            has_host = true;
        }
        h.headers.emplace_back(std::move(lname), std::string(value));
    }
    if (h.status) return h;
    if (h.minor >= 1 && !has_host) h.fail(400, "HTTP/1.1 request without Host");
    // both framings at once is how requests are smuggled past proxies (RFC 9112 6.3)
    if (h.chunked && has_length) h.fail(400, "both Transfer-Encoding and Content-Length");
    if (h.chunked && h.minor == 0) h.fail(400, "Transfer-Encoding in an HTTP/1.0 request");
    // note: an HTTP/1.0 connection is closed after one response, keep-alive or not (simpler, and rare today)
    if (h.minor == 0) h.keep_alive = false;
    if (h.content_length > o.max_body_bytes)
        h.fail(413, "request body too large (limit " + std::to_string(o.max_body_bytes) + " bytes)");
    return h;
}

// body_len: >= 0 Content-Length; -1 chunked; -2 ended by closing the connection
std::string response_head(int status, const std::string& content_type, int64_t body_len, bool keep_alive,
                          const std::vector<std::pair<std::string, std::string>>& headers) {
    std::string s = "HTTP/1.1 " + std::to_string(status) + " " + reason(status) + "\r\n";
    for (const auto& [k, v] : headers) {
        if (iequals(k, "content-length") || iequals(k, "transfer-encoding") || iequals(k, "connection")) continue;
        s += k + ": " + v + "\r\n";
    }
    if (!content_type.empty() && status != 204) s += "Content-Type: " + content_type + "\r\n";
    if (body_len >= 0 && status != 204) s += "Content-Length: " + std::to_string(body_len) + "\r\n";
    if (body_len == -1) s += "Transfer-Encoding: chunked\r\n";
    s += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    return s + "\r\n";
}

}  // namespace http_wire

}  // namespace tansy
