// Decode timeline, a measuring build only (cmake -DTANSY_TIMELINE=ON; off by default, and then none of this is
// compiled): thread 0 of every block of every PDL kernel stamps the GPU's globaltimer when the block starts
// (pdl_trigger) and when its wait returns (pdl_wait), with the launch's %gridid and the SM. With
// TANSY_TIMELINE=FILE in the environment the CUDA backend keeps the stamps of the last ~k_grids launches and the
// names of its PDL launches in order, and writes both to FILE at exit; scripts/timeline.py lines them up into one
// decode step: when each kernel's blocks became resident and when its wait returned, i.e. what each kernel
// costs inside the graph, which Nsight Compute (kernels alone) cannot say and this device has no Nsight Systems.
// Why these stamps: the decode kernels are latency chains whose blocks mostly cannot start until the previous
// kernel's leave their SM (PERF.md), so "resident at" and "released at" are the two times that matter.
// The stamp is a plain store into a slot chosen from (gridid, block): no atomic, so thread 0 is not held up.
#pragma once
#if defined(TANSY_TIMELINE)
#include <cuda_runtime.h>

#include <cstdint>

namespace tansy::cuda::timeline {

struct rec {
    uint64_t t;     // globaltimer, ns
    uint64_t grid;  // %gridid of the launch
    uint32_t block; // linear block index
    uint32_t sm_ev; // smid << 1 | event (0: block start, 1: wait returned)
};
constexpr int k_grids = 1024, k_blocks = 256;  // slots: (gridid % k_grids, block < k_blocks, event)
constexpr size_t k_slots = (size_t)k_grids * k_blocks * 2;

using setter = void (*)(rec*);
void register_tu(setter s);  // each translation unit's buffer pointer (timeline.cu)
void note_launch(const void* kernel, dim3 grid);  // host: a stamping launch, in order (its name and grid)
void note(const char* marker);         // host: a marker in the launch list (a graph capture's start)

namespace {
// per translation unit (no relocatable device code): every one points at the same buffer once enabled
__constant__ rec* g_buf;
void set_buf(rec* b) { cudaMemcpyToSymbol(g_buf, &b, sizeof b); }
[[maybe_unused]] const bool g_registered = (register_tu(&set_buf), true);
}  // namespace

__device__ __forceinline__ void mark(int ev) {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    rec* b = g_buf;
    if (!b) return;
    const uint32_t blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (blk >= (uint32_t)k_blocks) return;
    uint64_t t, g;
    uint32_t sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm("mov.u64 %0, %%gridid;" : "=l"(g));
    asm("mov.u32 %0, %%smid;" : "=r"(sm));
    b[((g % k_grids) * k_blocks + blk) * 2 + ev] = rec{t, g, blk, sm << 1 | (uint32_t)ev};
#endif
}

}  // namespace tansy::cuda::timeline
#endif
