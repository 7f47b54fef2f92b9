// Shared CUDA helpers: error checking, warp/block reductions, bf16 conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <utility>
#include <cuda_runtime.h>

#include "core/check.h"

#define CUDA_CHECK(expr)                                                                                   \
    do {                                                                                                   \
        cudaError_t err_ = (expr);                                                                         \
        if (err_ != cudaSuccess) {                                                                         \
            int dev_ = -1;                                                                                 \
            cudaGetDevice(&dev_);                                                                          \
            ::tansy::abort_at(__FILE__, __LINE__, #expr, "CUDA error %s (%s) on device %d",              \
                              cudaGetErrorName(err_), cudaGetErrorString(err_), dev_);                    \
        }                                                                                                  \
    } while (0)

// After every launch: launch-configuration errors surface here, not at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace tansy::cuda {

// ---- weight formats on the device (see weights_dev.h)
enum class dfmt : uint8_t { q4, q8, bf16 };

}  // namespace tansy::cuda

// Everything below is device code: visible to nvcc only (tests include the .cuh launchers from plain C++).
#if defined(__CUDACC__)
namespace tansy::cuda {

// Programmatic dependent launch (sm_90): a kernel launched with launch_pdl() may start while the previous
// kernel in the stream is still running; it must call pdl_wait() before touching anything that kernel wrote
// (and always, before it exits). pdl_trigger() lets the next PDL kernel be scheduled early. Both are no-ops
// below sm_90.
// note: the chain is transitive: every kernel triggers first, so before its pdl_wait a kernel may run alongside
// any kernel launched since the stream's last plain (non-PDL) launch. What it reads before pdl_wait must not be
// written by any of those: weights, and state written only in earlier decode steps (steps are separated by
// plain launches: embed, advance). Nor by the last plain launch itself: PTX promises a prerequisite grid's
// writes visible only after griddepcontrol.wait (pdl_wait), not when its dependents start.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets Kernel use `bytes` (> 48 KB) of dynamic shared memory: once per kernel, thread-safe (static init).
template <auto Kernel>
void allow_dynamic_smem(size_t bytes) {
    static const bool done = [bytes] {
        CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        return true;
    }();
    (void)done;
}

// The most dynamic shared memory one block may opt into on the current device (227 KB on sm_90).
inline size_t max_dynamic_smem() {
    static const size_t bytes = [] {
        int dev = 0, v = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        return (size_t)v;
    }();
    return bytes;
}

// Streaming multiprocessors of the current device.
inline int sm_count() {
    static const int n = [] {
        int dev = 0, v = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
        return v;
    }();
    return n;
}

template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr, cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

}  // namespace tansy::cuda

namespace tansy::cuda {

// Values per 16-byte chunk of a weight row.
template <dfmt F>
constexpr int chunk_values() {
    return F == dfmt::q4 ? 32 : F == dfmt::q8 ? 16 : 8;
}

// note: 2^23 + v has v in its low mantissa bits, so building that float from a byte with one byte_perm and
// subtracting 2^23 converts a 4/8-bit integer to float exactly, without the slow I2F path.
__device__ __forceinline__ float byte_to_float(uint32_t word, uint32_t byte) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | byte)) - 8388608.0f;
}

// 1/2 + q/32 for the 4-bit code q held in bits 3..6 of byte b (bit 7 clear): one byte_perm builds the float
// 0x3F000000 | q << 19 around it (bit 7 of the byte is the exponent's low bit, 0: no OR needed).
__device__ __forceinline__ float nibble_to_half_plus(uint32_t word, uint32_t byte) {
    return __uint_as_float(__byte_perm(word, 0x3F000000u, 0x7044u | (byte << 8)));
}

// sum_i w_i * x_i over one 16-byte chunk of a row, where w_i is the integer code (affine formats, before
// scale and bias) or the bf16 value (dense). x holds chunk_values<F>() floats and sx = sum_i x_i.
// note: 4-bit codes are summed as 32 (1/2 + q/32) x - 16 x: one byte_perm and one FFMA per weight instead of a
// conversion, an FADD and an FFMA. The cancellation costs ~4 bits: ~2e-5 relative on a chunk's sum.
// note: two accumulators (even / odd values) halve the dependent FFMA chain: the decode kernels are bound by
// instruction latency with 8 warps per SM ("wait" stalls in the source counters), not by the FFMA count.
template <dfmt F>
__device__ __forceinline__ float chunk_dot(const uint4& c, const float* x, float sx) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    float a0 = 0.0f, a1 = 0.0f;
    if constexpr (F == dfmt::q4) {
        // word k holds values 8k..8k+7 at nibbles 0..7 (LSB first): even values in the low nibble of each byte
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t lo = (w[k] << 3) & 0x78787878u;
            const uint32_t hi = (w[k] >> 1) & 0x78787878u;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                a0 = fmaf(nibble_to_half_plus(lo, b), x[8 * k + 2 * b], a0);
                a1 = fmaf(nibble_to_half_plus(hi, b), x[8 * k + 2 * b + 1], a1);
            }
        }
        return 32.0f * (a0 + a1) - 16.0f * sx;
    } else if constexpr (F == dfmt::q8) {
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int b = 0; b < 4; b += 2) {
                a0 = fmaf(byte_to_float(w[k], b), x[4 * k + b], a0);
                a1 = fmaf(byte_to_float(w[k], b + 1), x[4 * k + b + 1], a1);
            }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            a0 = fmaf(__uint_as_float(w[k] << 16), x[2 * k], a0);
            a1 = fmaf(__uint_as_float(w[k] & 0xFFFF0000u), x[2 * k + 1], a1);
        }
    }
    return a0 + a1;
}

// v rounded to the nearest fp16 (saturating at +-65504), back as fp32: what the fast GEMM's fp16 operands hold
// (to_f16, pack_f16). The decode kernels round their inputs so in fast mode, so that a prompt's last positions
// come out the same whether prefilled or decoded.
__device__ __forceinline__ float round_f16(float v) {
    uint32_t r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(0.0f), "f"(v));
    return __half2float(__ushort_as_half((unsigned short)(r & 0xFFFFu)));
}

// The RMS norm's reduction when its sum of squares is taken inside another pass over the row (stage_x,
// stage_xq): each warp's part goes to red[warp] (32 floats); after a barrier every thread gets 1/rms of the K
// values from the parts.
__device__ __forceinline__ void put_warp_part(float* red, float v) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
}
__device__ __forceinline__ float inv_rms_of_parts(const float* red, int64_t K, float eps) {
    const int lane = threadIdx.x % 32;
    return rsqrtf(warp_sum(lane < (int)(blockDim.x / 32) ? red[lane] : 0.0f) / (float)K + eps);
}

// Loads one input row of K floats into registers the way the "x-stationary" kernels want it: lane l gets chunks
// l, l+32, ... (CH floats each, optionally RMS-normalised with weights nw), plus each chunk's sum. note: read
// straight from global memory, lane l's chunk sits 32*CH*4 bytes from its neighbour's, so every load touched 32
// cache lines (where a GEMV that read it so lost most of its time); the block stages the row through shared memory with
// coalesced loads instead, padded by 4 floats per chunk so that the 16-byte reads of 8 lanes (one LDS.128
// phase) fall in distinct banks. smem holds (K/CH) * (CH+4) floats. The norm takes the same pass: x * nw is
// staged while the warps' parts of sum x^2 go to `red` (32 floats), and each lane scales its chunks by 1/rms
// after the one barrier (a separate norm pass cost a global round trip and two barriers more). f16: the
// (normalised) values rounded to fp16 (round_f16).
template <int CH, int CPL>
__device__ __forceinline__ void stage_x(float (&xv)[CPL][CH], float (&sx)[CPL], const float* x, const float* nw,
                                        float eps, int64_t K, float* smem, float* red, bool f16 = false) {
    float ss = 0.0f;
    for (int64_t k = 4 * threadIdx.x; k < K; k += 4 * blockDim.x) {
        float4 v = *reinterpret_cast<const float4*>(x + k);
        if (nw) {
            const float4 w = *reinterpret_cast<const float4*>(nw + k);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            v.x *= w.x, v.y *= w.y, v.z *= w.z, v.w *= w.w;
        }
        *reinterpret_cast<float4*>(smem + (k / CH) * (CH + 4) + k % CH) = v;
    }
    if (nw) put_warp_part(red, ss);
    __syncthreads();
    const float inv = nw ? inv_rms_of_parts(red, K, eps) : 1.0f;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < CPL; i++) {
        const float* src = smem + (int64_t)(lane + 32 * i) * (CH + 4);
        sx[i] = 0;
#pragma unroll
        for (int j = 0; j < CH; j += 4) {
            float4 v = *reinterpret_cast<const float4*>(src + j);
            if (nw) v.x *= inv, v.y *= inv, v.z *= inv, v.w *= inv;
            if (f16) v = make_float4(round_f16(v.x), round_f16(v.y), round_f16(v.z), round_f16(v.w));
            xv[i][j] = v.x, xv[i][j + 1] = v.y, xv[i][j + 2] = v.z, xv[i][j + 3] = v.w;
            sx[i] += (v.x + v.y) + (v.z + v.w);
        }
    }
}

// Inverse RMS of T (<= 16) rows of n floats (n % 4 == 0), computed by the whole block with 16-byte loads:
// one memory round trip per RT rows instead of a serial walk (one round trip per row: a 16-row decode batch
// would wait for 16 in a row). Result in s_inv[t]; ends with a barrier. Each row's sum runs in the same order whatever T and RT are.
template <int RT = 4>  // rows whose loads are in flight together (registers: 8 RT per pass, unrolled twice)
__device__ __forceinline__ void block_inv_rms_rows(float* s_inv, const float* x, int64_t ldx, int T, int64_t n,
                                                   float eps) {
    __shared__ float red[16][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int t0 = 0; t0 < T; t0 += RT) {
        float ss[RT];
#pragma unroll
        for (int u = 0; u < RT; u++) ss[u] = 0.0f;
#pragma unroll 2
        for (int64_t i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) {
#pragma unroll
            for (int u = 0; u < RT; u++) {
                if (t0 + u < T) {
                    const float4 v = *reinterpret_cast<const float4*>(x + (t0 + u) * ldx + i);
                    ss[u] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < RT; u++) {
            const float v = warp_sum(ss[u]);
            if (lane == 0 && t0 + u < T) red[t0 + u][warp] = v;
        }
    }
    __syncthreads();
    if ((int)threadIdx.x < T) {
        float ss = 0;
        for (int w = 0; w < n_warps; w++) ss += red[threadIdx.x][w];
        s_inv[threadIdx.x] = rsqrtf(ss / (float)n + eps);
    }
    __syncthreads();
}

// A chunk of CH floats from (16-byte aligned) memory into registers, and its sum.
template <int CH>
__device__ __forceinline__ void chunk_load(float (&v)[CH], const float* src) {
#pragma unroll
    for (int i = 0; i < CH; i += 4) {
        const float4 f = *reinterpret_cast<const float4*>(src + i);
        v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
    }
}
template <int CH>
__device__ __forceinline__ float chunk_sum(const float (&v)[CH]) {
    float s = 0;
#pragma unroll
    for (int i = 0; i < CH; i++) s += v[i];
    return s;
}

// (scale, bias) packed as bf16x2: scale in the low half.
__device__ __forceinline__ float sb_scale(uint32_t sb) { return __uint_as_float(sb << 16); }
__device__ __forceinline__ float sb_bias(uint32_t sb) { return __uint_as_float(sb & 0xFFFF0000u); }

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
// Two packed bf16 values (the lower address in the low half) as floats.
__device__ __forceinline__ float2 bf16x2_bits_to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// Float bits mapped so that unsigned order is float order (a larger key is a larger float; -inf's key is
// 0x007FFFFF); -0 counts as +0, and NaN maps to nan_key, below every number (callers keep small keys free as
// markers). key_value inverts it for numbers.
__device__ __forceinline__ uint32_t order_key(float f, uint32_t nan_key = 0) {
    uint32_t b = __float_as_uint(f);
    if (b == 0x80000000u) b = 0;
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return nan_key;
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_value(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? k & 0x7FFFFFFFu : ~k); }

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + __expf(-x)); }

}  // namespace tansy::cuda
#endif  // __CUDACC__
