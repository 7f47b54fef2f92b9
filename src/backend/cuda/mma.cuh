// Tensor-core and shared-memory primitives shared by the prefill kernels (sm_80+: mma.sync, ldmatrix,
// cp.async; nothing sm_90-only). Device code only.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace tansy::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Four 8x8 b16 matrices; lane l gives the address of row l%8 of matrix l/8 and gets, of matrix j, in r[j]:
// row l/4, columns 2(l%4) and 2(l%4)+1 (.trans: column l/4, rows 2(l%4) and 2(l%4)+1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c (16x8 fp32) += a (16x16, row-major) * b (16x8, column-major), bf16 or fp16 inputs. Fragments, with
// g = lane/4 and t = lane%4: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1].
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_16816<false>(c, a, b0, b1);
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_16816<true>(c, a, b0, b1);
}

// 3xTF32 (near-fp32 products on the tensor cores): x = hi + lo with hi = x truncated to tf32 (10 mantissa
// bits) and lo = x - hi (exact) truncated too, and a b ~ a.hi b.hi + a.hi b.lo + a.lo b.hi: relative error at
// most ~3 x 2^-20 per product (the two lo truncations and the dropped a.lo b.lo), against fp32's 2^-24. Finite
// inputs only (inf - inf would make lo NaN). Truncation
// by masking, two integer ops and a subtraction per value: cvt.rna.tf32.f32 is a five-instruction sequence.
// m16n8k8 fragments, with g = lane/4 and t = lane%4: a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4];
// b = B[t][g], B[t+4][g]; c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1].
struct tf32_a {
    uint32_t hi[4], lo[4];
};
struct tf32_b {
    uint32_t hi[2], lo[2];
};
constexpr uint32_t k_tf32_mask = 0xffffe000u;  // sign, exponent and the top 10 mantissa bits
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    hi = __float_as_uint(x) & k_tf32_mask;
    lo = __float_as_uint(x - __uint_as_float(hi)) & k_tf32_mask;
}
__device__ __forceinline__ tf32_a split_a(float a0, float a1, float a2, float a3) {
    tf32_a f;
    split_tf32(a0, f.hi[0], f.lo[0]), split_tf32(a1, f.hi[1], f.lo[1]);
    split_tf32(a2, f.hi[2], f.lo[2]), split_tf32(a3, f.hi[3], f.lo[3]);
    return f;
}
__device__ __forceinline__ tf32_b split_b(float b0, float b1) {
    tf32_b f;
    split_tf32(b0, f.hi[0], f.lo[0]), split_tf32(b1, f.hi[1], f.lo[1]);
    return f;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c += a b, 3xTF32: the two small cross terms first, then the large one.
__device__ __forceinline__ void mma_tf32x3(float (&c)[4], const tf32_a& a, const tf32_b& b) {
    mma_tf32(c, a.lo, b.hi);
    mma_tf32(c, a.hi, b.lo);
    mma_tf32(c, a.hi, b.hi);
}

// Two floats as bf16x2, lo in the low half (the lower column of an mma fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return (uint32_t)__bfloat16_as_ushort(v.x) | ((uint32_t)__bfloat16_as_ushort(v.y) << 16);
}
// fp16x2 of (lo, hi), saturating at +-65504 (one F2FP): an overflowing input saturates instead of becoming inf.
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));  // d = {a: upper, b: lower}
    return r;
}

// 16 bytes global -> shared, bypassing L1, of which `bytes` (16 or 0) are read and the rest zeroed; dst a shared
// address (smem_addr).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// 16 bytes global -> shared, bypassing L1; with valid = false nothing is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    cp_async16_zfill(smem_addr(dst), src, valid ? 16u : 0u);
}
// 16 bytes global -> shared, bypassing L1 (every source valid).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// 8 bytes global -> shared, through L1.
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// 4 bytes global -> shared (through L1: small scattered words), of which `bytes` (4 or 0) are read, the rest zeroed.
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async4_zfill(void* dst, const void* src, bool valid) {
    cp_async4_zfill(smem_addr(dst), src, valid ? 4u : 0u);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace tansy::cuda
