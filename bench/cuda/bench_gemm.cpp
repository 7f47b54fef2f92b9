// The prompt GEMMs alone, at the full-size model's shapes: a T-token prompt's routed gate/up (SwiGLU, rows gathered
// by moe_plan's tiles), routed down, and one dense projection, each launched `--reps` times back to back
// per round. Weights are filler bytes (the timing does not depend on their values) so no checkpoint or host-side
// quantisation is needed: a kernel change is measured in seconds instead of a whole `tansy bench --prompts`.
//   bench_gemm [--tokens 2048] [--routing uniform|hot] [--rounds 3] [--reps 20]
// Routing: uniform draws each token's k experts at random (as the synthetic model's router does: ~T k / E rows an
// expert, tiles partly filled); hot sends every token to the same k experts (full tiles, their weights stay in L2).
// Figures: time per call, useful TFLOP/s (rows actually routed) and % of the dense peak, and the bytes a call must
// move at least (weights of the experts touched, activations in, results out) as GB/s.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/device.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe.cuh"
#include "cli/args.h"
#include "core/check.h"

using namespace tansy;

namespace {

// A 4-bit matrix (groups of 64) of filler bytes on the device; its buffers stay alive in `keep`.
cuda::dmat filler_q4(int64_t rows, int64_t cols, std::vector<cuda::device_buffer>& keep) {
    cuda::dmat m;
    m.fmt = cuda::dfmt::q4, m.rows = rows, m.cols = cols, m.group = 64;
    keep.emplace_back((size_t)(rows * cols / 2));
    TANSY_CHECK(cudaMemset(keep.back().get(), 0x37, keep.back().size()) == cudaSuccess, "cudaMemset");
    m.w = (const uint32_t*)keep.back().get();
    keep.emplace_back((size_t)(rows * (cols / 64) * 4));
    // bf16 (scale | bias << 16) of ~5e-22 each: products stay far from fp16 overflow
    TANSY_CHECK(cudaMemset(keep.back().get(), 0x1c, keep.back().size()) == cudaSuccess, "cudaMemset");
    m.sb = (const uint32_t*)keep.back().get();
    return m;
}

cuda::device_buffer filler_f16(size_t values) {
    cuda::device_buffer b(values * 2);
    TANSY_CHECK(cudaMemset(b.get(), 0x2c, b.size()) == cudaSuccess, "cudaMemset");  // fp16 ~0.06
    return b;
}

struct op {
    const char* name;
    cuda::gemm_params p;
    double flops, bytes;
};

}  // namespace

int main(int argc, char** argv) {
    arg_parser a("bench_gemm", "[--tokens T] [--routing uniform|hot] [--bm N] [--rounds N] [--reps N]",
                 "Times the 4-bit prompt GEMMs (routed gate/up and down, one dense projection) at the full-size shapes.");
    a.option("--tokens", "T", "prompt tokens (default 2048)");
    a.option("--routing", "MODE", "uniform (default) or hot");
    a.option("--bm", "N", "rows per routed tile: 64, 80 (wgmma only) or 128 (default: as the model picks)");
    a.option("--rounds", "N", "rounds over the three calls (default 3)");
    a.option("--reps", "N", "launches timed per call and round (default 20)");
    a.option("--peak-tflops", "X", "dense fp16 tensor peak for the % column (default 989, the H200's and H100's)");
    try {
        if (!a.parse(argc - 1, argv + 1)) return 0;
        const int T = (int)a.integer("--tokens", 2048), rounds = (int)a.integer("--rounds", 3), reps = (int)a.integer("--reps", 20);
        const std::string routing = a.str("--routing", "uniform");
        const double peak = a.number("--peak-tflops", 989.0);
        if (T < 1 || T > 65536 || rounds < 1 || reps < 1) fail("--tokens 1..65536, --rounds and --reps >= 1");
        if (routing != "uniform" && routing != "hot") fail("--routing: uniform or hot, not '%s'", routing.c_str());
        const int64_t bm_arg = a.integer("--bm", 64);
        if (bm_arg != 64 && bm_arg != 80 && bm_arg != 128) fail("--bm: 64, 80 or 128, not %lld", (long long)bm_arg);
        std::string why;
        if (cuda::device_count(&why) == 0) fail("%s", why.c_str());
        // Qwen3.6-35B-A3B: hidden 2048, 256 experts of 512 features, top-8; the DeltaNet input projection's 8,192 rows
        const int E = 256, k = 8;
        const int64_t D = 2048, F = 512, ND = 8192;

        std::mt19937 rng(7);
        std::vector<int32_t> idx((size_t)T * k), pool(E);
        for (int e = 0; e < E; e++) pool[(size_t)e] = e;
        for (int t = 0; t < T; t++) {
            if (routing == "uniform")
                for (int j = 0; j < k; j++) std::swap(pool[(size_t)j], pool[(size_t)(j + (int)(rng() % (uint32_t)(E - j)))]);
            for (int j = 0; j < k; j++) idx[(size_t)t * k + j] = pool[(size_t)j];
        }
        const std::set<int32_t> touched(idx.begin(), idx.end());
        const double experts = (double)touched.size();

        std::vector<cuda::device_buffer> keep;
        const cuda::dmat Wg = filler_q4(E * F, D, keep), Wu = filler_q4(E * F, D, keep), Wd = filler_q4(E * D, F, keep),
                         Wn = filler_q4(ND, D, keep);
        const int bm = (int)a.integer("--bm", cuda::gemm_grouped_tile_rows(Wg, false, T, E, k));
        if (bm == 80 && !cuda::gemm_wgmma_enabled()) fail("--bm 80: tiles of the wgmma GEMM, which this build or device lacks");
        if (bm == 128 && !cuda::gemm_wide_tiles_fit(cuda::dfmt::q4)) fail("--bm 128: the tiles do not fit this device");
        const int max_tiles = cuda::moe_max_tiles(T, E, k, bm);
        cuda::device_buffer didx((size_t)T * k * 4), perm((size_t)T * k * 4), pos((size_t)T * k * 4),
            tiles((size_t)max_tiles * sizeof(cuda::gemm_tile)), ntiles(4), y((size_t)T * k * D * 4), yn((size_t)T * ND * 4);
        didx.upload(idx.data(), idx.size() * 4);
        const cuda::device_buffer x16 = filler_f16((size_t)T * D), h16 = filler_f16((size_t)T * k * F);
        cuda::moe_plan((int32_t*)perm.get(), (int32_t*)pos.get(), (cuda::gemm_tile*)tiles.get(), (int32_t*)ntiles.get(),
                       (const int32_t*)didx.get(), T, E, k, bm, 0);
        int32_t n_tiles = 0;
        ntiles.download(&n_tiles, 4);

        const double q4_bytes_per_weight = 0.5 + 4.0 / 64;  // codes + a (scale, bias) word per 64
        std::vector<op> ops(3);
        cuda::gemm_params& g = ops[0].p;
        g.W = Wg, g.W2 = Wu, g.N = F, g.x16 = (const uint16_t*)x16.get(), g.ldx16 = D;
        g.gather = (const int32_t*)perm.get(), g.gather_div = k;
        g.tiles = (const cuda::gemm_tile*)tiles.get(), g.n_tiles = (const int32_t*)ntiles.get(), g.max_tiles = max_tiles;
        g.tile_bm = bm, g.epi = cuda::gemm_epilogue::swiglu, g.out16 = (uint16_t*)h16.get(), g.ldo = F;
        ops[0].name = "gate/up";
        ops[0].flops = 2.0 * T * k * 2 * F * D;
        ops[0].bytes = experts * 2 * F * D * q4_bytes_per_weight + 2.0 * T * D + 2.0 * T * k * F;
        cuda::gemm_params& d = ops[1].p;
        d = g;
        d.W = Wd, d.W2 = {}, d.N = D, d.x16 = (const uint16_t*)h16.get(), d.ldx16 = F, d.gather = nullptr, d.out16 = nullptr;
        d.epi = cuda::gemm_epilogue::rows, d.out = (float*)y.get(), d.ldo = D, d.M = T * k;
        ops[1].name = "down";
        ops[1].flops = 2.0 * T * k * D * F;
        ops[1].bytes = experts * D * F * q4_bytes_per_weight + 2.0 * T * k * F + 4.0 * T * k * D;
        cuda::gemm_params& n = ops[2].p;
        n.W = Wn, n.N = ND, n.M = T, n.x16 = (const uint16_t*)x16.get(), n.ldx16 = D, n.epi = cuda::gemm_epilogue::store;
        n.seg[0].out = (float*)yn.get(), n.seg[0].ld = ND, n.split_k = 1;
        ops[2].name = "dense";
        ops[2].flops = 2.0 * T * ND * D;
        ops[2].bytes = ND * D * q4_bytes_per_weight + 2.0 * T * D + 4.0 * T * ND;

        printf("bench_gemm: %d tokens, %s routing (%d experts touched, %d tiles of %d rows), %d x %d launches a figure\n", T,
               routing.c_str(), (int)experts, n_tiles, bm, rounds, reps);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0), cudaEventCreate(&e1);
        for (int r = 0; r < rounds; r++)
            for (const op& o : ops) {
                for (int i = 0; i < 3; i++) cuda::gemm(o.p, 0);
                cudaEventRecord(e0, 0);
                for (int i = 0; i < reps; i++) cuda::gemm(o.p, 0);
                cudaEventRecord(e1, 0);
                TANSY_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "GEMM launches failed");
                float ms = 0;
                cudaEventElapsedTime(&ms, e0, e1);
                const double us = 1000.0 * ms / reps, tflops = o.flops / us * 1e-6;
                printf("  round %d  %-8s %8.1f us  %6.1f TFLOP/s  %5.1f%% of peak  %7.1f MB  %6.0f GB/s\n", r + 1, o.name, us,
                       tflops, 100.0 * tflops / peak, o.bytes / 1e6, o.bytes / us * 1e-3);
            }
        cudaEventDestroy(e0), cudaEventDestroy(e1);
        return 0;
    } catch (const std::exception& e) {
        fprintf(stderr, "%s\n", e.what());
        return 1;
    }
}
