// http_server when tansy is built without Asio's header (libasio-dev): bind() fails with the reason.
#include "server/http.h"

#include "core/check.h"

namespace tansy {

bool http_available() { return false; }

class http_server::impl {};

http_server::http_server(const http_options&) {}
http_server::~http_server() = default;
void http_server::route(const std::string&, const std::string&, http_handler) {}
void http_server::set_error_body(std::function<std::string(int, const std::string&)>) {}
void http_server::set_logger(std::function<void(const http_request&, int)>) {}
void http_server::bind() {
    fail("serve: this tansy was built without Asio (install libasio-dev and rebuild)");
}
int http_server::port() const { return -1; }
void http_server::run() {}
void http_server::stop() {}

}  // namespace tansy
