// http_server over cpp-httplib (the Debian build, 0.11); with http_client.cpp, the only files that include
// httplib.h.
#include "server/http.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <cctype>
#include <cstdlib>
#include <exception>
#include <map>
#include <atomic>
#include <chrono>
#include <thread>

#include <httplib.h>

#include "core/check.h"

namespace tansy {

bool http_available() { return true; }

std::string http_request::header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
        if (k == lower_name) return v;
    return "";
}

namespace {

std::string lower(std::string s) {
    for (char& c : s) c = (char)std::tolower((unsigned char)c);
    return s;
}

std::string numeric_host(const sockaddr_storage& a, socklen_t len, int* port) {
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo((const sockaddr*)&a, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV))
        return "";
    *port = std::atoi(serv);
    return host;
}

// The socket of the connection a request came on. httplib 0.11 does not expose it, so it is found among the
// process's descriptors by its two endpoints (unique while the handler runs: the connection stays open).
int find_connection_fd(const std::string& peer_addr, int peer_port, int local_port) {
    DIR* d = opendir("/proc/self/fd");
    if (!d) return -1;
    int found = -1;
    while (dirent* e = readdir(d)) {
        if (!std::isdigit((unsigned char)e->d_name[0])) continue;
        const int fd = std::atoi(e->d_name);
        sockaddr_storage peer{}, local{};
        socklen_t pl = sizeof peer, ll = sizeof local;
        if (getpeername(fd, (sockaddr*)&peer, &pl) != 0 || getsockname(fd, (sockaddr*)&local, &ll) != 0) continue;
        int pp = -1, lp = -1;
        if (numeric_host(local, ll, &lp).empty() || lp != local_port) continue;
        if (numeric_host(peer, pl, &pp) != peer_addr || pp != peer_port) continue;
        found = fd;
        break;
    }
    closedir(d);
    return found;
}

// Whether the peer has closed (or reset) the connection. A request pipelined behind this one also makes the
// socket readable; then recv() peeks data, and the client is still there.
bool peer_closed(int fd) {
    if (fd < 0) return false;
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return true;
    if (p.revents & POLLIN) {
        char c;
        const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    return false;
}

struct route_key {
    std::string method, path;
    bool operator<(const route_key& o) const { return method != o.method ? method < o.method : path < o.path; }
};

}  // namespace

class http_server::impl {
  public:
    explicit impl(const http_options& opt) : opt_(opt) {}

    http_options opt_;
    httplib::Server svr_;
    std::map<route_key, http_handler> routes_;
    std::function<std::string(int, const std::string&)> error_body_ = [](int, const std::string& m) {
        return "{\"error\": {\"message\": \"" + m + "\"}}";
    };
    std::function<void(const http_request&, int)> logger_;
    int port_ = -1;
    // stop() may come before run() has started listening; these close that window.
    std::atomic<bool> stop_requested_{false}, run_entered_{false}, run_exited_{false};

    void set_error(httplib::Response& res, int status, const std::string& msg) {
        res.status = status;
        res.set_content(error_body_(status, msg), "application/json");
    }

    // note: bodies are read through a content reader, not by httplib before routing: its own reading caps
    // application/x-www-form-urlencoded bodies at 8 KB with a 413 (curl -d sends that type by default).
    void dispatch_with_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
        std::string body;
        bool too_large = false;
        const bool ok = reader([&](const char* data, size_t n) {
            // httplib 0.11 checks the limit against Content-Length only: a chunked body is counted here
            if (body.size() + n > opt_.max_body_bytes) return !(too_large = true);
            body.append(data, n);
            return true;
        });
        if (!ok || too_large) {  // httplib has set the status (413 over the limit, 400 for a broken body)
            if (too_large) res.status = 413;
            if (res.status < 400) res.status = 400;
            return;
        }
        dispatch(req, res, &body);
    }

    void dispatch(const httplib::Request& req, httplib::Response& res, std::string* body = nullptr) {
        bool path_known = false;
        const http_handler* h = nullptr;
        for (const auto& [k, fn] : routes_) {
            if (k.path != req.path) continue;
            path_known = true;
            if (k.method == req.method) h = &fn;
        }
        if (!h) {
            if (path_known) {
                set_error(res, 405, "method " + req.method + " is not allowed on " + req.path);
            } else {
                set_error(res, 404, "no such endpoint: " + req.method + " " + req.path);
            }
            return;
        }
        http_request r;
        r.method = req.method;
        r.path = req.path;
        r.body = body ? std::move(*body) : req.body;
        r.remote_addr = req.remote_addr;
        r.remote_port = req.remote_port;
        for (const auto& [k, v] : req.headers) r.headers.emplace_back(lower(k), v);
        // note: looked up now, while the connection is surely whole: once the peer resets it, getpeername()
        // fails and the descriptor could no longer be found (a client that closes with unread data sends RST).
        const int fd = find_connection_fd(req.remote_addr, req.remote_port, req.local_port);
        r.client_closed = [fd] { return peer_closed(fd); };
        http_response out;
        try {
            (*h)(r, out);
        } catch (const std::exception& e) {
            out = http_response{};
            out.status = 500;
            out.body = error_body_(500, std::string("internal error: ") + e.what());
        } catch (...) {
            out = http_response{};
            out.status = 500;
            out.body = error_body_(500, "internal error");
        }
        res.status = out.status;
        for (const auto& [k, v] : out.headers) res.set_header(k, v);
        if (logger_) {
            try {
                logger_(r, out.status);
            } catch (...) {
            }
        }
        if (!out.stream) {
            res.set_content(out.body, out.content_type);
            return;
        }
        // The whole stream is produced in the provider's first call; done() then writes the last chunk.
        auto stream = std::make_shared<std::function<void(const http_write_fn&)>>(std::move(out.stream));
        res.set_chunked_content_provider(out.content_type, [stream](size_t, httplib::DataSink& sink) {
            bool ok = true;
            http_write_fn write = [&](std::string_view chunk) {
                if (!ok) return false;
                if (chunk.empty()) return true;  // an empty chunk would end the response early
                ok = sink.write(chunk.data(), chunk.size());
                return ok;
            };
            try {
                (*stream)(write);
            } catch (...) {
                // a stream function must not throw; if it does, the response simply ends here
            }
            if (ok) sink.done();
            return ok;
        });
    }
};

http_server::http_server(const http_options& opt) : impl_(std::make_unique<impl>(opt)) {
    httplib::Server& s = impl_->svr_;
    const size_t threads = (size_t)std::max(1, opt.threads);
    s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    s.set_payload_max_length(opt.max_body_bytes);
    s.set_read_timeout(opt.read_timeout_s, 0);
    s.set_write_timeout(opt.write_timeout_s, 0);
    s.set_keep_alive_max_count((size_t)std::max(1, opt.keepalive_max));
    s.set_keep_alive_timeout(5);
    impl* p = impl_.get();
    auto handler = [p](const httplib::Request& req, httplib::Response& res) { p->dispatch(req, res); };
    auto with_body = [p](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
        p->dispatch_with_body(req, res, reader);
    };
    s.Get(".*", handler);
    s.Post(".*", httplib::Server::HandlerWithContentReader(with_body));
    s.Put(".*", httplib::Server::HandlerWithContentReader(with_body));
    s.Patch(".*", httplib::Server::HandlerWithContentReader(with_body));
    s.Delete(".*", handler);
    s.Options(".*", handler);
    // Responses httplib makes by itself (413, 400 for a malformed request line, ...) get a JSON body too.
    s.set_error_handler(httplib::Server::HandlerWithResponse([p](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty() || res.is_chunked_content_provider_ || res.content_length_ > 0)
            return httplib::Server::HandlerResponse::Unhandled;
        const char* msg = res.status == 413   ? "request body too large"
                          : res.status == 400 ? "malformed HTTP request"
                          : res.status == 404 ? "not found"
                                              : "request failed";
        res.set_content(p->error_body_(res.status, msg), "application/json");
        return httplib::Server::HandlerResponse::Handled;
    }));
    s.set_exception_handler([p](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        p->set_error(res, 500, "internal error");
    });
}

http_server::~http_server() { stop(); }

void http_server::route(const std::string& method, const std::string& path, http_handler h) {
    impl_->routes_[route_key{method, path}] = std::move(h);
}

void http_server::set_error_body(std::function<std::string(int, const std::string&)> f) {
    impl_->error_body_ = std::move(f);
}

void http_server::set_logger(std::function<void(const http_request&, int)> f) { impl_->logger_ = std::move(f); }

void http_server::bind() {
    httplib::Server& s = impl_->svr_;
    const http_options& o = impl_->opt_;
    if (o.port == 0) {
        impl_->port_ = s.bind_to_any_port(o.host);
        if (impl_->port_ < 0) fail("serve: cannot bind to %s (any port)", o.host.c_str());
    } else {
        if (!s.bind_to_port(o.host, o.port))
            fail("serve: cannot bind to %s:%d (in use, or not a local address?)", o.host.c_str(), o.port);
        impl_->port_ = o.port;
    }
}

int http_server::port() const { return impl_->port_; }

void http_server::run() {
    impl_->run_entered_ = true;
    if (!impl_->stop_requested_) impl_->svr_.listen_after_bind();
    impl_->run_exited_ = true;
}

void http_server::stop() {
    if (!impl_) return;
    impl_->stop_requested_ = true;
    // httplib's stop() is a no-op until its accept loop runs: wait for it when run() is on its way there
    while (impl_->run_entered_ && !impl_->run_exited_ && !impl_->svr_.is_running())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    impl_->svr_.stop();
}

}  // namespace tansy
