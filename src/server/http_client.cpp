// http_client over cpp-httplib's client (the Debian build, 0.11).
#include "server/http_client.h"

#include <httplib.h>

namespace tansy {

class http_client::impl {
  public:
    impl(const std::string& host, int port, int timeout_s) : cli(host, port) {
        cli.set_connection_timeout(timeout_s, 0);
        cli.set_read_timeout(timeout_s, 0);
        cli.set_write_timeout(timeout_s, 0);
        cli.set_keep_alive(true);
        cli.set_tcp_nodelay(true);
    }
    httplib::Client cli;
};

http_client::http_client(const std::string& host, int port, int timeout_s)
    : impl_(std::make_unique<impl>(host, port, timeout_s)) {}
http_client::~http_client() = default;

int http_client::post(const std::string& path, const std::string& json_body, const http_body_fn& on_body,
                      std::string* error) {
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = json_body;
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        return on_body(std::string_view(data, n));
    };
    const httplib::Result res = impl_->cli.send(req);
    if (!res) {
        if (error) *error = httplib::to_string(res.error());
        return -1;
    }
    return res->status;
}

int http_client::get(const std::string& path, std::string* body, std::string* error) {
    const httplib::Result res = impl_->cli.Get(path.c_str());
    if (!res) {
        if (error) *error = httplib::to_string(res.error());
        return -1;
    }
    if (body) *body = res->body;
    return res->status;
}

}  // namespace tansy
