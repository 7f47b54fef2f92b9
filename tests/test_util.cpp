#include "test_util.h"

#include "server/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>

namespace tansy::test {

namespace fs = std::filesystem;

std::string shared_fixtures_dir() {
    if (const char* env = std::getenv("TANSY_SHARED_FIXTURES"); env && *env) return fs::exists(env) ? env : "";
    fs::path p = fs::path(TANSY_SOURCE_DIR).parent_path() / "shared" / "fixtures";
    return fs::exists(p) ? p.string() : "";
}

std::string fixture(const std::string& name) {
    fs::path committed = fs::path(TANSY_SOURCE_DIR) / "tests" / "fixtures" / name;
    if (fs::exists(committed)) return committed.string();
    fs::path unpacked = fs::path(TANSY_BINARY_DIR) / "fixtures" / name;  // from tests/fixtures/*.tar.xz
    if (fs::exists(unpacked)) return unpacked.string();
    std::string shared = shared_fixtures_dir();
    if (!shared.empty() && fs::exists(fs::path(shared) / name)) return (fs::path(shared) / name).string();
    return "";
}

namespace {
std::mutex g_tmp_mu;
std::vector<std::string> g_tmp_dirs;
struct tmp_cleanup {
    ~tmp_cleanup() {
        for (const auto& d : g_tmp_dirs) {
            std::error_code ec;
            fs::remove_all(d, ec);
        }
    }
} g_cleanup;
}  // namespace

std::string temp_dir(const std::string& tag) {
    std::string tmpl = (fs::temp_directory_path() / ("tansy-" + tag + "-XXXXXX")).string();
    char* d = mkdtemp(tmpl.data());
    if (!d) {
        ADD_FAILURE() << "mkdtemp failed";
        return "/tmp";
    }
    std::lock_guard<std::mutex> lk(g_tmp_mu);
    g_tmp_dirs.push_back(d);
    return d;
}

std::vector<float> random_uniform(size_t n, uint32_t seed, float lo, float hi) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
}

std::vector<float> random_normal(size_t n, uint32_t seed, float stddev) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, stddev);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); i++) {
        const double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); i++) m = std::max(m, std::fabs((double)a[i] - b[i]));
    return m;
}

int run_command(const std::string& cmd, std::string* output, bool merge_stderr) {
    std::string full = merge_stderr ? cmd + " 2>&1" : cmd;
    FILE* p = popen(full.c_str(), "r");
    if (!p) return -1;
    char buf[4096];
    std::string out;
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    int st = pclose(p);
    if (output) *output = out;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int connect_loopback(int port) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (sockaddr*)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

json_reply post_json(int port, const std::string& path, const std::string& body) {
    http_client c("127.0.0.1", port, 60);
    std::string text, err;
    json_reply r;
    r.status = c.post(path, body, [&](std::string_view p) { text += p; return true; }, &err);
    r.body = nlohmann::json::parse(text, nullptr, false);
    return r;
}

json_reply get_json(int port, const std::string& path) {
    http_client c("127.0.0.1", port, 60);
    std::string text, err;
    json_reply r;
    r.status = c.get(path, &text, &err);
    r.body = nlohmann::json::parse(text, nullptr, false);
    return r;
}

}  // namespace tansy::test
