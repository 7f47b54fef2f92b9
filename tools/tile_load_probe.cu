// How fast can one decode kernel's worth of weight tiles reach shared memory? A probe for the decode kernels'
// loading scheme (docs/PERF.md): every block of a one-block-per-SM grid pulls its share of B bytes
// (block-strided 16 KB segments, as the decode kernels' ring tiles) into shared memory, then touches one word of
// each segment. Three ways: per-thread cp.async of 16 bytes (what stream.cuh does now), one TMA bulk copy per
// segment completing on an mbarrier (cp.async.bulk, sm_90), and plain 16-byte loads into registers. Each launch
// reads a different region of a 1 GB buffer (no L2 reuse); 200 launches captured in one CUDA graph, so the
// figure includes the graph's per-kernel launch cost as a decode step pays it.
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -std=c++17 tile_load_probe.cu -o probe && ./probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                                       \
        }                                                                                       \
    } while (0)

constexpr int SEG = 16 * 1024, THREADS = 512, MAX_SEGS = 8;

__device__ unsigned g_sink;

__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int MODE>
__global__ void __launch_bounds__(THREADS) probe(const char* src, int64_t n_seg) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) uint64_t bar;
    const int tid = threadIdx.x;
    int mine = 0;
    for (int64_t s = blockIdx.x; s < n_seg && mine < MAX_SEGS; s += gridDim.x) mine++;
    unsigned acc = 0;
    if constexpr (MODE == 0) {  // cp.async, 16 bytes per thread per round
        for (int j = 0; j < mine; j++) {
            const char* g = src + (blockIdx.x + (int64_t)j * gridDim.x) * SEG;
            for (int o = 16 * tid; o < SEG; o += 16 * THREADS)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr(smem + j * SEG + o)), "l"(g + o)
                             : "memory");
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
    } else if constexpr (MODE == 1) {  // TMA bulk copies on one mbarrier
        if (tid == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(saddr(&bar)));
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if (tid == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(saddr(&bar)), "r"(mine * SEG)
                         : "memory");
            for (int j = 0; j < mine; j++) {
                const char* g = src + (blockIdx.x + (int64_t)j * gridDim.x) * SEG;
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                        saddr(smem + j * SEG)),
                    "l"(g), "r"(SEG), "r"(saddr(&bar))
                    : "memory");
            }
        }
        uint32_t done = 0;
        while (!done)
            asm volatile(
                "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(saddr(&bar))
                : "memory");
    } else {  // plain 16-byte loads into registers, all issued before any is used
        uint4 v[MAX_SEGS * (SEG / (16 * THREADS))];
#pragma unroll
        for (int j = 0; j < MAX_SEGS; j++)
#pragma unroll
            for (int r = 0; r < SEG / (16 * THREADS); r++) {
                if (j < mine) {
                    const char* g = src + (blockIdx.x + (int64_t)j * gridDim.x) * SEG + 16 * (tid + r * THREADS);
                    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(v[j * 2 + r].x), "=r"(v[j * 2 + r].y), "=r"(v[j * 2 + r].z), "=r"(v[j * 2 + r].w)
                                 : "l"(g));
                } else {
                    v[j * 2 + r] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
        for (int i = 0; i < MAX_SEGS * 2; i++) acc ^= v[i].x ^ v[i].w;
    }
    if constexpr (MODE != 2)
        for (int j = 0; j < mine; j++) acc ^= *reinterpret_cast<const unsigned*>(smem + j * SEG + 4 * (tid % 64));
    if (acc == 0x12345678u) g_sink = acc;  // keeps the loads
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t region = 64u << 20, total = 16 * region;  // 16 regions of 64 MB, rotated
    char* buf = nullptr;
    CK(cudaMalloc(&buf, total));
    CK(cudaMemset(buf, 1, total));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (auto* k : {probe<0>, probe<1>, probe<2>})
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_SEGS * SEG));
    const char* names[3] = {"cp.async 16B/thread", "TMA bulk + mbarrier", "ld.global 16B -> regs"};
    std::printf("%d SMs, one block of %d threads per SM, 16 KB segments block-strided\n", sms, THREADS);
    for (double mb : {0.56, 1.8, 4.7, 5.3, 10.6, 14.0}) {
        const int64_t n_seg = (int64_t)(mb * 1e6 / SEG + 0.5);
        if (n_seg > (int64_t)sms * MAX_SEGS) continue;
        for (int mode = 0; mode < 3; mode++) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            const int launches = 200;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < launches; i++) {
                const char* src = buf + (size_t)(i % 16) * region;
                if (mode == 0) probe<0><<<sms, THREADS, MAX_SEGS * SEG, st>>>(src, n_seg);
                if (mode == 1) probe<1><<<sms, THREADS, MAX_SEGS * SEG, st>>>(src, n_seg);
                if (mode == 2) probe<2><<<sms, THREADS, MAX_SEGS * SEG, st>>>(src, n_seg);
            }
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, st));  // warm-up
            CK(cudaStreamSynchronize(st));
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a));
            CK(cudaEventCreate(&b));
            float best = 1e30f;
            for (int rep = 0; rep < 5; rep++) {
                CK(cudaEventRecord(a, st));
                CK(cudaGraphLaunch(ge, st));
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, a, b));
                if (ms < best) best = ms;
            }
            const double us = best * 1e3 / launches, bytes = (double)n_seg * SEG;
            std::printf("%6.2f MB  %-24s %7.2f us per kernel  %7.0f GB/s\n", bytes / 1e6, names[mode], us,
                        bytes / us / 1e3);
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
    }
    return 0;
}
