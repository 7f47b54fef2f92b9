// GEMV, one input row of 4-bit rows in fast mode, per warp: x as two-level int8 (xq.cuh) and dp4a dot products.
// Warp gw (of NW) owns rows gw, gw + NW, ... and streams them through its own S-row cp.async ring in shared
// memory (queued before the PDL wait: weights only), waiting only for its own rows (cp.async groups, __syncwarp):
// no tile barriers, a row is used as soon as it lands; one barrier stages the input. As MoE gate/up's per-warp
// kernel (moe_decode_warp.cu). Optional epilogue, the router tap (gemv.cuh): an output projection that feeds the
// MoE also sums the router's logits over the rows it writes, so the router's own launch leaves the decode chain.
#include "backend/cuda/gemv_family.cuh"
#include "backend/cuda/xq.cuh"

namespace tansy::cuda::gemv_impl {

namespace {

__host__ __device__ inline int64_t gemv_row_bytes(const dmat& W) { return W.row_words() * 4 + W.n_groups() * 4; }

// TAP: p.tap's epilogue (gemv_router_tap_supports: warp w of block b owns row 16 b + w alone): thread e < R.rows
// holds router row e's codes for the block's 16 columns (loaded before the PDL wait: weights), and after the rows
// are written adds their part of logit e.
template <int CPL, int S, bool TAP>
__global__ void __launch_bounds__(k_stream_threads) gemv_warp_kernel(const gemv_params p) {
    constexpr int W = k_stream_threads / 32;
    static_assert(!TAP || W == 16, "the tap reads 16 router columns per block");
    extern __shared__ __align__(16) char smem[];
    __shared__ float s_tap[TAP ? W : 1];  // nw * out of the block's rows
    uint4 rc = {};
    uint32_t rsb = 0;
    if constexpr (TAP) {
        const dmat& R = p.tap.R;
        const int64_t c0 = (int64_t)blockIdx.x * W;
        if (threadIdx.x % 32 == 0) s_tap[threadIdx.x / 32] = 0.0f;
        if (threadIdx.x < R.rows) {
            rc = *reinterpret_cast<const uint4*>(R.w + threadIdx.x * R.row_words() + c0 / 4);
            rsb = R.sb[threadIdx.x * R.n_groups() + c0 / R.group];
        }
    }
    const int64_t K = p.W.cols, N = p.W.rows, rw = p.W.row_words(), ng = p.W.n_groups();
    const int64_t code = rw * 4, row_bytes = code + ng * 4;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    char* ring = smem + align16(xq_stage_bytes(K / 32)) + (int64_t)warp * S * row_bytes;
    const int64_t NW = (int64_t)gridDim.x * W, gw = (int64_t)blockIdx.x * W + warp;
    const int nr = gw < N ? (int)((N - gw + NW - 1) / NW) : 0;
    auto issue = [&](int i) {
        const int64_t row = gw + i * NW;
        char* s = ring + (i % S) * row_bytes;
        warp_copy_async(s, p.W.w + row * rw, (int)code);
        warp_copy_async(s + code, p.W.sb + row * ng, (int)(ng * 4));
    };
    pdl_trigger();
    ring_start<S>(nr, 0, issue);
    // lane 0: the first row's tap weight (a weight: before the wait) and, accumulating, its old output (after
    // it), so that the store after the first dot waits for no L2 round trip (out_proj, with the tap: the only
    // row of its warp, and the kernel's last step)
    float tap_w0 = 0.0f, old0 = 0.0f;
    if constexpr (TAP)
        if (lane == 0 && nr > 0) tap_w0 = p.tap.nw[gw];
    pdl_wait();
    float* out0 = nullptr;
    if (lane == 0 && nr > 0) {
        out0 = out_slot(p, gw, 0);
        if (p.accumulate) old0 = *out0;
    }
    xq_chunk xc[CPL];
    int gi[CPL];
    stage_lane_xq(xc, gi, smem, p.x, p.norm_w, p.eps, K, p.W.group);
    warp_ring_run<S>(nr, issue, [&](int i) {
        const char* s = ring + (i % S) * row_bytes;
        const uint4* w = reinterpret_cast<const uint4*>(s);
        const uint32_t* sb = reinterpret_cast<const uint32_t*>(s + code);
        float acc = 0;
#pragma unroll
        for (int c = 0; c < CPL; c++) {
            const uint32_t v = sb[gi[c]];
            acc += sb_scale(v) * chunk_dot_xq(w[lane + 32 * c], xc[c]) + sb_bias(v) * xc[c].sum;
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const int64_t row = gw + i * NW;
            float v;
            if (i == 0) {
                v = p.accumulate ? old0 + acc : acc;
                *out0 = v;
            } else {
                v = store_out(p, row, 0, acc);
            }
            if constexpr (TAP) s_tap[warp] = v * (i == 0 ? tap_w0 : p.tap.nw[row]);
        }
    });
    if constexpr (TAP) {
        __syncthreads();
        if (threadIdx.x < p.tap.R.rows) {
            const uint32_t w[4] = {rc.x, rc.y, rc.z, rc.w};
            float d = 0.0f, sx = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; k++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const float v = s_tap[4 * k + c];
                    d = fmaf(byte_to_float(w[k], c), v, d), sx += v;
                }
            const long long q = __float2ll_rn((sb_scale(rsb) * d + sb_bias(rsb) * sx) * k_tap_logit_scale);
            atomicAdd(p.tap.logits + threadIdx.x * k_tap_stride, (unsigned long long)q);  // two's complement: signed sums wrap right
        }
    }
}

template <int CPL, int S, bool TAP>
void launch_warp_as(const gemv_params& p, cudaStream_t stream) {
    const size_t smem = warp_ring_smem(xq_stage_bytes(p.W.cols / 32), S, gemv_row_bytes(p.W));
    allow_dynamic_smem<gemv_warp_kernel<CPL, S, TAP>>(stream_smem_limit());
    const int64_t blocks = std::min<int64_t>(sm_count(), (p.W.rows + k_stream_threads / 32 - 1) / (k_stream_threads / 32));
    launch_pdl(gemv_warp_kernel<CPL, S, TAP>, dim3((unsigned)blocks), dim3(k_stream_threads), smem, stream, p);
}

template <int CPL>
void launch_warp(const gemv_params& p, int slots, cudaStream_t stream) {
    if (p.tap.logits) {
        if (slots == 6) launch_warp_as<CPL, 6, true>(p, stream);
        else launch_warp_as<CPL, 3, true>(p, stream);
    } else {
        if (slots == 6) launch_warp_as<CPL, 6, false>(p, stream);
        else launch_warp_as<CPL, 3, false>(p, stream);
    }
}

}  // namespace

// Ring rows per warp: 6 where they fit (K = 2048: a projection's ~6 rows per warp all in flight), else 3; 0 where
// the kernel does not apply (a row's scale/bias words must be whole 16-byte copies).
int gemv_warp_slots(const gemv_params& p) {
    if ((p.W.n_groups() * 4) % 16 != 0) return 0;
    const int64_t rb = gemv_row_bytes(p.W);
    for (int s : {6, 3})
        if (warp_ring_smem(xq_stage_bytes(p.W.cols / 32), s, rb) <= stream_smem_limit() &&
            (size_t)(k_stream_threads / 32) * s * rb <= 120 * 1024)
            return s;
    return 0;
}

void run_warp(const gemv_params& p, int cpl, int slots, cudaStream_t stream) {
    switch (cpl) {
        case 1: launch_warp<1>(p, slots, stream); break;
        case 2: launch_warp<2>(p, slots, stream); break;
        case 4: launch_warp<4>(p, slots, stream); break;
        default: TANSY_CHECK(false, "gemv: no int8-input kernel for %lld chunks", (long long)(p.W.cols / 32));
    }
}

}  // namespace tansy::cuda::gemv_impl
