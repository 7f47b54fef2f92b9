#include "server/load_progress.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "server/metrics.h"

namespace tansy {

load_progress::load_progress(const std::string& dir, bool enabled)
    : enabled_(enabled), tty_(isatty(2)), t0_(std::chrono::steady_clock::now()) {
    if (!enabled_) return;
    std::error_code ec;
    name_ = std::filesystem::path(dir).filename().string();
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
        if (e.path().extension() == ".safetensors") total_ += (uint64_t)e.file_size(ec);
    rss0_ = process_rss_bytes();
    if (!tty_) {
        fprintf(stderr, "tansy serve: loading %s (%.2f GiB of weights)\n", dir.c_str(), (double)total_ / (1u << 30));
        return;
    }
    thread_ = std::thread([this] {
        while (!stop_) {
            const uint64_t rss = process_rss_bytes();
            const double f = total_ ? (double)(rss > rss0_ ? rss - rss0_ : 0) / (double)total_ : 0.0;
            draw(std::min(f, 0.99), false);
            for (int i = 0; i < 10 && !stop_; i++) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    });
}

void load_progress::draw(double f, bool final) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    constexpr int width = 30;
    char bar[width + 1];
    for (int i = 0; i < width; i++) bar[i] = i < (int)(f * width + 0.5) ? '#' : '-';
    bar[width] = 0;
    fprintf(stderr, "\rtansy serve: loading %s [%s] %3d%%  %.2f GiB  %.1f s%s", name_.c_str(), bar, (int)(f * 100 + 0.5),
            (double)total_ / (1u << 30), s, final ? "\n" : "");
    fflush(stderr);
}

void load_progress::done() {
    if (!enabled_ || stop_.exchange(true)) return;
    if (thread_.joinable()) thread_.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (tty_) draw(1.0, true);
    else fprintf(stderr, "tansy serve: loaded in %.2f s\n", s);
}

load_progress::~load_progress() {
    if (!enabled_ || stop_.exchange(true)) return;
    if (thread_.joinable()) thread_.join();
    if (tty_) fputs("\n", stderr);
}

}  // namespace tansy
