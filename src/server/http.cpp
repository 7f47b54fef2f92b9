// http_server over standalone Asio (Debian's libasio-dev, header-only); the only file that includes asio.hpp.
// The wire format (parsing request heads, writing response heads) is in http_wire.cpp.
// (Over 700 lines: the connection state machine and the server that owns it share impl's private state, and
// splitting them would put asio.hpp into a header.)
//
// Why not cpp-httplib (what this replaced; measured on its Debian build 0.11, 64 pool threads): its listen
// backlog is 5 (compiled into the shared library), so a burst of 64 connections waits for SYN retransmits;
// it spends one pool thread per connection with per-recv timeouts only, so 100 clients sending a header byte
// a second block every other client (a normal request timed out after 10 s); and a huge or negative
// Content-Length was answered only after 35 s. Here one I/O thread owns every connection until its request
// is complete (deadlines for the whole header block and the whole body), and only handlers use threads.
//
// Life of a connection (all on the I/O thread unless said otherwise):
//   1. accept: over max_connections (or per address) -> canned 503 + Retry-After, close
//   2. read the header block (deadline: header_timeout_s from accept, or from the first byte of a keep-alive
//      request; idle_timeout_s between requests) and parse it (bounded: sizes, counts, strict syntax)
//   3. answer by itself what needs no handler (400/404/405/408/413/414/417/431/501/505, OPTIONS) and close, or
//   4. read the body, Content-Length or chunked (deadline: body_timeout_s), then hand the request to a worker
//   5. worker: handler, then the response written with blocking sends (poll, write_timeout_s per stall)
//   6. back on the I/O thread: next request on the same connection (keep-alive), or a lingering close
#include "server/http.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#define ASIO_STANDALONE
#define ASIO_NO_DEPRECATED
#include <asio.hpp>

#include "core/check.h"
#include "server/http_wire.h"
#include "server/worker_pool.h"

namespace tansy {

bool http_available() { return true; }

namespace {

using tcp = asio::ip::tcp;
using clock_type = std::chrono::steady_clock;

constexpr double LINGER_S = 2;  // reading (and discarding) after a close, so the reply is not reset
constexpr size_t LINGER_MAX_BYTES = 64u << 20;
constexpr size_t MAX_CHUNK_LINE = 1024;   // a chunk-size line with its extensions
constexpr int MAX_PENDING_REJECTS = 256;  // 503s being written at once; beyond that a refused client is just closed

using namespace http_wire;

// Whether the peer has closed (or reset) the connection. A request pipelined behind this one also makes the
// socket readable; then recv() peeks data, and the client is still there.
bool peer_closed(int fd) {
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

// Sends all of `data` from a worker thread; false when the peer is gone or stalls longer than timeout_ms.
bool send_all(int fd, std::string_view data, int timeout_ms) {
    while (!data.empty()) {
        const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            data.remove_prefix((size_t)n);
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            pollfd p{fd, POLLOUT, 0};
            const int r = poll(&p, 1, timeout_ms);
            if (r == 0 || (r > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL)))) return false;
        } else if (!(n < 0 && errno == EINTR)) {
            return false;
        }
    }
    return true;
}

// The descriptor of a connection as handlers see it (client_closed() may be called after the connection is
// gone, when the descriptor number may belong to another socket: `open` says so under the lock).
struct fd_guard {
    std::mutex mu;
    int fd = -1;
    bool open = true;
    bool closed() {
        std::lock_guard<std::mutex> lk(mu);
        return !open || peer_closed(fd);
    }
    void close_now() {
        std::lock_guard<std::mutex> lk(mu);
        open = false;
    }
};

struct route_key {
    std::string method, path;
    bool operator<(const route_key& o) const { return method != o.method ? method < o.method : path < o.path; }
};

}  // namespace

class http_server::impl {
  public:
    struct conn;

    explicit impl(const http_options& opt) : opt_(opt), acceptor_(io_), retry_timer_(io_) {}

    http_options opt_;
    int rejects_pending_ = 0;  // I/O thread only; declared before io_, whose handlers may still hold rejects
    asio::io_context io_;
    tcp::acceptor acceptor_;
    asio::steady_timer retry_timer_;  // accept paused after EMFILE
    worker_pool pool_;
    std::map<route_key, http_handler> routes_;
    std::function<std::string(int, const std::string&)> error_body_ = [](int, const std::string& m) {
        return "{\"error\": {\"message\": \"" + m + "\"}}";
    };
    std::function<void(const http_request&, int)> logger_;
    int port_ = -1;
    std::atomic<bool> stop_requested_{false};
    // I/O thread only:
    bool stopping_ = false;
    std::unordered_set<conn*> conns_;
    std::unordered_map<std::string, int> per_addr_;
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;

    // ---- routing and response heads (any thread; routes_ and opt_ do not change while serving)

    // A route's path matches exactly, or, ending in "/*", any path under it ("/v1/responses/*": "/v1/responses/ID").
    static bool path_matches(const std::string& route, const std::string& path) {
        if (route == path) return true;
        const size_t n = route.size();
        return n >= 2 && route.compare(n - 2, 2, "/*") == 0 && path.size() > n - 1 &&
               path.compare(0, n - 1, route, 0, n - 1) == 0;
    }

    const http_handler* find_route(const std::string& method, const std::string& path) const {
        const auto h = routes_.find(route_key{method, path});
        if (h != routes_.end()) return &h->second;
        for (const auto& [k, f] : routes_)
            if (k.method == method && path_matches(k.path, path)) return &f;
        return nullptr;
    }

    std::string allowed_methods(const std::string& path) const {
        std::string allow;
        for (const auto& [k, h] : routes_)
            if (path_matches(k.path, path) && allow.find(k.method) == std::string::npos) allow += k.method + ", ";
        if (allow.empty()) return "";
        return allow + "OPTIONS";
    }

    // Access-Control-* for a request from `origin`, when that origin is allowed
    void add_cors(const request_head& h, std::vector<std::pair<std::string, std::string>>& out) const {
        if (opt_.cors_origins.empty()) return;
        const std::string* origin = h.find("origin");
        if (!origin) return;
        const bool any = std::find(opt_.cors_origins.begin(), opt_.cors_origins.end(), "*") != opt_.cors_origins.end();
        if (!any && std::find(opt_.cors_origins.begin(), opt_.cors_origins.end(), *origin) == opt_.cors_origins.end())
            return;
        out.emplace_back("Access-Control-Allow-Origin", any ? "*" : *origin);
        if (!any) out.emplace_back("Vary", "Origin");
    }


    void log(const http_request& r, int status) {
        if (!logger_) return;
        try {
            logger_(r, status);
        } catch (...) {
        }
    }

    // ---- one connection

    struct conn : std::enable_shared_from_this<conn> {
        enum class phase { head, body, handling, writing, closing };
        impl& srv;
        tcp::socket sock;
        asio::steady_timer timer;
        std::string addr;
        int port = -1;
        std::string buf;  // received, not yet consumed
        std::array<char, 16384> rbuf;
        phase ph = phase::head;
        bool request_started = false;  // a byte of the current request has arrived
        int served = 0;
        request_head head;
        size_t head_bytes = 0;
        std::string body;     // a chunked body, decoded so far
        int chunk_state = 0;  // 0 size line, 1 data, 2 CRLF after data, 3 trailers
        size_t chunk_left = 0;
        std::shared_ptr<fd_guard> guard = std::make_shared<fd_guard>();
        clock_type::time_point deadline;
        size_t lingered = 0;
        bool registered = true;

        conn(impl& s, tcp::socket so, std::string a, int p)
            : srv(s), sock(std::move(so)), timer(s.io_), addr(std::move(a)), port(p) {
            guard->fd = sock.native_handle();
        }

        void set_deadline(double seconds) {
            deadline = clock_type::now() + std::chrono::microseconds((int64_t)(seconds * 1e6));
            timer.expires_at(deadline);
            timer.async_wait([self = shared_from_this()](const asio::error_code& ec) {
                if (!ec && clock_type::now() >= self->deadline) self->on_deadline();
            });
        }
        void clear_deadline() {
            deadline = clock_type::time_point::max();
            timer.cancel();
        }

        void start() {
            set_deadline(srv.opt_.header_timeout_s);
            request_started = true;  // the header deadline runs from accept for the first request
            read_more();
        }

        void read_more() {
            sock.async_read_some(asio::buffer(rbuf), [self = shared_from_this()](const asio::error_code& ec, size_t n) {
                self->on_read(ec, n);
            });
        }

        void on_read(const asio::error_code& ec, size_t n) {
            if (ph == phase::closing) {  // lingering close: discard until EOF, the deadline, or enough bytes
                lingered += n;
                if (ec || lingered > LINGER_MAX_BYTES) return close();
                return read_more();
            }
            if (ec) return close();
            buf.append(rbuf.data(), n);
            process();
        }

        void on_deadline() {
            if (ph == phase::head && !request_started) return close();  // idle keep-alive connection
            if (ph == phase::head || ph == phase::body)
                return reply_and_close(408, ph == phase::head ? "request headers not received in time"
                                                              : "request body not received in time");
            close();  // writing an error reply, or lingering
        }

        // Parses what has arrived and moves the request on.
        void process() {
            if (ph == phase::head) {
                if (!request_started) {
                    // tolerate empty lines before a request (RFC 9112 2.2)
                    while (buf.size() >= 2 && buf[0] == '\r' && buf[1] == '\n') buf.erase(0, 2);
                    if (buf.empty()) return read_more();
                    request_started = true;
                    set_deadline(srv.opt_.header_timeout_s);
                }
                const size_t end = buf.find("\r\n\r\n");
                if (end == std::string::npos) {
                    if (buf.size() > srv.opt_.max_header_bytes)
                        return reply_and_close(431, "request headers too large");
                    return read_more();
                }
                if (end + 4 > srv.opt_.max_header_bytes) return reply_and_close(431, "request headers too large");
                head = parse_head(std::string_view(buf).substr(0, end), srv.opt_);
                head_bytes = end + 4;
                if (head.status) return reply_and_close(head.status, head.error);
                if (!route_or_answer()) return;
                ph = phase::body;
                set_deadline(srv.opt_.body_timeout_s);
                buf.erase(0, head_bytes);  // from here buf holds the body (and what follows it)
                head_bytes = 0;
                if (head.expect_continue && (head.chunked ? buf.empty() : buf.size() < head.content_length)) {
                    // the client waits for this before sending its body (curl does for bodies over 1 KiB)
                    static const std::string cont = "HTTP/1.1 100 Continue\r\n\r\n";
                    asio::async_write(sock, asio::buffer(cont),
                                      [self = shared_from_this()](const asio::error_code& ec, size_t) {
                                          if (ec) return self->close();
                                          self->process();
                                      });
                    return;
                }
            }
            if (ph == phase::body) {
                if (head.chunked) {
                    const int r = decode_chunks();
                    if (r < 0) return;  // answered
                    if (r == 0) return read_more();
                } else if (buf.size() < head.content_length) {
                    return read_more();
                }
                clear_deadline();
                dispatch();
            }
        }

        // Decodes the chunks in buf into body (RFC 9112 7.1): 1 when the body is complete, 0 for more input,
        // -1 when it was answered with an error.
        int decode_chunks() {
            for (;;) {
                if (chunk_state == 1) {  // data
                    const size_t take = std::min(chunk_left, buf.size());
                    body.append(buf, 0, take);
                    buf.erase(0, take);
                    chunk_left -= take;
                    if (chunk_left > 0) return 0;
                    chunk_state = 2;
                    continue;
                }
                const size_t eol = buf.find("\r\n");
                if (eol == std::string::npos) {
                    const size_t cap = chunk_state == 3 ? srv.opt_.max_header_bytes : MAX_CHUNK_LINE;
                    if (buf.size() > cap) return reply_and_close(400, "malformed chunked body"), -1;
                    return 0;
                }
                if (chunk_state == 2) {  // the CRLF closing a chunk's data
                    if (eol != 0) return reply_and_close(400, "malformed chunked body"), -1;
                    buf.erase(0, 2);
                    chunk_state = 0;
                } else if (chunk_state == 3) {  // trailer lines, ignored, up to the empty line
                    buf.erase(0, eol + 2);
                    if (eol == 0) return 1;
                } else {  // chunk-size [; extensions]
                    const std::string_view line = std::string_view(buf).substr(0, eol);
                    const size_t digits = std::min(line.find_first_of("; \t"), line.size());
                    if (digits == 0 || digits > 16) return reply_and_close(400, "malformed chunk size"), -1;
                    size_t n = 0;
                    for (size_t i = 0; i < digits; i++) {
                        const char c = ascii_lower(line[i]);
                        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
                            return reply_and_close(400, "malformed chunk size"), -1;
                        n = n * 16 + (size_t)(c <= '9' ? c - '0' : c - 'a' + 10);
                    }
                    buf.erase(0, eol + 2);
                    if (n > srv.opt_.max_body_bytes - std::min(body.size(), srv.opt_.max_body_bytes))
                        return reply_and_close(413, "request body too large (limit " +
                                                        std::to_string(srv.opt_.max_body_bytes) + " bytes)"),
                               -1;
                    chunk_left = n;
                    chunk_state = n == 0 ? 3 : 1;
                }
            }
        }

        // Answers what needs no handler (404, 405, OPTIONS); true when a handler is to run.
        bool route_or_answer() {
            http_request r;
            r.method = head.method;
            r.path = head.path;
            r.remote_addr = addr;
            r.remote_port = port;
            if (head.path == "*") {  // OPTIONS *: what the server supports
                reply_simple(204, "", {{"Allow", "GET, POST, OPTIONS"}});
                return false;
            }
            if (srv.find_route(head.method, head.path)) return true;
            const std::string allow = srv.allowed_methods(head.path);
            if (allow.empty()) {
                srv.log(r, 404);
                reply_and_close(404, "no such endpoint: " + head.method + " " + head.path);
                return false;
            }
            if (head.method == "OPTIONS") {
                std::vector<std::pair<std::string, std::string>> hs{{"Allow", allow}};
                srv.add_cors(head, hs);
                if (hs.size() > 1 &&
                    head.find("access-control-request-method")) {  // a preflight from an allowed origin
                    hs.emplace_back("Access-Control-Allow-Methods", allow);
                    const std::string* req_headers = head.find("access-control-request-headers");
                    hs.emplace_back("Access-Control-Allow-Headers", req_headers && !req_headers->empty()
                                                                        ? *req_headers
                                                                        : "Authorization, Content-Type");
                    hs.emplace_back("Access-Control-Max-Age", "86400");
                }
                reply_simple(204, "", std::move(hs));
                return false;
            }
            srv.log(r, 405);
            reply_and_close(405, "method " + head.method + " is not allowed on " + head.path, {{"Allow", allow}});
            return false;
        }

        // A reply the I/O thread writes itself; the connection stays open only when the request had no body.
        void reply_simple(int status, const std::string& body, std::vector<std::pair<std::string, std::string>> hs) {
            const bool keep = head.keep_alive && head.content_length == 0 && !head.chunked && !srv.stopping_ &&
                              ++served < srv.opt_.keepalive_max;
            if (keep) buf.erase(0, head_bytes);
            write_then(
                response_head(status, body.empty() ? "" : "application/json", (int64_t)body.size(), keep, hs) + body,
                keep);
        }

        void reply_and_close(int status, const std::string& message,
                             std::vector<std::pair<std::string, std::string>> hs = {}) {
            if (status == 503 || status == 408) hs.emplace_back("Retry-After", "1");
            srv.add_cors(head, hs);
            const std::string body = srv.error_body_(status, message);
            write_then(response_head(status, "application/json", (int64_t)body.size(), false, hs) + body, false);
        }

        void write_then(std::string data, bool keep) {
            ph = phase::writing;
            set_deadline(srv.opt_.write_timeout_s);
            auto out = std::make_shared<std::string>(std::move(data));
            asio::async_write(sock, asio::buffer(*out),
                              [self = shared_from_this(), out, keep](const asio::error_code& ec, size_t) {
                                  if (ec) return self->close();
                                  if (keep) return self->next_request();
                                  self->linger();
                              });
        }

        // Hands the complete request to a worker.
        void dispatch() {
            ph = phase::handling;
            std::vector<std::pair<std::string, std::string>> cors;
            srv.add_cors(head, cors);
            auto r = std::make_shared<http_request>();
            r->method = head.method;
            r->path = head.path;
            if (head.chunked) {
                r->body = std::move(body);
            } else {
                r->body = buf.substr(0, head.content_length);
                buf.erase(0, head.content_length);
            }
            r->headers = std::move(head.headers);
            r->remote_addr = addr;
            r->remote_port = port;
            r->client_closed = [g = guard] { return g->closed(); };
            const bool keep = head.keep_alive && !srv.stopping_ && ++served < srv.opt_.keepalive_max;
            const bool http10 = head.minor == 0;
            srv.pool_.post([self = shared_from_this(), r, keep, cors = std::move(cors), http10] {
                const bool still_keep = self->srv.handle(*r, self->guard->fd, keep, http10, cors);
                asio::post(self->srv.io_, [self, still_keep] { self->after_response(still_keep); });
            });
        }

        void after_response(bool keep) {
            if (keep && !srv.stopping_) return next_request();
            linger();
        }

        void next_request() {
            ph = phase::head;
            request_started = false;
            head = request_head{};
            head_bytes = 0;
            body.clear();
            chunk_state = 0;
            chunk_left = 0;
            set_deadline(srv.opt_.idle_timeout_s);
            process();
        }

        // Half-closes, then reads and discards what the client still sends for a while: closing a socket with
        // unread data resets it, and a reset can destroy the reply before the client has read it.
        void linger() {
            if (srv.stopping_) return close();
            ph = phase::closing;
            asio::error_code ec;
            sock.shutdown(tcp::socket::shutdown_send, ec);
            if (ec) return close();
            set_deadline(LINGER_S);
            read_more();
        }

        void close() {
            if (!registered) return;
            registered = false;
            guard->close_now();
            asio::error_code ec;
            timer.cancel();
            sock.close(ec);
            srv.unregister(this);
        }
    };

    // ---- accepting

    void accept() {
        acceptor_.async_accept([this](const asio::error_code& ec, tcp::socket s) { on_accept(ec, std::move(s)); });
    }

    void on_accept(const asio::error_code& ec, tcp::socket s) {
        if (stopping_) return;
        if (ec) {
            if (ec == asio::error::operation_aborted) return;
            if (ec == asio::error::no_descriptors || ec.value() == ENFILE || ec == asio::error::no_buffer_space) {
                retry_timer_.expires_after(std::chrono::milliseconds(50));  // out of descriptors: let some close
                retry_timer_.async_wait([this](const asio::error_code& e) {
                    if (!e && !stopping_) accept();
                });
                return;
            }
            return accept();
        }
        accept();
        asio::error_code e;
        const tcp::endpoint peer = s.remote_endpoint(e);
        if (e) return;
        std::string addr = peer.address().to_string();
        s.set_option(tcp::no_delay(true), e);
        int& n_addr = per_addr_[addr];
        if ((int)conns_.size() >= opt_.max_connections || n_addr >= opt_.max_connections_per_addr) {
            if (n_addr == 0) per_addr_.erase(addr);
            reject(std::move(s), (int)conns_.size() >= opt_.max_connections ? "too many connections"
                                                                            : "too many connections from " + addr);
            return;
        }
        n_addr++;
        auto c = std::make_shared<conn>(*this, std::move(s), std::move(addr), (int)peer.port());
        conns_.insert(c.get());
        c->start();
    }

    // 503 + Retry-After to a connection over the limits, written without reading its request.
    void reject(tcp::socket s, const std::string& why) {
        if (rejects_pending_ >= MAX_PENDING_REJECTS) return;  // s closes here
        struct rejected {
            tcp::socket sock;
            asio::steady_timer timer;
            std::string data;
            int* pending;
            rejected(tcp::socket so, asio::io_context& io, std::string d, int* p)
                : sock(std::move(so)), timer(io), data(std::move(d)), pending(p) {
                ++*pending;
            }
            ~rejected() { --*pending; }
        };
        const std::string body = error_body_(503, why + "; retry later");
        auto r = std::make_shared<rejected>(
            std::move(s), io_,
            response_head(503, "application/json", (int64_t)body.size(), false, {{"Retry-After", "1"}}) + body,
            &rejects_pending_);
        r->timer.expires_after(std::chrono::seconds(1));
        r->timer.async_wait([r](const asio::error_code& ec) {
            if (!ec) r->sock.close();
        });
        asio::async_write(r->sock, asio::buffer(r->data), [this, r](const asio::error_code& ec, size_t) {
            asio::error_code e;
            r->sock.shutdown(tcp::socket::shutdown_send, e);
            if (ec || e) return r->timer.cancel(), r->sock.close(e);
            drain(r);  // until the client closes or the timer fires: a close with unread data would reset the 503
        });
    }

    template <class R>
    void drain(std::shared_ptr<R> r) {
        static std::array<char, 4096> sink;  // discarded bytes; only the I/O thread reads into it
        r->sock.async_read_some(asio::buffer(sink), [this, r](const asio::error_code& ec, size_t) {
            if (!ec) return drain(r);
            asio::error_code e;
            r->timer.cancel();
            r->sock.close(e);
        });
    }

    void unregister(conn* c) {
        conns_.erase(c);
        auto it = per_addr_.find(c->addr);
        if (it != per_addr_.end() && --it->second <= 0) per_addr_.erase(it);
        maybe_finish();
    }

    void begin_stop() {
        if (stopping_) return;
        stopping_ = true;
        asio::error_code ec;
        acceptor_.close(ec);
        retry_timer_.cancel();
        // connections not inside a handler are closed now; the others close when their response is written
        std::vector<std::shared_ptr<conn>> idle;
        for (conn* c : conns_)
            if (c->ph != conn::phase::handling) idle.push_back(c->shared_from_this());
        for (auto& c : idle) c->close();
        maybe_finish();
    }

    void maybe_finish() {
        if (stopping_ && conns_.empty()) work_.reset();  // io_.run() returns once the rest of its work is done
    }

    // ---- on a worker thread: the handler and its response. Returns whether the connection may be kept.
    bool handle(http_request& r, int fd, bool keep, bool http10,
                const std::vector<std::pair<std::string, std::string>>& cors) {
        const http_handler* h = find_route(r.method, r.path);
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
        log(r, out.status);
        keep = keep && !stop_requested_;  // stop() came while the handler ran: this is the connection's last response
        std::vector<std::pair<std::string, std::string>> hs = std::move(out.headers);
        hs.insert(hs.end(), cors.begin(), cors.end());
        const int timeout_ms = (int)(opt_.write_timeout_s * 1000);
        if (!out.stream) {
            const std::string data =
                response_head(out.status, out.content_type, (int64_t)out.body.size(), keep, hs) + out.body;
            return send_all(fd, data, timeout_ms) && keep;
        }
        // note: an HTTP/1.0 client cannot read chunks: its stream is the raw body, ended by closing
        const bool chunked = !http10;
        keep = keep && chunked;
        bool ok = send_all(fd, response_head(out.status, out.content_type, chunked ? -1 : -2, keep, hs), timeout_ms);
        http_write_fn write = [&](std::string_view chunk) {
            if (!ok) return false;
            if (chunk.empty()) return true;  // an empty chunk would end the response early
            if (!chunked) return ok = send_all(fd, chunk, timeout_ms);
            char size[32];
            snprintf(size, sizeof size, "%zx\r\n", chunk.size());
            std::string piece;
            piece.reserve(chunk.size() + 16);
            piece.append(size).append(chunk).append("\r\n");
            return ok = send_all(fd, piece, timeout_ms);
        };
        try {
            out.stream(write);
        } catch (...) {
            // a stream function must not throw; if it does, the response ends here, and so does the connection
            return false;
        }
        if (ok && chunked) ok = send_all(fd, "0\r\n\r\n", timeout_ms);
        return ok && keep;
    }
};

http_server::http_server(const http_options& opt) : impl_(std::make_unique<impl>(opt)) {}

http_server::~http_server() {
    if (impl_) stop();
}

void http_server::route(const std::string& method, const std::string& path, http_handler h) {
    impl_->routes_[route_key{method, path}] = std::move(h);
}

void http_server::set_error_body(std::function<std::string(int, const std::string&)> f) {
    impl_->error_body_ = std::move(f);
}

void http_server::set_logger(std::function<void(const http_request&, int)> f) { impl_->logger_ = std::move(f); }

void http_server::bind() {
    impl& m = *impl_;
    http_options& o = m.opt_;
    // Every connection is a descriptor: raise the soft limit toward the hard one, and keep the cap under it.
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        const rlim_t want = (rlim_t)o.max_connections + MAX_PENDING_REJECTS + 256;
        if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
            rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? want : std::min(want, rl.rlim_max);
            setrlimit(RLIMIT_NOFILE, &rl);
            getrlimit(RLIMIT_NOFILE, &rl);
        }
        if (rl.rlim_cur != RLIM_INFINITY && (rlim_t)o.max_connections + MAX_PENDING_REJECTS + 256 > rl.rlim_cur) {
            const int cap = std::max(16, (int)rl.rlim_cur - MAX_PENDING_REJECTS - 256);
            fprintf(stderr, "tansy serve: open-file limit %llu: at most %d connections\n",
                    (unsigned long long)rl.rlim_cur, cap);
            o.max_connections = cap;
        }
    }
    asio::error_code ec;
    asio::ip::address addr = asio::ip::make_address(o.host, ec);
    if (ec) {  // a host name: the first address it resolves to
        tcp::resolver res(m.io_);
        auto rs = res.resolve(o.host, std::to_string(o.port), ec);
        if (ec || rs.empty()) fail("serve: cannot resolve %s: %s", o.host.c_str(), ec.message().c_str());
        addr = rs.begin()->endpoint().address();
    }
    const tcp::endpoint ep(addr, (unsigned short)o.port);
    m.acceptor_.open(ep.protocol(), ec);
    if (!ec) m.acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) m.acceptor_.bind(ep, ec);
    if (!ec) m.acceptor_.listen(std::max(1, o.backlog), ec);
    if (ec) {
        asio::error_code e2;
        m.acceptor_.close(e2);
        if (o.port == 0) fail("serve: cannot bind to %s (any port): %s", o.host.c_str(), ec.message().c_str());
        fail("serve: cannot bind to %s:%d (%s)", o.host.c_str(), o.port, ec.message().c_str());
    }
    m.port_ = m.acceptor_.local_endpoint().port();
}

int http_server::port() const { return impl_->port_; }

void http_server::run() {
    impl& m = *impl_;
    if (m.stop_requested_ || !m.acceptor_.is_open()) return;
    m.work_.emplace(m.io_.get_executor());
    m.pool_.start(std::max(1, m.opt_.threads));
    m.accept();
    for (;;) {
        try {
            m.io_.run();
            break;
        } catch (const std::exception& e) {  // our handlers do not throw; keep serving if one ever does
            fprintf(stderr, "tansy serve: I/O error: %s\n", e.what());
        }
    }
    m.pool_.stop_and_join();
}

void http_server::stop() {
    if (!impl_) return;
    impl_->stop_requested_ = true;
    impl* m = impl_.get();
    asio::post(m->io_, [m] { m->begin_stop(); });
}

}  // namespace tansy
