// Weight tiles streamed through a shared-memory ring (device code; included by the decode kernels).
// Why: a decode GEMV that loads weights into registers keeps only a few KB per warp in flight and waits a full
// DRAM round trip per round; at 2-14 MB per kernel that caps a decode kernel at 0.5-1 TB/s (docs/PERF.md).
// cp.async copies into shared memory cost no registers, so a block queues all the tiles of its
// share up to the ring size (~80 KB per SM) at once, before it even waits for the previous kernel (PDL).
//
// Protocol (one block): ring_start issues tiles 0..S-2, each as its own cp.async group; ring_run, for each tile
// j, issues tile j+S-1 into the slot freed by tile j-1, waits for tile j's group and calls consume(j). Every
// thread of the block must call both (they contain barriers).
#pragma once
#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"

namespace tansy::cuda {

// One block per SM. 16 warps where the registers allow (<= 128 per thread): the kernels are bound by instruction
// latency, and 8 warps per SM (2 per scheduler) leave the issue slots mostly idle (by the source counters).
constexpr int k_stream_threads = 512;
constexpr int k_stream_threads_wide = 256;  // for inputs held in > 64 registers per lane

__host__ __device__ inline int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }

// Copies `bytes` (a multiple of 4) from global to shared memory with the whole block: 16 bytes per cp.async
// when both ends and the size allow it, else 4 (e.g. scale/bias rows of a few groups).
__device__ __forceinline__ void block_copy_async(void* dst, const void* src, int64_t bytes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    if ((((uintptr_t)d | (uintptr_t)s | (uintptr_t)bytes) & 15) == 0) {
        for (int64_t i = 16 * (int64_t)threadIdx.x; i < bytes; i += 16 * (int64_t)blockDim.x) cp_async16(d + i, s + i);
    } else {
        for (int64_t i = 4 * (int64_t)threadIdx.x; i < bytes; i += 4 * (int64_t)blockDim.x) cp_async4_zfill(d + i, s + i, true);
    }
}

// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) with the 32 lanes of a warp, 16 bytes per cp.async
// (gemv_warp_kernel's ring). note: the MoE per-warp kernels issue fixed per-lane copies instead; there this loop
// costs 3-5% (docs/PERF.md), while the same change in gemv_warp_kernel measured slower.
__device__ __forceinline__ void warp_copy_async(void* dst, const void* src, int bytes) {
    for (int i = 16 * (int)(threadIdx.x % 32); i < bytes; i += 16 * 32)
        cp_async16(static_cast<char*>(dst) + i, static_cast<const char*>(src) + i);
}

// Tiles 0..S-2 (as many as exist), one commit group each (empty groups keep the count aligned).
template <int S, class Issue>
__device__ __forceinline__ void ring_start(int n, int first, Issue&& issue) {
    for (int j = first; j < S - 1; j++) {
        if (j < n) issue(j);
        cp_async_commit();
    }
}

template <int S, class Issue, class Consume>
__device__ __forceinline__ void ring_run(int n, Issue&& issue, Consume&& consume) {
    for (int j = 0; j < n; j++) {
        if (j + S - 1 < n) issue(j + S - 1);  // into the slot tile j-1 used (freed by the barrier below)
        cp_async_commit();
        cp_async_wait<S - 1>();  // tile j's group has landed (this thread's copies)
        __syncthreads();         // ... and everyone else's
        consume(j);
        __syncthreads();  // slot j % S is read before tile j+S is issued into it
    }
}

// The per-warp form of ring_run (gemv_warp_kernel, gate_up_warp_kernel, down_warp_kernel): a warp's rows 0..n-1
// through its own S slots, rows 0..S-2 issued beforehand by ring_start, one commit group each (empty ones where
// rows run out). The warp waits only for its own rows: cp.async groups and __syncwarp, no block barrier.
template <int S, class Issue, class Consume>
__device__ __forceinline__ void warp_ring_run(int n, Issue&& issue, Consume&& consume) {
    for (int i = 0; i < n; i++) {
        if (i + S - 1 < n) issue(i + S - 1);  // into the slot row i-1 used (freed by the __syncwarp below)
        cp_async_commit();
        cp_async_wait<S - 1>();  // row i has landed (this lane's copies)
        __syncwarp();            // ... and the other lanes'
        consume(i);
        __syncwarp();  // the slot is read before row i+S is issued into it
    }
}

// Tiles of the block when tiles t = blockIdx.x + j * gridDim.x (j = 0, 1, ...) of `total` are its own.
__device__ __forceinline__ int block_tiles(int64_t total) {
    return total > blockIdx.x ? (int)((total - blockIdx.x + gridDim.x - 1) / gridDim.x) : 0;
}

// Tile j of this block (tiles of tr rows out of n_rows, block-strided as in block_tiles): its first row in r0,
// its row count returned.
__device__ __forceinline__ int block_tile_rows(int j, int tr, int64_t n_rows, int64_t& r0) {
    r0 = (blockIdx.x + (int64_t)j * gridDim.x) * tr;
    return (int)min((int64_t)tr, n_rows - r0);
}

}  // namespace tansy::cuda

namespace tansy::cuda {

// Host side: how a streamed kernel cuts its rows into tiles.
struct stream_plan {
    int rows_per_tile = 1;
    int64_t slot_bytes = 0;  // one ring slot
    int64_t tiles = 0;
    size_t smem = 0;  // dynamic shared memory: fixed part + S slots
};

// Dynamic shared memory of a per-warp-ring kernel (k_stream_threads): the staged input, then each warp's S slots.
inline size_t warp_ring_smem(int64_t stage_bytes, int slots, int64_t slot_bytes) {
    return (size_t)align16(stage_bytes) + (size_t)(k_stream_threads / 32) * (size_t)slots * (size_t)slot_bytes;
}

// Dynamic shared memory a streamed kernel may use: the device's opt-in limit less room for the kernels' static
// shared memory (the norm prologue's 2 KB and a few words).
inline size_t stream_smem_limit() { return max_dynamic_smem() - 4096; }

// A block's ring holds up to ~120 KB: the whole share of a 14 MB projection per SM (132 SMs), so that every
// byte of a typical decode kernel is requested at once. note: with that ring and 16 warps of <= 128 registers
// a block fills its SM (registers, and shared memory for a second block), so the next kernel's blocks are
// placed as this kernel's blocks exit: its weight prefetch before pdl_wait overlaps this kernel's tail, not
// all of it. (8 warps per SM would leave room for both, but lose more to instruction latency: measured,
// docs/PERF.md.) Tiles hold a multiple of the warp count of rows when they can, and are small enough that `blocks`
// blocks all get one; at most max_rows. slot_bytes_of(rows) gives a slot's size for that many rows (16-byte aligned).
template <int S, class SlotBytes>
stream_plan plan_stream(int64_t rows, int64_t blocks, size_t fixed_smem, int threads, SlotBytes&& slot_bytes_of,
                        int64_t ring_budget = 120 * 1024, int64_t max_rows = 64) {
    const int64_t budget = (std::min<int64_t>(ring_budget, (int64_t)stream_smem_limit()) - (int64_t)fixed_smem) / S;
    const int warps = threads / 32;
    int64_t tr = 1;
    while (2 * tr <= max_rows && slot_bytes_of(2 * tr) <= budget) tr *= 2;
    const int64_t fair = std::max<int64_t>(1, (rows + blocks - 1) / blocks);  // rows per block when spread evenly
    if (tr > fair) tr = fair >= warps ? fair / warps * warps : fair;
    TANSY_CHECK(slot_bytes_of(tr) <= budget, "streamed kernel: a %lld-byte row does not fit the ring",
                (long long)slot_bytes_of(1));
    stream_plan p;
    p.rows_per_tile = (int)tr;
    p.slot_bytes = slot_bytes_of(tr);
    p.tiles = (rows + tr - 1) / tr;
    p.smem = fixed_smem + (size_t)S * (size_t)p.slot_bytes;
    return p;
}


}  // namespace tansy::cuda
