// Key/value tiles of the bf16 KV cache into shared memory (device code), shared by the flash-attention prefill
// kernel and the tensor-core decode split kernel.
#pragma once
#include "backend/cuda/mma.cuh"

namespace tansy::cuda {

// One key tile (BN rows of DH bf16, row stride kvd in the cache) into shared memory; keys >= n_keys are
// zero-filled, never read (they may lie past the cache's capacity, and zeros keep 0 * V finite).
template <int DH, int THREADS, int BN>
__device__ __forceinline__ void load_kv_tile(uint16_t* dst, const uint16_t* src, int64_t kvd, int k0, int n_keys) {
    constexpr int CHUNKS = DH / 8;          // 16-byte chunks per row
    constexpr int ROWS = THREADS / CHUNKS;  // rows per pass; a warp copies whole rows (coalesced)
    static_assert(THREADS % CHUNKS == 0 && BN % ROWS == 0, "whole rows per pass");
    // note: one running source pointer; per-pass 64-bit offsets kept in registers cost 400 bytes of spills
    const int jt = threadIdx.x / CHUNKS, d = (threadIdx.x % CHUNKS) * 8;
    const uint16_t* s = src + (int64_t)(k0 + jt) * kvd + d;
    uint16_t* t = dst + jt * (DH + 8) + d;
#pragma unroll
    for (int it = 0; it < BN / ROWS; it++) {
        const bool ok = k0 + jt + it * ROWS < n_keys;
        cp_async16_zfill(t + it * ROWS * (DH + 8), ok ? s : src, ok);
        s += ROWS * kvd;
    }
}

}  // namespace tansy::cuda
