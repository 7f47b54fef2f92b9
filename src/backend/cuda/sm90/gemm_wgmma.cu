// Hopper (sm_90a) form of the fast-mode GEMM for 4-bit weights: the contract, tile lists and epilogues of
// gemm_fast_kernel (gemm.cu), with the products on wgmma and the weights dequantised in registers. Built for sm_90a
// only (CMakeLists.txt); gemm() takes it on compute capability 9.0 unless the kernel plan says wgmma=off.
// The product is computed transposed, Y^T = W X^T: a CTA (256 threads, two warpgroups) takes 128 W rows, warpgroup
// g rows 64g .. 64g+63 as wgmma's A operand straight from registers, against NT token rows (64, 80, 128 or 256:
// the tile list's rows, or kernel_plan.h's k_gemm_wgmma_dense_tokens; a tile with fewer rows multiplies fewer)
// as the B operand, fp16 in shared memory in the 128-byte-swizzled K-major layout (16-byte chunk c of row r at
// chunk c ^ (r % 8), 8-row atoms of 1024 bytes).
// Each weight is read from shared memory and dequantised once per CTA, by the thread whose fragment holds it:
// no dequantised copy goes through shared memory, and the only other shared-memory reader is wgmma's B fetch.
// Per k-tile (64): wait for the ring, fence the cp.async writes for the async proxy, one barrier, issue the copies
// PREFETCH k-tiles ahead, four wgmma on the fragments made in the previous step, commit, wait for the previous
// group, then make the next k-tile's fragments while this group runs. The tile leaves through shared memory
// (tile_out) in 16-byte row-contiguous stores.
#include <cuda.h>  // CUtensorMap (the encoder comes from the driver at run time: no libcuda link)
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backend/cuda/gemm_tile.cuh"
#include "backend/cuda/gemm_wgmma.cuh"
#include "backend/cuda/kernel_plan.h"

namespace tansy::cuda {

namespace {

using namespace gemm_dev;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // device code for sm_90a only (the host pass sees none of it)
// Offset (fp16 elements) of 16-byte chunk `chunk` (8 values) of row `row` in a 128-byte-swizzled K-major tile.
__device__ __forceinline__ int sw128(int row, int chunk) { return row * BK + ((chunk ^ (row & 7)) * 8); }

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand starting at shared address `saddr`
// (1024-byte aligned atom, plus 32 bytes per k16 step): start >> 4, leading offset 1 (unused for swizzled
// K-major), stride between 8-row atoms 1024 bytes, swizzle mode 1 (128 bytes).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
// (the first USED of them: those a narrower wgmma writes)
template <int N, int USED = N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < USED; i++) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory barriers for the TMA copies of X: one a ring stage, expecting one arrival (the issuing thread's,
// with the stage's byte count) and the copy's bytes; phase parity (k-tile / STAGES) & 1.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// The box at (inner coordinate c0, row c1) of a 2-D tensor map into shared memory at dst (1024-byte aligned for
// the 128-byte swizzle), completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// d (64 x N fp32, accumulated) += A (64 x 16 fp16 in registers: the mma.sync m16n8k16 A fragment of warp w of
// the warpgroup for rows 16w .. 16w+15) B (16 x N fp16, shared memory, K-major). N = 64, 80, 128 or 256.
#define TANSY_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                    "+f"(d[i + 6]), "+f"(d[i + 7])
template <int N, int A>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[A], const uint32_t (&a)[4], uint64_t db);
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) { wgmma_rs_n<64>(d, a, db); }
__device__ __forceinline__ void wgmma_rs(float (&d)[40], const uint32_t (&a)[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39"
        "}, {%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8), TANSY_D8(16), TANSY_D8(24), TANSY_D8(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8), TANSY_D8(16), TANSY_D8(24), TANSY_D8(32), TANSY_D8(40), TANSY_D8(48), TANSY_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8), TANSY_D8(16), TANSY_D8(24), TANSY_D8(32), TANSY_D8(40), TANSY_D8(48), TANSY_D8(56),
          TANSY_D8(64), TANSY_D8(72), TANSY_D8(80), TANSY_D8(88), TANSY_D8(96), TANSY_D8(104), TANSY_D8(112), TANSY_D8(120)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// The same on d's first N/2 accumulators (token columns 0 .. N-1) for N = 16, 32, 48, 64: a tile holding fewer
// tokens than its width multiplies only the 16-column groups it has (the accumulator layout of a narrower wgmma
// is the wider one's prefix).
template <int N, int A>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[A], const uint32_t (&a)[4], uint64_t db) {
    static_assert(N % 16 == 0 && N / 2 <= A, "a prefix of the accumulators");
    if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8), TANSY_D8(16), TANSY_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
    } else if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
    } else if constexpr (N == 32) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
    } else {
        static_assert(N == 48, "N = 16, 32, 48 or 64");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : TANSY_D8(0), TANSY_D8(8), TANSY_D8(16)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
    }
}
#undef TANSY_D8

// The two 4-bit codes of byte `sel & 3` of `word` (low nibble: the even value) as the half2 (q_lo s + b, q_hi s + b),
// given s2 = (s, s / 16) and b2 = (b, b): the byte goes to bytes 0 and 2, the low nibble of the first and the high
// nibble of the second (bits 4-7: 16 q_hi) are ORed into the mantissa of 1024.0 (exact), 1024 comes off, and one
// fused multiply-add rounds q s + b once to fp16, as the other fast kernels' fp32 dequantisation rounded to fp16
// (exactly so for scales >= 2^-13, where s / 16 is an fp16 value; checkpoint scales are ~1e-3 - 1e-1).
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, uint32_t sel, __half2 s2, __half2 b2) {
    const uint32_t b = __byte_perm(word, 0, sel);
    uint32_t x;  // (b & 0x00F0000F) | 0x64006400 as one LOP3 (the compiler splits it in two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(x) : "r"(b), "r"(0x00F0000Fu), "r"(0x64006400u));
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&x), __half2half2(__ushort_as_half(0x6400)));
    const __half2 w = __hfma2(q, s2, b2);
    return *reinterpret_cast<const uint32_t*>(&w);
}
#endif

// The CTA's tile: 128 W rows (warpgroup g: rows 64g .. 64g+63, the wgmma A operand, dequantised in registers)
// against NT token rows (the B operand: the GEMM's fp16 A rows, 128-byte-swizzled K-major in shared memory).
// Ring stage: X [NT][64] fp16 | W words [128][32 bytes] (the two 16-byte chunks of row r swapped when bit 2 of r
// is set: a warp's eight rows then read distinct banks). 8 stages (5 of 36 KB at 256 tokens, 7 at 80); two CTAs an
// SM at 64 and 80 tokens (<= 128 registers a thread). After the ring, SB_SLOTS slots of (scale, bias) words: 8
// words a W row, those of SB_CHUNK k-tiles (4 with groups of 32, else 8), one 16-byte copy a thread (per k-tile,
// one 4-byte copy each made the copies' count and latency the kernel's largest cost). Three slots: chunk c + 3
// overwrites chunk c's slot once its k-tiles are all read, even at 4 k-tiles a chunk and 6 in flight.
template <int NT>
struct wg_layout {
    static constexpr int WROWS = 128;
    static constexpr int STAGES = NT == 256 ? 5 : NT == 80 ? 7 : 8;  // 80 tokens: 7, so that two CTAs fit an SM
    static constexpr int PREFETCH = STAGES - 2;  // k-tiles in flight: the stage of k-tile kt-1 is still being read
    static_assert(PREFETCH >= 2, "k-tile kt + 1 lands while kt is multiplied");
    static constexpr int CTAS = NT <= 80 ? 2 : 1;  // per SM
    static constexpr uint32_t X_BYTES = (uint32_t)NT * BK * 2;
    static constexpr uint32_t W_BYTES = (uint32_t)WROWS * (BK / 2);
    static constexpr uint32_t STAGE = X_BYTES + W_BYTES;
    static constexpr int SB_WORDS = 8, SB_SLOTS = 3;  // words a row in a slot; slots
    static constexpr uint32_t SB_SLOT = (uint32_t)WROWS * SB_WORDS * 4;
    // then a barrier a stage for the TMA copies of X (dense calls: gemm_wgmma_kernel's TX)
    static constexpr uint32_t BARS = (uint32_t)STAGES * STAGE + SB_SLOTS * SB_SLOT;
    static constexpr size_t SMEM = (size_t)BARS + 8 * STAGES + 1024;  // + alignment of the base
    static_assert(X_BYTES % 1024 == 0 && STAGE % 1024 == 0, "1024-byte swizzle atoms");
    static_assert(CTAS == 1 || SMEM + 1024 <= 228 * 1024 / CTAS, "CTAS blocks fit an SM's shared memory");
    // chunk c + SB_SLOTS is issued in the step of k-tile SB_CHUNK (c + SB_SLOTS) - PREFETCH, after its barrier: by
    // then k-tiles up to that one are read, chunk c's last (SB_CHUNK (c + 1) - 1) included
    static_assert(4 * (SB_SLOTS - 1) >= PREFETCH - 1, "a (scale, bias) slot is refilled only once it is read");
    static_assert((size_t)NT * (WROWS + 4) * 4 <= (size_t)STAGES * STAGE, "the epilogue's tile fits the ring");
};

// W row behind tile row c (0..127) of CTA column block blockIdx.x: swiglu pairs gate and up of one feature as rows
// 16b + i (gate) and 16b + 8 + i (up) of feature 8b + i of the block's 64, so a thread's two accumulator rows
// (lane/4 and lane/4 + 8 of its warp's 16) are one feature's gate and up.
template <gemm_epilogue EPI>
__device__ __forceinline__ const dmat& w_row_of(const gemm_params& p, int c, int expert, int64_t& wrow, bool& valid) {
    const int64_t n = EPI == gemm_epilogue::swiglu ? (int64_t)blockIdx.x * 64 + (c / 16) * 8 + c % 8
                                                   : (int64_t)blockIdx.x * 128 + c;
    valid = n < p.N;
    wrow = (int64_t)expert * p.N + (valid ? n : 0);
    return EPI == gemm_epilogue::swiglu && (c & 8) ? p.W2 : p.W;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The thread's A fragments of one k-tile: a[s] for k16 step s, rows r0 and r0 + 8 of the tile (r0 = 16 warp +
// lane/4). Fragment register j of step s holds columns 16s + 8(j/2) + 2t, +1 (t = lane%4) of row r0 + 8(j%2):
// byte t of word 2s + j/2 of that row (the checkpoint's nibble order: value 8w + 2i in the low nibble of byte i).
// sb: the k-tile's (scale, bias) word of tile row 0 in its slot (rows 8 words apart; groups of 32: two words).
__device__ __forceinline__ void a_fragments(uint32_t (&a)[4][4], const unsigned char* st_w, const uint32_t* st_sb, int r0,
                                             uint32_t sel, bool two_groups) {
    uint32_t w[2][8];
    __half2 sc[2][2], bi[2][2];
    const int swap = (r0 >> 2) & 1;  // the same for r0 + 8
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const unsigned char* row = st_w + (r0 + 8 * h) * (BK / 2);
        const uint4 c0 = *reinterpret_cast<const uint4*>(row + 16 * swap), c1 = *reinterpret_cast<const uint4*>(row + 16 * (1 - swap));
        w[h][0] = c0.x, w[h][1] = c0.y, w[h][2] = c0.z, w[h][3] = c0.w;
        w[h][4] = c1.x, w[h][5] = c1.y, w[h][6] = c1.z, w[h][7] = c1.w;
        const uint32_t* sbr = st_sb + 8 * (r0 + 8 * h);
        const uint2 sb = two_groups ? *reinterpret_cast<const uint2*>(sbr) : make_uint2(*sbr, 0u);
        const float s0 = sb_scale(sb.x);
        sc[h][0] = sc[h][1] = __floats2half2_rn(s0, s0 * 0.0625f);
        bi[h][0] = bi[h][1] = __float2half2_rn(sb_bias(sb.x));
        if (two_groups) {  // groups of 32: the k-tile's second half has its own (scale, bias)
            const float s1 = sb_scale(sb.y);
            sc[h][1] = __floats2half2_rn(s1, s1 * 0.0625f);
            bi[h][1] = __float2half2_rn(sb_bias(sb.y));
        }
    }
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int h = j % 2, word = 2 * s + j / 2;
            a[s][j] = dequant_pair(w[h][word], sel, sc[h][s / 2], bi[h][s / 2]);
        }
}
#endif

// The tile out through shared memory (the free ring): the accumulators (divided by a_scale; swiglu: silu(gate) * up)
// into cs [NT][CW] (row pitch CW + 4: a warp's stores hit 32 distinct banks), then each warp writes whole token rows
// with 16-byte accesses (read-modify-write for accumulate), four at a time so their loads overlap. Columns past N,
// tokens past `rows`, a chunk that crosses a segment or is misaligned go element by element.
template <gemm_epilogue EPI, int NT>
__device__ __forceinline__ void tile_out(const gemm_params& p, const float (&acc)[NT / 2], float* cs, int row0, int rows, int r0) {
    constexpr bool SWIGLU = EPI == gemm_epilogue::swiglu;
    constexpr int CW = SWIGLU ? 64 : 128, LDC = CW + 4;
    const int lane = threadIdx.x % 32;
    const float inv_scale = 1.0f / p.a_scale;  // a power of two: exact
    // accumulator 4j + 2h + e: W row r0 + 8h of the tile, token column 8j + 2(lane%4) + e
#pragma unroll
    for (int j = 0; j < NT / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float* c = cs + (8 * j + 2 * (lane % 4) + e) * LDC;
            if constexpr (SWIGLU)  // feature 8 warp + lane/4 of the block's 64 (w_row_of)
                c[(r0 / 16) * 8 + r0 % 8] = siluf_(acc[4 * j + e] * inv_scale) * (acc[4 * j + 2 + e] * inv_scale);
            else
                c[r0] = acc[4 * j + e] * inv_scale, c[r0 + 8] = acc[4 * j + 2 + e] * inv_scale;
        }
    __syncthreads();
    // 4-value chunks: CW / 4 per token row
    constexpr int CPR = CW / 4, BATCH = 4;
    const int64_t col0 = (int64_t)blockIdx.x * CW;
    for (int base = threadIdx.x; base < rows * CPR; base += BATCH * k_threads) {
        float4 v[BATCH], old[BATCH];
        float* dst[BATCH];
        bool vec[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; i++) {  // destinations and (accumulate) the old values
            const int idx = base + i * k_threads, m = idx / CPR, c = idx % CPR;
            dst[i] = nullptr, vec[i] = false;
            if (idx >= rows * CPR) continue;
            v[i] = *reinterpret_cast<const float4*>(cs + m * LDC + 4 * c);
            const int64_t r = row0 + m, col = col0 + 4 * c;
            if constexpr (SWIGLU) {
                if (p.out16) continue;  // below
                dst[i] = p.out + r * p.ldo + col;
            } else if constexpr (EPI == gemm_epilogue::rows) {
                dst[i] = rows_out(p, r, col);
            } else {
                const int sg = segment_of(p, col);
                dst[i] = p.seg[sg].out + r * p.seg[sg].ld + (col - p.seg[sg].row0);
                // the chunk's last column in the same segment
                if (sg + 1 < p.n_seg && col + 3 >= p.seg[sg + 1].row0) continue;
            }
            vec[i] = col + 4 <= p.N && (reinterpret_cast<uintptr_t>(dst[i]) & 15) == 0;
            if (EPI == gemm_epilogue::store && p.accumulate && vec[i]) old[i] = *reinterpret_cast<const float4*>(dst[i]);
        }
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int idx = base + i * k_threads, m = idx / CPR, c = idx % CPR;
            if (idx >= rows * CPR) continue;
            const int64_t r = row0 + m, col = col0 + 4 * c;
            if (SWIGLU && p.out16) {
                uint16_t* o = p.out16 + r * p.ldo + col;
                const float y[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
                if (col + 4 <= p.N && (reinterpret_cast<uintptr_t>(o) & 7) == 0) {
                    *reinterpret_cast<uint2*>(o) = make_uint2(pack_f16(y[0] * p.out16_scale, y[1] * p.out16_scale),
                                                              pack_f16(y[2] * p.out16_scale, y[3] * p.out16_scale));
                } else {
                    for (int q = 0; q < 4 && col + q < p.N; q++) store_swiglu_value(p, r, col + q, y[q]);
                }
            } else if (vec[i]) {
                float4 w = v[i];
                if (EPI == gemm_epilogue::store && p.accumulate) w.x += old[i].x, w.y += old[i].y, w.z += old[i].z, w.w += old[i].w;
                *reinterpret_cast<float4*>(dst[i]) = w;
            } else {
                const float y[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
                for (int q = 0; q < 4; q++) {
                    if constexpr (SWIGLU) {
                        if (col + q < p.N) store_swiglu_value(p, r, col + q, y[q]);
                    } else {
                        store_value<EPI>(p, r, col + q, y[q]);
                    }
                }
            }
        }
    }
}

// TX (prompt-sized dense calls and routed down calls: a tile's X rows are contiguous): each k-tile's X tile arrives
// by one TMA copy (xmap: x16 as [M][K] fp16, box NT rows x 64, 128-byte swizzle: the layout sw128 describes), issued
// by thread 0 once the stage is free and awaited on the stage's barrier by every thread before its wgmma reads it,
// instead of 8 16-byte copies a thread; rows past M arrive as zeros. W and (scale, bias) keep their per-thread
// copies. H100, 2K tokens: the dense bench call 136 -> 126 us, prompts +1.4-1.7%; routed down 162 -> 153 us. A
// 64-row decode batch's dense 64-token calls measured 0.25% slower with it and keep the copies; gate/up's gathered
// rows, a one-row box each, took 289 -> 509 us (docs/PERF.md).
template <gemm_epilogue EPI, int NT, bool TX>
__global__ void __launch_bounds__(k_threads, wg_layout<NT>::CTAS)
    gemm_wgmma_kernel(const gemm_params p, const int gshift, const __grid_constant__ CUtensorMap xmap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = wg_layout<NT>;
    constexpr int STAGES = L::STAGES, PREFETCH = L::PREFETCH;
    constexpr int X_CHUNKS = (NT * (BK / 8) + k_threads - 1) / k_threads;  // 16-byte chunks of X per thread and k-tile
    static_assert(L::WROWS * 2 == k_threads, "one W chunk a thread and k-tile, two threads a (scale, bias) chunk row");
    extern __shared__ __align__(16) unsigned char smem_dyn[];
    unsigned char* smem = smem_dyn + ((1024 - (smem_addr(smem_dyn) & 1023)) & 1023);
    const uint32_t sbase = smem_addr(smem);
    const uint64_t desc0 = sw128_desc(sbase);  // the start field (address >> 4) of stage 0's X; stages add to it
    int expert, row0, rows;
    if (!tile_rows<NT>(p, expert, row0, rows)) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int kt0, kt1;  // this CTA's k-tiles (a K split's slice)
    k_slice((int)(p.W.cols / BK), kt0, kt1);
    const int nk = kt1 - kt0;
    const uint32_t bars = sbase + L::BARS;  // stage s's barrier at bars + 8 s
    if constexpr (TX) {
        if (tid == 0) {
            for (int s = 0; s < STAGES; s++) mbar_init(bars + 8 * s, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
        }
        __syncthreads();
    }

    // copy roles, as (source at k-tile 0, bytes: 16 or 0 for a zero fill, offset in the stage). X: rows tid/8 + 32 i,
    // 16-byte chunk tid % 8; W: row tid / 2, chunk tid % 2, and words 4 (tid % 2) .. + 3 of the row's (scale, bias)
    // chunk. Sources of missing rows stay valid addresses (row 0, the expert's first W row) with nothing read.
    const unsigned char* xsrc[X_CHUNKS];
    uint32_t xbytes[X_CHUNKS], xdst[X_CHUNKS];
#pragma unroll
    for (int i = 0; i < (TX ? 0 : X_CHUNKS); i++) {
        const int r = tid / 8 + 32 * i;  // past NT (80 tokens: the third chunk of 3/4 of the threads): no copy
        xsrc[i] = reinterpret_cast<const unsigned char*>(p.x16 + (r < rows ? a_row(p, row0 + r) * p.ldx16 : 0) + (tid % 8) * 8);
        xbytes[i] = r < rows ? 16 : 0;
        xdst[i] = (NT * (BK / 8)) % k_threads == 0 || r < NT ? 2 * sw128(r, tid % 8) : 0xFFFFFFFFu;
    }
    const int wr = tid / 2, half = tid % 2;
    int64_t wrow;
    bool wok;
    const dmat& W = w_row_of<EPI>(p, wr, expert, wrow, wok);
    const unsigned char* wsrc = reinterpret_cast<const unsigned char*>(W.w + wrow * W.row_words()) + half * 16;
    const int ng = (int)W.n_groups();
    const uint32_t* sbsrc = W.sb + wrow * ng;
    const bool row16 = (reinterpret_cast<uintptr_t>(sbsrc) & 15) == 0;  // (the source of a zero fill too)
    const uint32_t wbytes = wok ? 16 : 0;
    const uint32_t wdst = L::X_BYTES + wr * (BK / 2) + 16 * (half ^ ((wr >> 2) & 1));
    const int chs = gshift == 5 ? 2 : 3;  // log2 of the k-tiles a (scale, bias) chunk holds (8 words a row at most)
    const uint32_t sb0 = sbase + (uint32_t)STAGES * L::STAGE + 4 * (L::SB_WORDS * wr + 4 * half);  // this thread's
    // first word of k-tile kt's chunk (words of the whole row: kt0 + kt counts from the row's start)
    auto chunk_word = [&](int kt) { return (int)(((int64_t)(kt0 + (kt >> chs << chs)) * BK) >> gshift); };

    auto issue = [&](int kt) {  // the slice's k-tile kt (k-tile kt0 + kt of W) into ring stage kt % STAGES
        const uint32_t st = sbase + (uint32_t)(kt % STAGES) * L::STAGE;
        const int kw = kt0 + kt;
        if constexpr (TX) {
            if (tid == 0) {
                const uint32_t bar = bars + 8 * (uint32_t)(kt % STAGES);
                mbar_expect_tx(bar, L::X_BYTES);  // the whole box, rows past M (zeros) included
                tma_load_2d(st, &xmap, kw * BK, row0, bar);
            }
        } else {
#pragma unroll
            for (int i = 0; i < X_CHUNKS; i++)
                if ((NT * (BK / 8)) % k_threads == 0 || xdst[i] != 0xFFFFFFFFu) cp_async16_zfill(st + xdst[i], xsrc[i] + kw * (BK * 2), xbytes[i]);
        }
        cp_async16_zfill(st + wdst, wsrc + kw * (BK / 2), wbytes);
        if ((kt & ((1 << chs) - 1)) == 0) {  // a chunk's first k-tile: its words, 4 a thread (fewer at the row's end)
            const int b = chunk_word(kt), w0 = b + 4 * half, words = wok ? max(0, min(4, ng - w0)) : 0;
            const uint32_t dst = sb0 + (uint32_t)((kt >> chs) % L::SB_SLOTS) * L::SB_SLOT;
            if (row16 && (b & 3) == 0)  // a 16-byte aligned row and chunk start
                cp_async16_zfill(dst, sbsrc + (words > 0 ? w0 : 0), 4u * (uint32_t)words);
            else
#pragma unroll
                for (int i = 0; i < 4; i++) cp_async4_zfill(dst + 4 * i, sbsrc + (i < words ? w0 + i : 0), i < words ? 4u : 0u);
        }
    };
    const int r0 = 16 * warp + lane / 4;
    const uint32_t sel = (uint32_t)(lane % 4) * 0x101u;  // byte lane%4 into bytes 0 and 2
    auto fragments = [&](uint32_t(&a)[4][4], int kt) {
        const unsigned char* st = smem + (kt % STAGES) * L::STAGE;
        const uint32_t* slot = reinterpret_cast<const uint32_t*>(smem + STAGES * L::STAGE +
                                                                 ((kt >> chs) % L::SB_SLOTS) * L::SB_SLOT);
        const int word = (int)(((int64_t)(kt0 + kt) * BK) >> gshift) - chunk_word(kt);  // the k-tile's first word
        a_fragments(a, st + L::X_BYTES, slot + word, r0, sel, gshift == 5);
    };

#pragma unroll
    for (int s = 0; s < PREFETCH; s++) {
        if (s < nk) issue(s);
        cp_async_commit();  // (possibly empty: one group per k-tile)
    }
    cp_async_wait<PREFETCH - 1>();  // k-tile 0
    __syncthreads();
    uint32_t a0[4][4], a1[4][4];
    fragments(a0, 0);

    float acc[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; i++) acc[i] = 0.0f;
    // k-tile kt: its fragments were made in step kt-1; its wgmma group runs while k-tile kt+1's are made (after
    // the group of kt-1 has finished with the registers they reuse)
    // N: the token columns wgmma multiplies: NT, or fewer where the tile holds fewer rows (64-token tiles: 16, 32
    // or 48; 80-token tiles: 48)
    auto step = [&](int kt, uint32_t(&cur)[4][4], uint32_t(&next)[4][4], auto n) {
        constexpr int N = decltype(n)::value;
        cp_async_wait<PREFETCH - 2>();  // k-tiles <= kt + 1 have landed (this thread's copies)
        fence_proxy_async();            // ... visible to wgmma
        __syncthreads();                // everyone's; the groups of k-tiles <= kt-2 are done: their stage is free
        if (kt + PREFETCH < nk) issue(kt + PREFETCH);
        cp_async_commit();
        const uint64_t dx = desc0 + ((kt % STAGES) * L::STAGE >> 4);  // X of stage kt % STAGES
        if constexpr (TX) mbar_wait(bars + 8 * (uint32_t)(kt % STAGES), (uint32_t)(kt / STAGES) & 1u);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < BK / 16; s++) {  // + 32 bytes per k16
            if constexpr (N == NT)
                wgmma_rs(acc, cur[s], dx + 2 * s);
            else
                wgmma_rs_n<N>(acc, cur[s], dx + 2 * s);
        }
        wgmma_commit();
        wgmma_wait<1>();  // k-tile kt-1's group: `next` is free
        fence_acc<NT / 2, N / 2>(acc);
        if (kt + 1 < nk) fragments(next, kt + 1);
    };
    auto k_loop = [&](auto n) {
        for (int kt = 0; kt < nk; kt += 2) {
            step(kt, a0, a1, n);
            if (kt + 1 < nk) step(kt + 1, a1, a0, n);
        }
    };
    if constexpr (NT == 64) {
        switch ((rows + 15) / 16) {
            case 1: k_loop(std::integral_constant<int, 16>{}); break;
            case 2: k_loop(std::integral_constant<int, 32>{}); break;
            case 3: k_loop(std::integral_constant<int, 48>{}); break;
            default: k_loop(std::integral_constant<int, 64>{});
        }
    } else if constexpr (NT == 80) {  // (more widths here and ptxas serialises the wgmma: C7511, registers)
        if (rows <= 48)
            k_loop(std::integral_constant<int, 48>{});
        else
            k_loop(std::integral_constant<int, 80>{});
    } else {
        k_loop(std::integral_constant<int, NT>{});
    }
    wgmma_wait<0>();
    fence_acc(acc);

    cp_async_wait<0>();
    __syncthreads();  // the ring is free: every warp's last fragments are made, no copy is in flight
    tile_out<EPI, NT>(p, acc, reinterpret_cast<float*>(smem), row0, rows, r0);
#endif
}

// x16 of a TX call (dense, or routed down) as the tensor map its X tiles come through: [M][K] fp16 rows ldx16
// apart, boxes of nt rows x 64 with the 128-byte swizzle. false where the driver offers no encoder or refuses the
// shape (the call then copies X per thread).
bool x_tensor_map(CUtensorMap& map, const gemm_params& p, int nt) {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
#if CUDART_VERSION >= 12050  // (older toolkits: no versioned entry points, and X by copies)
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            fn = nullptr;
            (void)cudaGetLastError();  // not the next launch's error
        }
#endif
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    if (!encode || p.M < 1) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)p.W.cols, (cuuint64_t)p.M};
    const cuuint64_t strides[1] = {(cuuint64_t)p.ldx16 * sizeof(uint16_t)};
    const cuuint32_t box[2] = {(cuuint32_t)BK, (cuuint32_t)nt}, steps[2] = {1, 1};
    return encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<uint16_t*>(p.x16), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <gemm_epilogue EPI, int NT, bool TX>
void launch_kernel(const gemm_params& p, const CUtensorMap& xmap, cudaStream_t stream) {
    constexpr size_t smem = wg_layout<NT>::SMEM;
    allow_dynamic_smem<gemm_wgmma_kernel<EPI, NT, TX>>(smem);
    const int64_t cols = EPI == gemm_epilogue::swiglu ? 64 : 128;
    const dim3 grid((unsigned)((p.N + cols - 1) / cols), (unsigned)(p.tiles ? p.max_tiles : (p.M + NT - 1) / NT),
                    (unsigned)p.split_k);
    int gshift = 0;
    while ((1 << gshift) < p.W.group) gshift++;
    gemm_wgmma_kernel<EPI, NT, TX><<<grid, k_threads, smem, stream>>>(p, gshift, xmap);
    CUDA_CHECK_LAUNCH();
}

std::atomic<uint64_t> g_tma_calls{0};  // gemm_tma_calls (gemm.cuh)

template <gemm_epilogue EPI, int NT>
void launch(const gemm_params& p, cudaStream_t stream) {
    CUtensorMap xmap;
    std::memset(&xmap, 0, sizeof xmap);
    // prompt-sized dense calls (kernel_plan.h), and routed down calls: their X rows (h16, expert-sorted) are a
    // tile's contiguous rows from its row0 (rows past the tile belong to the next expert: their token columns are
    // never stored)
    constexpr bool routed_down = EPI == gemm_epilogue::rows && (NT == 64 || NT == 80);
    if constexpr (NT == k_gemm_wgmma_dense_tokens || routed_down) {
        if ((routed_down ? p.tiles != nullptr : !p.tiles) && !p.gather && gemm_tma_requested() && x_tensor_map(xmap, p, NT)) {
            g_tma_calls.fetch_add(1, std::memory_order_relaxed);
            return launch_kernel<EPI, NT, true>(p, xmap, stream);
        }
    }
    launch_kernel<EPI, NT, false>(p, xmap, stream);
}

template <gemm_epilogue EPI>
void launch(const gemm_params& p, cudaStream_t stream) {
    const int nt = gemm_wgmma_tile_tokens(p);
    static_assert(wg_layout<64>::CTAS == 2 && wg_layout<80>::CTAS == 2 && wg_layout<128>::CTAS == 1, "gemm_wgmma_ctas_per_sm");
    if (nt == 256)
        launch<EPI, 256>(p, stream);
    else if (nt == 128)
        launch<EPI, 128>(p, stream);
    else if (nt == 80)
        launch<EPI, 80>(p, stream);
    else
        launch<EPI, 64>(p, stream);
}

}  // namespace

uint64_t gemm_tma_calls() { return g_tma_calls.load(std::memory_order_relaxed); }

bool gemm_wgmma_device() {
    static const bool ok = [] {
        int dev = 0, major = 0, minor = 0;
        if (cudaGetDevice(&dev) != cudaSuccess) return false;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        return major == 9 && minor == 0 && max_dynamic_smem() >= std::max({wg_layout<64>::SMEM, wg_layout<80>::SMEM, wg_layout<128>::SMEM, wg_layout<256>::SMEM});
    }();
    return ok;
}

void gemm_wgmma(const gemm_params& p, cudaStream_t stream) {
    TANSY_CHECK(p.W.fmt == dfmt::q4 && !p.precise && gemm_wgmma_supports(p.W.group) && (!p.tiles || p.tile_bm == 64 || p.tile_bm == 80 || p.tile_bm == 128),
                "gemm_wgmma: 4-bit fast mode, groups of a power of two >= 32, tiles of 64, 80 or 128 rows");
    switch (p.epi) {
        case gemm_epilogue::store: return launch<gemm_epilogue::store>(p, stream);
        case gemm_epilogue::rows: return launch<gemm_epilogue::rows>(p, stream);
        case gemm_epilogue::swiglu: return launch<gemm_epilogue::swiglu>(p, stream);
    }
}

}  // namespace tansy::cuda
