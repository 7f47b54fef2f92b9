// http_client over plain POSIX sockets: one keep-alive connection, responses read incrementally (Content-Length,
// chunked, or close-delimited bodies). Needs no library, so it is built with or without the server's Asio.
#include "server/http_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace tansy {

namespace {

constexpr size_t MAX_HEAD_BYTES = 64u << 10;

char lower_char(char c) { return c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c; }

bool starts_with_ci(std::string_view s, std::string_view prefix) {
    if (s.size() < prefix.size()) return false;
    for (size_t i = 0; i < prefix.size(); i++)
        if (lower_char(s[i]) != lower_char(prefix[i])) return false;
    return true;
}

bool contains_ci(std::string_view s, std::string_view needle) {
    for (size_t i = 0; i + needle.size() <= s.size(); i++)
        if (starts_with_ci(s.substr(i), needle)) return true;
    return false;
}

}  // namespace

class http_client::impl {
  public:
    impl(std::string h, int p, int t) : host(std::move(h)), port(p), timeout_ms(t * 1000) {}
    ~impl() { disconnect(); }

    std::string host;
    int port;
    int timeout_ms;
    int fd = -1;
    std::string buf;  // received, not yet consumed

    void disconnect() {
        if (fd >= 0) ::close(fd);
        fd = -1;
        buf.clear();
    }

    bool connect_now(std::string* error) {
        addrinfo hints{}, *res = nullptr;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        if (const int e = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res)) {
            *error = std::string("cannot resolve ") + host + ": " + gai_strerror(e);
            return false;
        }
        *error = "cannot connect to " + host + ":" + std::to_string(port);
        for (addrinfo* a = res; a; a = a->ai_next) {
            const int s = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
            if (s < 0) continue;
            int r = ::connect(s, a->ai_addr, a->ai_addrlen);
            if (r != 0 && errno == EINPROGRESS) {
                pollfd p{s, POLLOUT, 0};
                int err = 0;
                socklen_t len = sizeof err;
                r = poll(&p, 1, timeout_ms) == 1 && getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0
                        ? 0
                        : -1;
                if (r != 0) errno = err ? err : ETIMEDOUT;
            }
            if (r == 0) {
                const int one = 1;
                setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                fd = s;
                break;
            }
            *error += std::string(": ") + strerror(errno);
            ::close(s);
        }
        freeaddrinfo(res);
        return fd >= 0;
    }

    bool send_all(std::string_view d) {
        while (!d.empty()) {
            const ssize_t n = send(fd, d.data(), d.size(), MSG_NOSIGNAL);
            if (n > 0) {
                d.remove_prefix((size_t)n);
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                pollfd p{fd, POLLOUT, 0};
                if (poll(&p, 1, timeout_ms) != 1) return false;
            } else if (!(n < 0 && errno == EINTR)) {
                return false;
            }
        }
        return true;
    }

    // Appends what arrives to buf: > 0 bytes, 0 at EOF, -1 on error or timeout (each wait is bounded).
    ssize_t fill() {
        char tmp[16384];
        for (;;) {
            const ssize_t n = recv(fd, tmp, sizeof tmp, 0);
            if (n > 0) {
                buf.append(tmp, (size_t)n);
                return n;
            }
            if (n == 0) return 0;
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
            pollfd p{fd, POLLIN, 0};
            if (poll(&p, 1, timeout_ms) != 1) return -1;
        }
    }

    // One request/response exchange on the open connection. Returns the status, -1 with *error on failure;
    // *stale tells a stale keep-alive connection (closed before any response byte) for a retry.
    int exchange(const std::string& request, const http_body_fn& on_body, std::string* error, bool* stale) {
        *stale = false;
        if (!send_all(request)) {
            *stale = true;
            *error = "send failed";
            return -1;
        }
        // 1. status line and headers
        size_t end;
        while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
            if (buf.size() > MAX_HEAD_BYTES) return *error = "response headers too large", -1;
            const ssize_t n = fill();
            if (n <= 0) {
                *stale = buf.empty() && n == 0;
                *error = n == 0 ? "connection closed before a response" : "timed out waiting for a response";
                return -1;
            }
        }
        const std::string head = buf.substr(0, end);
        buf.erase(0, end + 4);
        if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0) return *error = "malformed response", -1;
        const int status = std::atoi(head.c_str() + 9);
        bool chunked = false, close_after = head.compare(0, 8, "HTTP/1.0") == 0;
        long long length = -1;
        size_t pos = head.find("\r\n");
        while (pos != std::string::npos) {
            const size_t next = head.find("\r\n", pos + 2);
            const std::string_view line =
                std::string_view(head).substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
            if (starts_with_ci(line, "content-length:")) length = std::atoll(std::string(line.substr(15)).c_str());
            if (starts_with_ci(line, "transfer-encoding:") && contains_ci(line, "chunked")) chunked = true;
            if (starts_with_ci(line, "connection:") && contains_ci(line, "close")) close_after = true;
            pos = next;
        }
        if (status == 204 || status == 304 || (status >= 100 && status < 200)) length = 0;
        auto deliver = [&](std::string_view piece) {
            if (piece.empty() || on_body(piece)) return true;
            *error = "aborted by the caller";
            return false;
        };
        // The next `left` bytes of the body to on_body; false when the connection ends first (*error = cut) or
        // the caller aborts.
        auto deliver_next = [&](unsigned long long left, const char* cut) {
            while (left > 0) {
                if (buf.empty() && fill() <= 0) return *error = cut, false;
                const size_t take = (size_t)std::min<unsigned long long>(left, buf.size());
                if (!deliver(std::string_view(buf).substr(0, take))) return false;
                buf.erase(0, take);
                left -= take;
            }
            return true;
        };
        // 2. the body
        if (chunked) {
            for (;;) {
                size_t eol;
                while ((eol = buf.find("\r\n")) == std::string::npos)
                    if (buf.size() > 1024 || fill() <= 0) return *error = "broken chunked body", -1;
                const unsigned long long size = std::strtoull(buf.c_str(), nullptr, 16);
                buf.erase(0, eol + 2);
                if (size == 0) {  // trailers, then the empty line
                    while ((eol = buf.find("\r\n")) != 0) {
                        if (eol != std::string::npos) {
                            buf.erase(0, eol + 2);
                        } else if (buf.size() > MAX_HEAD_BYTES || fill() <= 0) {
                            return *error = "broken chunked body", -1;
                        }
                    }
                    buf.erase(0, 2);
                    break;
                }
                if (!deliver_next(size, "broken chunked body")) return -1;
                while (buf.size() < 2)
                    if (fill() <= 0) return *error = "broken chunked body", -1;
                buf.erase(0, 2);
            }
        } else if (length >= 0) {
            if (!deliver_next((unsigned long long)length, "response body cut short")) return -1;
        } else {  // ended by closing
            for (;;) {
                if (!deliver(buf)) return -1;
                buf.clear();
                const ssize_t n = fill();
                if (n == 0) break;
                if (n < 0) return *error = "timed out reading the response", -1;
            }
            close_after = true;
        }
        if (close_after) disconnect();
        return status;
    }

    int request(const std::string& method, const std::string& path, const std::string* body,
                const http_body_fn& on_body, std::string* error) {
        std::string req = method + " " + path + " HTTP/1.1\r\nHost: " + host + ":" + std::to_string(port) +
                          "\r\nAccept: */*\r\nConnection: keep-alive\r\n";
        if (body) req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body->size()) + "\r\n";
        req += "\r\n";
        if (body) req += *body;
        std::string err;
        for (int attempt = 0; attempt < 2; attempt++) {
            const bool reused = fd >= 0;
            if (fd < 0 && !connect_now(&err)) break;
            bool stale = false;
            const int status = exchange(req, on_body, &err, &stale);
            if (status >= 0) return status;
            disconnect();
            if (!(reused && stale)) break;  // a kept-alive connection the server had closed: once more, fresh
        }
        if (error) *error = err;
        return -1;
    }
};

http_client::http_client(const std::string& host, int port, int timeout_s)
    : impl_(std::make_unique<impl>(host, port, timeout_s)) {}
http_client::~http_client() = default;

int http_client::post(const std::string& path, const std::string& json_body, const http_body_fn& on_body,
                      std::string* error) {
    return impl_->request("POST", path, &json_body, on_body, error);
}

int http_client::get(const std::string& path, std::string* body, std::string* error) {
    if (body) body->clear();
    return impl_->request(
        "GET", path, nullptr,
        [body](std::string_view p) {
            if (body) body->append(p);
            return true;
        },
        error);
}

}  // namespace tansy
