// Decode timeline (timeline.cuh): the host side. Without TANSY_TIMELINE only timeline_start/stop exist, and
// only say that the build has no timeline when one is asked for.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/timeline_host.h"

namespace tansy::cuda {

#if defined(TANSY_TIMELINE)
namespace timeline {
namespace {
struct state {
    std::mutex mu;
    std::vector<setter> setters;
    std::vector<std::string> launches;  // names of PDL launches (and markers), in order, the last k_keep
    rec* buf = nullptr;
    std::string path;
};
state& st() {
    static state s;  // (function-local: the translation units register during static initialisation)
    return s;
}
constexpr size_t k_keep = 1 << 16;
}  // namespace

void register_tu(setter s) {
    std::lock_guard<std::mutex> lock(st().mu);
    st().setters.push_back(s);
    if (st().buf) s(st().buf);
}

void note_launch(const void* kernel, dim3 grid) {
    if (!st().buf) return;
    const char* name = nullptr;
    if (cudaFuncGetName(&name, kernel) != cudaSuccess || !name) name = "?";
    note((std::string(name) + " " + std::to_string(grid.x * grid.y * grid.z)).c_str());
}

void note(const char* marker) {
    if (!st().buf) return;
    std::lock_guard<std::mutex> lock(st().mu);
    if (st().launches.size() >= k_keep) st().launches.erase(st().launches.begin(), st().launches.begin() + k_keep / 2);
    st().launches.emplace_back(marker);
}
}  // namespace timeline

void timeline_start() {
    using namespace timeline;
    const char* path = std::getenv("TANSY_TIMELINE");
    if (!path || !*path || st().buf) return;
    std::lock_guard<std::mutex> lock(st().mu);
    CUDA_CHECK(cudaMalloc(&st().buf, k_slots * sizeof(rec)));
    CUDA_CHECK(cudaMemset(st().buf, 0, k_slots * sizeof(rec)));
    st().path = path;
    for (setter s : st().setters) s(st().buf);
    std::fprintf(stderr, "tansy: recording the decode timeline into %s (%zu translation units)\n", path,
                 st().setters.size());
}

void timeline_stop() {
    using namespace timeline;
    if (!st().buf) return;
    std::lock_guard<std::mutex> lock(st().mu);
    std::vector<rec> h(k_slots);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), st().buf, k_slots * sizeof(rec), cudaMemcpyDeviceToHost));
    FILE* f = std::fopen(st().path.c_str(), "w");
    if (!f) {
        std::fprintf(stderr, "tansy: cannot write the timeline to %s\n", st().path.c_str());
    } else {
        // "L name blocks" lines: the stamping launches in order ("L #capture", "L #end": a graph capture's
        // bounds); "R grid block sm event t" lines: the stamps
        for (const std::string& n : st().launches) std::fprintf(f, "L %s\n", n.c_str());
        size_t n_rec = 0;
        for (const rec& r : h)
            if (r.t) std::fprintf(f, "R %llu %u %u %u %llu\n", (unsigned long long)r.grid, r.block, r.sm_ev >> 1, r.sm_ev & 1,
                                  (unsigned long long)r.t), n_rec++;
        std::fclose(f);
        std::fprintf(stderr, "tansy: timeline: %zu launches, %zu stamps in %s\n", st().launches.size(), n_rec,
                     st().path.c_str());
    }
    for (setter s : st().setters) s(nullptr);
    cudaFree(st().buf);
    st().buf = nullptr;
}

void timeline_mark(const char* marker) { timeline::note(marker); }
#else
void timeline_start() {
    const char* path = std::getenv("TANSY_TIMELINE");
    if (path && *path) std::fprintf(stderr, "tansy: TANSY_TIMELINE is set, but this build has no timeline (cmake -DTANSY_TIMELINE=ON)\n");
}
void timeline_stop() {}
void timeline_mark(const char*) {}
#endif

}  // namespace tansy::cuda
