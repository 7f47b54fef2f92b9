// Hopper (sm_90a) form of the fast-mode GEMM for 4-bit weights: the same contract, tiles, cp.async ring and
// epilogues as gemm_fast_kernel (gemm.cu), with the products on wgmma instead of mma.sync. Built for sm_90a only
// (CMakeLists.txt); gemm() takes it on compute capability 9.0 unless the kernel plan says wgmma=off. 128-row
// tiles only (64-row tiles, m64n64k16, measured slower than mma.sync: they stay there).
// 256 threads = two warpgroups; warpgroup g takes tile rows 64g .. 64g+63 against all 128 W rows (m64n128k16, 64
// accumulators per thread). A (fp16) and the dequantised W tile sit in shared memory in the 128-byte-swizzled
// K-major layout wgmma reads through matrix descriptors (16-byte chunk c of row r at chunk c ^ (r % 8), atoms of
// 8 rows = 1024 bytes, 1024-byte aligned), so neither operand goes through registers. Per k-tile (64): wait for
// the ring, fence the generic-proxy writes (cp.async, the dequantised W) for the async proxy, one barrier, issue
// the next k-tile's copies, four wgmma on descriptors advanced by 32 bytes per k16, commit; dequantise the next
// k-tile's W while they run; wait. Shared memory: 3 x 21 KB ring + 2 x 16 KB dequantised W (96 KB): two CTAs per
// SM. Why fast: no ldmatrix traffic or fragment shuffles, and the dequantisation overlaps the tensor cores.
#include <cstdint>

#include "backend/cuda/gemm_tile.cuh"
#include "backend/cuda/gemm_wgmma.cuh"

namespace tansy::cuda {

namespace {

using namespace gemm_dev;

struct wg_layout {
    static constexpr int BMT = 2 * BM;  // tile rows
    static constexpr int STAGES = 3;
    static constexpr int RAW_BYTES = BK / 2;                    // 4-bit W bytes per row and k-tile
    static constexpr size_t A_BYTES = (size_t)BMT * BK * 2;     // fp16, 128 bytes per row, swizzled
    static constexpr size_t W_BYTES = (size_t)BN * RAW_BYTES;   // raw words
    static constexpr size_t SB_BYTES = (size_t)BN * 2 * 4;      // (scale, bias) per W row and half k-tile
    static constexpr size_t STAGE = A_BYTES + W_BYTES + SB_BYTES;
    static constexpr size_t DEQ = (size_t)BN * BK * 2;          // one dequantised W tile, fp16, swizzled
    static constexpr size_t SMEM = STAGES * STAGE + 2 * DEQ + 1024;  // + alignment of the dynamic base
    static_assert(A_BYTES % 1024 == 0 && STAGE % 1024 == 0 && DEQ % 1024 == 0, "1024-byte swizzle atoms");
    static_assert(BK * 2 == 128, "a k-tile row is one 128-byte swizzle row");
};

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
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 128 fp32, accumulated) += A (64 x 16 fp16, shared memory) B (16 x 128 fp16, shared memory), both K-major.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}
#endif

template <gemm_epilogue EPI>
__global__ void __launch_bounds__(k_threads, 2) gemm_wgmma_kernel(const gemm_params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = wg_layout;
    constexpr int STAGES = L::STAGES, BMT = L::BMT;
    constexpr int NACC = BN / 2;  // fp32 accumulators per thread (m64 x BN / 128 threads)
    constexpr int A_CHUNKS = BMT * (BK / 8) / k_threads;
    static_assert(BN * (L::RAW_BYTES / 16) == k_threads, "one 16-byte W chunk per thread and k-tile");
    extern __shared__ __align__(16) unsigned char smem_dyn[];
    unsigned char* smem = smem_dyn + ((1024 - (smem_addr(smem_dyn) & 1023)) & 1023);
    uint16_t* deq = reinterpret_cast<uint16_t*>(smem + STAGES * L::STAGE);  // [2][BN][BK] swizzled
    int expert, row0, rows;
    if (!tile_rows<BMT>(p, expert, row0, rows)) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
    const int nk = (int)(p.W.cols / BK);

    // copy roles. A: rows tid/8 + 32 i, 16-byte chunk tid % 8 of each k-tile's 64 fp16
    const uint16_t* asrc[A_CHUNKS];
    a_sources(p, row0, rows, tid, asrc);
    // W: tile column c = tid / 2, half h = tid % 2 of its k-tile (16 bytes = 32 weights, one (scale, bias) word)
    const int c = tid / 2, half = tid % 2;
    int64_t wrow;
    bool wok;
    const dmat& W = w_of_column<EPI>(p, c, expert, wrow, wok);
    const unsigned char* wsrc = reinterpret_cast<const unsigned char*>(W.w + wrow * W.row_words()) + half * 16;
    const uint32_t* sbsrc = W.sb + wrow * W.n_groups();
    const int group = p.W.group;

    auto issue = [&](int kt) {  // k-tile kt into ring stage kt % STAGES (one commit group)
        unsigned char* st = smem + (kt % STAGES) * L::STAGE;
        uint16_t* sa = reinterpret_cast<uint16_t*>(st);
#pragma unroll
        for (int i = 0; i < A_CHUNKS; i++)
            cp_async16_zfill(sa + sw128(tid / 8 + 32 * i, tid % 8), asrc[i] ? asrc[i] + kt * BK : p.x16, asrc[i] != nullptr);
        cp_async16_zfill(st + L::A_BYTES + tid * 16, wok ? wsrc + (size_t)kt * L::RAW_BYTES : (const unsigned char*)p.W.w, wok);
        uint32_t* ssb = reinterpret_cast<uint32_t*>(st + L::A_BYTES + L::W_BYTES);
        cp_async4_zfill(ssb + tid, wok ? sbsrc + (kt * BK + half * 32) / group : p.W.sb, wok);
    };
    auto dequant = [&](int kt) {  // this thread's 32 weights of k-tile kt into deq[kt & 1]
        const unsigned char* st = smem + (kt % STAGES) * L::STAGE;
        const uint4 rw[1] = {*reinterpret_cast<const uint4*>(st + L::A_BYTES + tid * 16)};
        const uint32_t sb = reinterpret_cast<const uint32_t*>(st + L::A_BYTES + L::W_BYTES)[tid];
        float v[32];
        dequant32<dfmt::q4>(v, rw, sb);
        uint16_t* d = deq + (kt & 1) * BN * BK;
#pragma unroll
        for (int j = 0; j < 4; j++) *reinterpret_cast<uint4*>(d + sw128(c, 4 * half + j)) = pack_f16x8(v + 8 * j);
    };

    ring_start<STAGES>(nk, issue, dequant);

    const uint32_t a_off = wg * 64 * BK * 2;  // this warpgroup's A rows in the tile (bytes)
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<STAGES - 3>();  // k-tiles <= kt + 1 have landed (this thread's copies)
        fence_proxy_async();          // ... and they and deq[kt & 1] are visible to wgmma
        __syncthreads();              // everyone's; k-tile kt-1's stage and deq[(kt+1) & 1] are free
        if (kt + STAGES - 1 < nk) issue(kt + STAGES - 1);
        cp_async_commit();
        const uint32_t sa = smem_addr(smem + (kt % STAGES) * L::STAGE) + a_off;
        const uint32_t sb = smem_addr(deq + (kt & 1) * BN * BK);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) wgmma_m64n128k16(acc, sw128_desc(sa + 32 * kk), sw128_desc(sb + 32 * kk));
        wgmma_commit();
        if (kt + 1 < nk) dequant(kt + 1);  // on the CUDA cores while the tensor cores work
        wgmma_wait_all();
        fence_acc(acc);
    }
    // accumulator i: n8 block i / 4, row +8 for (i / 2) odd, column +1 for i odd (the mma.sync C layout per warp)
    const int m0 = 64 * wg + 16 * (warp % 4) + lane / 4, n0 = 2 * (lane % 4);
    const float inv_scale = 1.0f / p.a_scale;  // a power of two: exact
#pragma unroll
    for (int j = 0; j < NACC / 4; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            store_pair<EPI>(p, row0, rows, m0 + 8 * h, n0 + 8 * j, acc[4 * j + 2 * h] * inv_scale,
                            acc[4 * j + 2 * h + 1] * inv_scale);
#endif
}

template <gemm_epilogue EPI>
void launch(const gemm_params& p, cudaStream_t stream) {
    constexpr size_t smem = wg_layout::SMEM;
    constexpr int BMT = wg_layout::BMT;
    allow_dynamic_smem<gemm_wgmma_kernel<EPI>>(smem);
    const int64_t cols = EPI == gemm_epilogue::swiglu ? BN / 2 : BN;
    const dim3 grid((unsigned)((p.N + cols - 1) / cols), (unsigned)(p.tiles ? p.max_tiles : (p.M + BMT - 1) / BMT));
    gemm_wgmma_kernel<EPI><<<grid, k_threads, smem, stream>>>(p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

bool gemm_wgmma_device() {
    static const bool ok = [] {
        int dev = 0, major = 0, minor = 0;
        if (cudaGetDevice(&dev) != cudaSuccess) return false;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        return major == 9 && minor == 0 && max_dynamic_smem() >= wg_layout::SMEM;
    }();
    return ok;
}

void gemm_wgmma(const gemm_params& p, cudaStream_t stream) {
    TANSY_CHECK(p.W.fmt == dfmt::q4 && !p.precise && p.W.group % 32 == 0 && (!p.tiles || p.tile_bm == wg_layout::BMT),
                "gemm_wgmma: 4-bit fast mode with %d-row tiles only", wg_layout::BMT);
    switch (p.epi) {
        case gemm_epilogue::store: return launch<gemm_epilogue::store>(p, stream);
        case gemm_epilogue::rows: return launch<gemm_epilogue::rows>(p, stream);
        case gemm_epilogue::swiglu: return launch<gemm_epilogue::swiglu>(p, stream);
    }
}

}  // namespace tansy::cuda
