// Device-side layout of per-sequence state and of a batch, shared by the kernels and the backend.
#pragma once
#include <cstdint>

namespace tansy::cuda {

// One sequence's state lives in one allocation:
//   kv    [n_attn][2 (K, V)][capacity][Hkv*dh] bf16 (K after norm + RoPE, V raw), or with an FP8 cache
//         (dshape::kv8) E4M3 codes, followed by
//   kv_scale [n_attn][2][capacity][Hkv] fp32: the power-of-two scale of each (position, KV head) (core/fp8.h)
//   conv  [n_gdn][2 (parity)][K-1][C] fp32  raw pre-conv inputs, oldest first; read parity steps&1, write the other
//   S     [n_gdn][Hv][dk][dv] fp32, or bf16 (dshape::s16: rounded where a span's state is stored; the kernels
//         compute in fp32 either way)
//   meta  [0] = n_past (tokens processed), [1] = steps (forward steps taken)
struct dseq {
    uint16_t* kv = nullptr;       // bf16 values, or E4M3 codes (dshape::kv8): kv8_k / kv8_v
    float* kv_scale = nullptr;    // FP8 cache only
    float* conv = nullptr;
    void* S = nullptr;            // float, or __nv_bfloat16 (dshape::s16): s_buf<T>
    int32_t* meta = nullptr;
};

struct dshape {
    int64_t capacity = 0, kvd = 0;            // KV cache rows and Hkv*dh
    int64_t hkv = 0;                          // KV heads (the scales per row of an FP8 cache)
    bool kv8 = false;                         // FP8 E4M3 cache with per-(row, KV head) scales
    int64_t conv_rows = 0, conv_ch = 0;       // K-1, C
    int64_t s_elems = 0;                      // Hv*dk*dv per layer
    bool s16 = false;                         // the DeltaNet state S in bf16 (backend_options::state_bf16)
};

// Batch rows on the device: for row r, the sequence it belongs to and its offset within that sequence's span.
struct drow {
    int32_t seq, offset;
};

// A sequence's span in the batch.
struct dspan {
    int32_t row0, n;
    int32_t mark = 0;  // > 0: the recurrent state after the span's first `mark` rows also goes to a checkpoint
};

#if defined(__CUDACC__)
__host__ __device__ inline uint16_t* kv_k(const dseq& s, const dshape& d, int slot) {
    return s.kv + (size_t)(2 * slot) * d.capacity * d.kvd;
}
__host__ __device__ inline uint16_t* kv_v(const dseq& s, const dshape& d, int slot) {
    return s.kv + (size_t)(2 * slot + 1) * d.capacity * d.kvd;
}
// The FP8 cache (d.kv8): codes and scales of layer `slot`.
__host__ __device__ inline uint8_t* kv8_k(const dseq& s, const dshape& d, int slot) {
    return reinterpret_cast<uint8_t*>(s.kv) + (size_t)(2 * slot) * d.capacity * d.kvd;
}
__host__ __device__ inline uint8_t* kv8_v(const dseq& s, const dshape& d, int slot) {
    return reinterpret_cast<uint8_t*>(s.kv) + (size_t)(2 * slot + 1) * d.capacity * d.kvd;
}
__host__ __device__ inline float* kv8_ks(const dseq& s, const dshape& d, int slot) {
    return s.kv_scale + (size_t)(2 * slot) * d.capacity * d.hkv;
}
__host__ __device__ inline float* kv8_vs(const dseq& s, const dshape& d, int slot) {
    return s.kv_scale + (size_t)(2 * slot + 1) * d.capacity * d.hkv;
}
__host__ __device__ inline float* conv_buf(const dseq& s, const dshape& d, int slot, int parity) {
    return s.conv + ((size_t)(2 * slot + parity)) * d.conv_rows * d.conv_ch;
}
// Layer `slot`'s state as TS: float, or __nv_bfloat16 where d.s16 (the kernels are instantiated for both).
template <class TS>
__host__ __device__ inline TS* s_buf(const dseq& s, const dshape& d, int slot) {
    return static_cast<TS*>(s.S) + (size_t)slot * d.s_elems;
}
#endif

}  // namespace tansy::cuda
