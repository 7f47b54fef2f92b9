// Gated DeltaNet for prompt processing (MODEL.md §4.2-4.6), the path gdn_forward (gdn.cu) takes for spans of
// more than k_gdn_recur_max_rows rows. fp32 throughout. The conv, SiLU, norms and gates are bit-identical to
// recur_kernel in gdn.cu; the token scan (v1) differs from it only in summation order, the chunked form (v2,
// the default) computes the same recurrence in the chunk-parallel form of MODEL.md §4.7.
// v1 (gdn v2): two kernels.
//  1. prep_kernel, one block of 128 threads per (8 rows, unit), unit = a key head (its 128 q and 128 k channels)
//     or 128 v channels; fully parallel. Causal conv (K = 4) over the raw rows, the first K-1 rows of a span
//     taking their window from its conv state (parity meta[1]&1), then SiLU; q^ = q rsqrt(|q|^2 + 1e-6)/sqrt(dk)
//     and k^ = k rsqrt(|k|^2 + 1e-6) -> work; v -> p.o in place (the scan reads v[t,h,j] from the address it
//     then writes o[t,h,j] to, in the same block); beta = sigmoid(b), alpha = exp(-exp(A_log) softplus(a +
//     dt_bias)) -> work as [Hv, T, 2] (contiguous per head for the scan); the span's last K-1 raw rows -> the
//     other parity buffer (decode reads it once advance_seqs has flipped the parity).
//  2. scan_kernel, one block of 4 warps per (span, value head, 32 value columns). The state slice S[:, 32 cols]
//     (dk = 128 rows) lives in registers: lane l of warp w holds key rows 32(l%4) .. +31 of column 8w + l/4.
//     Per token: u = S^T k^ (32 FMAs, 2 shuffles over the lane's 4-lane group), delta = beta (v - alpha u),
//     S = alpha S + k^ delta^T, o = S^T q^ (32 FMAs, 2 shuffles, reduced while the next token's u is): no
//     shared-memory reduction and no barrier per token. Chunks of 32 tokens of q^, k^, v, (beta, alpha) are
//     staged into shared memory by cp.async, double-buffered (2 x 41.2 KB), two barriers per chunk; staged
//     k^/q^ rows are padded to 36 floats per 32-row quarter so the 4 quarters' LDS.128 hit distinct banks.
//     Grid for the real shape: 32 heads x 4 column blocks = 128 blocks per long span, 512 warps: one per SM
//     sub-partition of an H200 (132 SMs); 32 columns per block because narrower blocks only add copies of
//     the staged k^/q^ (1.3 KB per token per block) without adding warps, wider ones would leave SMs idle.
//     Expected: ~180 instructions per lane and token (SASS); one warp per sub-partition makes it latency-bound
//     (LDS -> u dot -> 2 shuffles -> delta -> update) at ~230-260 cycles: ~0.12 us per token and layer for
//     one prompt, less per token with several long spans in the batch (2 blocks per SM hide each other).
//     note: 2 columns x 16 rows per lane would halve the k^/q^ reads from shared memory (if LDS.128
//     broadcasts turn out to be the limit) at the cost of a longer shuffle chain; the next step beyond that
//     is the chunked tensor-core form (MODEL.md §4.7).
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gdn.cuh"
#include "backend/cuda/mma.cuh"  // cp.async

namespace tansy::cuda {

namespace {

constexpr int DK = 128;                   // key head dim; also the prep block size
constexpr int PREP_ROWS = 8;              // rows per prep block
constexpr int SCAN_WARPS = 4;
constexpr int SCAN_COLS = 8 * SCAN_WARPS;  // value columns per scan block (8 per warp)
constexpr int SCAN_CHUNK = 32;            // tokens per staged chunk
constexpr int QUARTER_PAD = 36;           // floats per 32-row quarter of a staged k^/q^ row (32 + 4 pad)
constexpr int KQ_FLOATS = 4 * QUARTER_PAD;
// One chunk buffer: k^ [CHUNK][4][36] | q^ [CHUNK][4][36] | v [CHUNK][32] | (beta, alpha) [CHUNK][2]
constexpr int BUF_K = 0, BUF_Q = SCAN_CHUNK * KQ_FLOATS, BUF_V = 2 * SCAN_CHUNK * KQ_FLOATS,
              BUF_G = BUF_V + SCAN_CHUNK * SCAN_COLS, BUF_FLOATS = BUF_G + 2 * SCAN_CHUNK;
static_assert(BUF_Q % 4 == 0 && BUF_V % 4 == 0 && BUF_G % 4 == 0 && BUF_FLOATS % 4 == 0, "16-byte staging");
constexpr size_t SCAN_SMEM = 2 * (size_t)BUF_FLOATS * sizeof(float);

// Workspace views (gdn.cuh): q^ [T, Hk*dk] | k^ [T, Hk*dk] | (beta, alpha) [Hv, T, 2].
__device__ __forceinline__ float* work_q(const gdn_params& p) { return p.work; }
__device__ __forceinline__ float* work_k(const gdn_params& p) { return p.work + (int64_t)p.T * p.Hk * DK; }
__device__ __forceinline__ float* work_g(const gdn_params& p) { return p.work + 2 * (int64_t)p.T * p.Hk * DK; }

// ------------------------------------------------------------------------------------------------ prep

// The conv sum of channel ch at batch row `row`, span offset off < K-1: the inputs before the span come from
// its conv state `cold` ([K-1, C], oldest first). Out of line: only a span's first K-1 rows take it.
template <int K>
__device__ __noinline__ float conv_span_head(const float* qkv, const float* conv_w, const float* cold, int64_t C,
                                             int row, int off, int ch) {
    constexpr int P = K - 1;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int idx = off - P + j;  // span offset of input j
        const float x = idx >= 0 ? qkv[(int64_t)(row - P + j) * C + ch] : cold[(int64_t)(P + idx) * C + ch];
        acc = fmaf(conv_w[(int64_t)ch * K + j], x, acc);
    }
    return acc;
}

template <int K>
__global__ void __launch_bounds__(DK) prep_kernel(const gdn_params p, int min_rows) {
    constexpr int P = K - 1;
    __shared__ int s_span[PREP_ROWS], s_off[PREP_ROWS], s_n[PREP_ROWS];
    __shared__ const float* s_cold[PREP_ROWS];  // the span's conv state (read parity)
    __shared__ float* s_cnew[PREP_ROWS];        // its next conv state (the other parity)
    __shared__ float s_red[2][PREP_ROWS][DK / 32];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int r0 = blockIdx.x * PREP_ROWS, unit = blockIdx.y;
    const int64_t C = p.shape.conv_ch;
    const int kd = p.Hk * DK, vd = p.Hv * p.dv;

    // 1. the long span (>= min_rows rows) each of the block's rows belongs to, -1 for none
    if (tid < PREP_ROWS) s_span[tid] = -1;
    __syncthreads();
    for (int i = tid; i < p.n_spans; i += DK) {
        const dspan s = p.spans[i];
        if (s.n < min_rows) continue;
        for (int r = max(s.row0, r0); r < min(s.row0 + s.n, r0 + PREP_ROWS); r++) s_span[r - r0] = i;
    }
    __syncthreads();
    if (tid < PREP_ROWS && s_span[tid] >= 0) {
        const dspan s = p.spans[s_span[tid]];
        const dseq sq = p.seqs[s_span[tid]];
        const int parity = sq.meta[1] & 1;
        s_off[tid] = r0 + tid - s.row0, s_n[tid] = s.n;
        s_cold[tid] = conv_buf(sq, p.shape, p.slot, parity);
        s_cnew[tid] = conv_buf(sq, p.shape, p.slot, parity ^ 1);
    }
    __syncthreads();
    bool any = false;
#pragma unroll
    for (int rr = 0; rr < PREP_ROWS; rr++) any |= s_span[rr] >= 0;
    if (!any) return;  // block-uniform

    // 2. causal conv + SiLU of channel ch for the block's rows (the sum of conv_at in gdn.cu, same order), and
    //    the span's new conv window (its last K-1 raw inputs, oldest first) into the other parity buffer
    auto conv_rows = [&](float (&y)[PREP_ROWS], int ch) {
        float w[K];
#pragma unroll
        for (int j = 0; j < K; j++) w[j] = p.conv_w[(int64_t)ch * K + j];
        float x[PREP_ROWS + P];  // raw inputs of batch rows r0-P .. r0+PREP_ROWS-1 (0 outside the batch)
#pragma unroll
        for (int i = 0; i < PREP_ROWS + P; i++) {
            const int row = r0 - P + i;
            x[i] = row >= 0 && row < p.T ? p.qkv[(int64_t)row * C + ch] : 0.0f;
        }
#pragma unroll
        for (int rr = 0; rr < PREP_ROWS; rr++) {
            y[rr] = 0.0f;
            if (s_span[rr] < 0) continue;
            const int off = s_off[rr];
            float acc = 0.0f;
            if (off >= P) {
#pragma unroll
                for (int j = 0; j < K; j++) acc = fmaf(w[j], x[rr + j], acc);
            } else {
                acc = conv_span_head<K>(p.qkv, p.conv_w, s_cold[rr], C, r0 + rr, off, ch);
            }
            y[rr] = siluf_(acc);
            const int slot = off - (s_n[rr] - P);  // place of this row in the new window
            if (slot >= 0) s_cnew[rr][(int64_t)slot * C + ch] = x[rr + P];
        }
    };

    if (unit < p.Hk) {
        // 3. q and k of key head `unit`, L2-normalised per row (MODEL.md §4.4), with recur_kernel's sums
        float yq[PREP_ROWS], yk[PREP_ROWS];
        conv_rows(yq, unit * DK + tid);
        conv_rows(yk, kd + unit * DK + tid);
#pragma unroll
        for (int rr = 0; rr < PREP_ROWS; rr++) {
            const float sq = warp_sum(yq[rr] * yq[rr]), sk = warp_sum(yk[rr] * yk[rr]);
            if (lane == 0) s_red[0][rr][warp] = sq, s_red[1][rr][warp] = sk;
        }
        __syncthreads();
        const float qscale = rsqrtf((float)DK);
        float *wq = work_q(p), *wk = work_k(p);
#pragma unroll
        for (int rr = 0; rr < PREP_ROWS; rr++) {
            if (s_span[rr] < 0) continue;
            float tq = 0, tk = 0;
#pragma unroll
            for (int w = 0; w < DK / 32; w++) tq += s_red[0][rr][w], tk += s_red[1][rr][w];
            const int64_t i = (int64_t)(r0 + rr) * kd + unit * DK + tid;
            wq[i] = yq[rr] * rsqrtf(tq + 1e-6f) * qscale;
            wk[i] = yk[rr] * rsqrtf(tk + 1e-6f);
        }
    } else {
        // 4. v channels: conv + SiLU only, into p.o ([T, Hv*dv], the v channels' own layout)
        const int vc = (unit - p.Hk) * DK + tid;
        if (vc < vd) {
            float yv[PREP_ROWS];
            conv_rows(yv, 2 * kd + vc);
#pragma unroll
            for (int rr = 0; rr < PREP_ROWS; rr++)
                if (s_span[rr] >= 0) p.o[(int64_t)(r0 + rr) * vd + vc] = yv[rr];
        }
    }

    // 5. gates (MODEL.md §4.3), by the unit-0 blocks: beta = sigmoid(b),
    //    alpha = exp(-exp(A_log) softplus(a + dt_bias))
    if (unit == 0) {
        float* wg = work_g(p);
        for (int i = tid; i < PREP_ROWS * p.Hv; i += DK) {
            const int rr = i / p.Hv, h = i % p.Hv;
            if (s_span[rr] < 0) continue;
            const int64_t row = r0 + rr;
            const float A = -expf(p.A_log[h]);
            const float beta = sigmoidf_(p.b[row * p.Hv + h]);
            const float alpha = expf(A * gdn_softplus(p.a[row * p.Hv + h] + p.dt_bias[h]));
            *reinterpret_cast<float2*>(wg + ((int64_t)h * p.T + row) * 2) = make_float2(beta, alpha);
        }
    }
}

// ------------------------------------------------------------------------------------------------ scan

// Stages nt tokens from batch row `row` on (key head kh, value head h, columns col0 ..) into buf; one commit group.
__device__ __forceinline__ void stage_chunk(float* buf, const gdn_params& p, int row, int nt, int kh, int h, int col0) {
    const int kd = p.Hk * DK;
    const float *wq = work_q(p), *wk = work_k(p), *wg = work_g(p);
    for (int i = threadIdx.x; i < nt * (DK / 4); i += blockDim.x) {  // a k^/q^ row is 32 pieces of 4 floats
        const int t = i / (DK / 4), piece = i % (DK / 4);
        const int64_t src = (int64_t)(row + t) * kd + kh * DK + piece * 4;
        const int dst = t * KQ_FLOATS + (piece / 8) * QUARTER_PAD + (piece % 8) * 4;
        cp_async16(buf + BUF_K + dst, wk + src);
        cp_async16(buf + BUF_Q + dst, wq + src);
    }
    const int64_t vd = (int64_t)p.Hv * p.dv;
    for (int i = threadIdx.x; i < nt * (SCAN_COLS / 4); i += blockDim.x) {
        const int t = i / (SCAN_COLS / 4), piece = i % (SCAN_COLS / 4);
        cp_async16(buf + BUF_V + t * SCAN_COLS + piece * 4, p.o + (row + t) * vd + h * p.dv + col0 + piece * 4);
    }
    for (int t = threadIdx.x; t < nt; t += blockDim.x)
        cp_async8(buf + BUF_G + 2 * t, wg + ((int64_t)h * p.T + row + t) * 2);
    cp_async_commit();
}

// Sum over the 4 lanes of a column (lanes 4c .. 4c+3): the same bits in all four.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__global__ void __launch_bounds__(SCAN_WARPS * 32) scan_kernel(const gdn_params p, int min_rows) {
    extern __shared__ float4 smem_[];
    float* smem = reinterpret_cast<float*>(smem_);
    const dspan sp = p.spans[blockIdx.x];
    if (sp.n < min_rows) return;
    const int h = blockIdx.y, col0 = blockIdx.z * SCAN_COLS, kh = h / (p.Hv / p.Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quarter = lane % 4, lc = 8 * warp + lane / 4;  // key rows 32*quarter .. +31 of column col0 + lc
    const int64_t vd = (int64_t)p.Hv * p.dv;
    float* o_col = p.o + h * p.dv + col0 + lc;  // + row * vd
    const int n_chunks = (sp.n + SCAN_CHUNK - 1) / SCAN_CHUNK;
    stage_chunk(smem, p, sp.row0, min(SCAN_CHUNK, sp.n), kh, h, col0);

    float* S = s_buf(p.seqs[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0 + lc;
    float st[32];
#pragma unroll
    for (int i = 0; i < 32; i++) st[i] = S[(int64_t)(32 * quarter + i) * p.dv];

    // o of the previous token as this lane's partials, reduced alongside the next token's u (off the chain)
    float o_part = 0.0f;
    float* o_prev_at = nullptr;          // where that o goes (nullptr before the first token)
    float* o_at = o_col + sp.row0 * vd;  // where this token's o goes
    for (int c = 0; c < n_chunks; c++) {
        const int t0 = c * SCAN_CHUNK, nt = min(SCAN_CHUNK, sp.n - t0);
        if (c + 1 < n_chunks) {
            stage_chunk(smem + ((c + 1) & 1) * BUF_FLOATS, p, sp.row0 + t0 + SCAN_CHUNK,
                        min(SCAN_CHUNK, sp.n - t0 - SCAN_CHUNK), kh, h, col0);
            cp_async_wait<1>();  // this chunk's group has landed (the next one may still be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this chunk are visible
        const float* buf = smem + (c & 1) * BUF_FLOATS;
#pragma unroll 2  // lets the next token's k^ loads start during this token's update
        for (int t = 0; t < nt; t++) {
            const float* kt = buf + BUF_K + t * KQ_FLOATS + quarter * QUARTER_PAD;
            const float* qt = buf + BUF_Q + t * KQ_FLOATS + quarter * QUARTER_PAD;
            float k[32];
#pragma unroll
            for (int i = 0; i < 32; i += 4) {
                const float4 f = *reinterpret_cast<const float4*>(kt + i);
                k[i] = f.x, k[i + 1] = f.y, k[i + 2] = f.z, k[i + 3] = f.w;
            }
            const float v = buf[BUF_V + t * SCAN_COLS + lc];
            const float2 ba = *reinterpret_cast<const float2*>(buf + BUF_G + 2 * t);
            const float beta = ba.x, alpha = ba.y;
            // 1. u = S^T k over the lane's 32 rows (4 accumulators for ILP), then over the column's 4 lanes
            float u4[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 32; i++) u4[i % 4] = fmaf(st[i], k[i], u4[i % 4]);
            const float u = quad_sum((u4[0] + u4[1]) + (u4[2] + u4[3]));
            const float o_prev = quad_sum(o_part);
            if (quarter == 0 && o_prev_at) *o_prev_at = o_prev;
            // 2. delta = beta (v - alpha u)   (recur_kernel: the same expression)
            const float delta = beta * (v - alpha * u);
            // 3. S = alpha S + k delta^T;  4. o = S^T q (the updated state), partials over the lane's rows
            float q[32];
#pragma unroll
            for (int i = 0; i < 32; i += 4) {
                const float4 f = *reinterpret_cast<const float4*>(qt + i);
                q[i] = f.x, q[i + 1] = f.y, q[i + 2] = f.z, q[i + 3] = f.w;
            }
            float o4[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 32; i++) {
                st[i] = fmaf(k[i], delta, alpha * st[i]);
                o4[i % 4] = fmaf(st[i], q[i], o4[i % 4]);
            }
            o_part = (o4[0] + o4[1]) + (o4[2] + o4[3]);
            o_prev_at = o_at;
            o_at += vd;
        }
        __syncthreads();  // all warps are done with this buffer before the next iteration refills it
    }
    const float o_last = quad_sum(o_part);
    if (quarter == 0) *o_prev_at = o_last;
#pragma unroll
    for (int i = 0; i < 32; i++) S[(int64_t)(32 * quarter + i) * p.dv] = st[i];
}

// ------------------------------------------------------------------------------------------------ chunked

// v2 (gdn v3): the chunk-parallel form (MODEL.md §4.7, the CPU twin's cpu::delta_rule_chunked), fp32, chunks of
// CC = 64 rows from each span's start (as the twin cuts them).
//  3. chunk_kernel, one block of 256 threads per (chunk, value head, span), fully parallel: gamma (cumulative
//     log decay, into the alpha slot of (beta, alpha): the scan reads it there), the strictly-lower
//     L = beta_r (k_r.k_s) e^(gamma_r - gamma_s), the unit-lower inverse Tinv = (I + L)^-1 (row by row, one
//     column per thread of two warps), and A = (q_r.k_s) e^(gamma_r - gamma_s) on and below the diagonal; Tinv
//     and A rows go to the workspace as [Hv, T, 64].
//  4. chunk_scan_kernel, one block of 256 threads per (span, value head, 32 value columns), walks the span's
//     chunks with the state slice (128 x 32) in registers (16 values per thread) and a copy in shared memory:
//     R = beta V - beta e^gamma (K S), Delta = Tinv R, O = e^gamma (Q S) + A Delta,
//     S = e^gamma_last S + (K e^(gamma_last - gamma))^T Delta (~4.1 k FMA per thread and chunk).
//  Delta = Tinv R is the twin's U - W S: U = Tinv (beta V) and W = Tinv (beta e^gamma K).
//  note: CUDA cores only; the four products are tensor-core shaped (64 x 128 x 32 and 64 x 64 x 32), the
//  next step once this form is measured.
constexpr int CC = k_gdn_chunk;
constexpr int CH_THREADS = 256;
constexpr int KP = DK + 4;   // staged k^/q^ row stride in floats: rows 4 banks apart, float4 aligned
constexpr int MP = CC + 4;   // staged 64-wide matrix rows
constexpr int CT = 32;       // value columns per scan block
constexpr int CTP = CT + 4;  // their row stride
static_assert(CC == 64 && CH_THREADS == 256 && DK == 128, "the thread mappings below");
constexpr size_t CHUNK_SMEM = (size_t)(2 * CC * KP + 2 * CC * MP) * sizeof(float);                // 102 KB
constexpr size_t CSCAN_SMEM = (size_t)(2 * CC * KP + 3 * CC * CTP + 2 * CC * MP + DK * CTP + 2 * CC) * sizeof(float);  // 149 KB

__device__ __forceinline__ float* work_tinv(const gdn_params& p) {
    return p.work + gdn_work_chunk_offset(p.T, p.Hk, p.Hv, DK);
}
__device__ __forceinline__ float* work_amat(const gdn_params& p) { return work_tinv(p) + (int64_t)p.Hv * p.T * CC; }

__device__ __forceinline__ float dot4(const float4 a, const float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}
__device__ __forceinline__ float comp(const float4 v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }

__global__ void __launch_bounds__(CH_THREADS) chunk_kernel(const gdn_params p, int min_rows) {
    extern __shared__ float4 smem_[];
    float* sk = reinterpret_cast<float*>(smem_);  // [CC][KP] k^ rows of the chunk (zeros past its end)
    float* sq = sk + CC * KP;                     // [CC][KP] q^
    float* sL = sq + CC * KP;                     // [CC][MP] L
    float* sT = sL + CC * MP;                     // [CC][MP] Tinv
    __shared__ float s_gam[CC], s_beta[CC];
    const dspan sp = p.spans[blockIdx.z];
    const int c0 = blockIdx.x * CC;
    if (sp.n < min_rows || c0 >= sp.n) return;  // block-uniform
    const int nc = min(CC, sp.n - c0), h = blockIdx.y, kh = h / (p.Hv / p.Hk), row0 = sp.row0 + c0;
    const int tid = threadIdx.x, kd = p.Hk * DK;
    const float *wq = work_q(p), *wk = work_k(p);
    float* wg = work_g(p);

    // 1. the chunk's rows, and the gates: g = -exp(A_log) softplus(a + dt_bias) as the twin (and prep) compute
    //    it, gamma = its running sum in row order
    for (int i = tid; i < CC * (DK / 4); i += CH_THREADS) {
        const int r = i / (DK / 4), c4 = (i % (DK / 4)) * 4;
        float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), qv = kv;
        if (r < nc) {
            const int64_t src = (int64_t)(row0 + r) * kd + kh * DK + c4;
            kv = *reinterpret_cast<const float4*>(wk + src), qv = *reinterpret_cast<const float4*>(wq + src);
        }
        *reinterpret_cast<float4*>(sk + r * KP + c4) = kv;
        *reinterpret_cast<float4*>(sq + r * KP + c4) = qv;
    }
    if (tid < CC) {
        float g = 0.0f, beta = 0.0f;
        if (tid < nc) {
            const int64_t row = row0 + tid;
            const float A = -expf(p.A_log[h]);
            g = A * gdn_softplus(p.a[row * p.Hv + h] + p.dt_bias[h]);
            beta = wg[((int64_t)h * p.T + row) * 2];
        }
        s_gam[tid] = g, s_beta[tid] = beta;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int r = 0; r < CC; r++) s_gam[r] = acc += s_gam[r];
    }
    __syncthreads();
    if (tid < nc) wg[((int64_t)h * p.T + row0 + tid) * 2 + 1] = s_gam[tid];

    // 2. k.k and q.k for rows r = tr + 16 j against rows s = ts + 16 m (a 4 x 4 tile per thread), then L and A
    const int tr = tid / 16, ts = tid % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int m = 0; m < 4; m++) kk[j][m] = qk[j][m] = 0.0f;
    for (int i = 0; i < DK; i += 4) {
        float4 kr[4], qr[4], ks[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            kr[j] = *reinterpret_cast<const float4*>(sk + (tr + 16 * j) * KP + i);
            qr[j] = *reinterpret_cast<const float4*>(sq + (tr + 16 * j) * KP + i);
            ks[j] = *reinterpret_cast<const float4*>(sk + (ts + 16 * j) * KP + i);
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int m = 0; m < 4; m++) kk[j][m] = dot4(kr[j], ks[m], kk[j][m]), qk[j][m] = dot4(qr[j], ks[m], qk[j][m]);
    }
    float* amat = work_amat(p) + ((int64_t)h * p.T + row0) * CC;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int r = tr + 16 * j, s = ts + 16 * m;
            float l = 0.0f, a = 0.0f;
            if (s <= r) {
                const float decay = expf(s_gam[r] - s_gam[s]);
                if (s < r) l = s_beta[r] * kk[j][m] * decay;
                a = qk[j][m] * decay;
            }
            sL[r * MP + s] = l;
            if (r < nc) amat[(int64_t)r * CC + s] = a;
        }
    __syncthreads();

    // 3. Tinv = (I + L)^-1 by rows: Tinv_r = e_r - sum_{s<r} L_rs Tinv_s. Column j needs only column j's
    //    earlier rows (Tinv_sj = 0 for j > s), so thread j < 64 computes it alone, no barrier per row; four
    //    partial sums shorten the dependent chain. Rows past nc come out as e_r (their L rows are 0), not stored.
    if (tid < CC) {
        const int j = tid;
        for (int r = 0; r < CC; r++) {
            const float* Lr = sL + r * MP;
            float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
            int s = j;
            for (; s + 3 < r; s += 4) {
                v0 = fmaf(Lr[s], sT[s * MP + j], v0), v1 = fmaf(Lr[s + 1], sT[(s + 1) * MP + j], v1);
                v2 = fmaf(Lr[s + 2], sT[(s + 2) * MP + j], v2), v3 = fmaf(Lr[s + 3], sT[(s + 3) * MP + j], v3);
            }
            for (; s < r; s++) v0 = fmaf(Lr[s], sT[s * MP + j], v0);
            sT[r * MP + j] = j < r ? -((v0 + v1) + (v2 + v3)) : j == r ? 1.0f : 0.0f;
        }
    }
    __syncthreads();
    float* tinv = work_tinv(p) + ((int64_t)h * p.T + row0) * CC;
    for (int e = tid; e < nc * (CC / 4); e += CH_THREADS) {
        const int r = e / (CC / 4), c4 = (e % (CC / 4)) * 4;
        *reinterpret_cast<float4*>(tinv + (int64_t)r * CC + c4) = *reinterpret_cast<const float4*>(sT + r * MP + c4);
    }
}

__global__ void __launch_bounds__(CH_THREADS) chunk_scan_kernel(const gdn_params p, int min_rows) {
    extern __shared__ float4 smem_[];
    float* sk = reinterpret_cast<float*>(smem_);  // [CC][KP] k^
    float* sq = sk + CC * KP;                     // [CC][KP] q^
    float* sv = sq + CC * KP;                     // [CC][CTP] v (the block's columns)
    float* sR = sv + CC * CTP;                    // [CC][CTP] R
    float* sD = sR + CC * CTP;                    // [CC][CTP] Delta
    float* sT = sD + CC * CTP;                    // [CC][MP] Tinv
    float* sA = sT + CC * MP;                     // [CC][MP] A
    float* sS = sA + CC * MP;                     // [DK][CTP] the state slice
    float* sg = sS + DK * CTP;                    // [CC][2] (beta, gamma)
    __shared__ float s_el[CC];                    // e^(gamma_last - gamma_r)
    const dspan sp = p.spans[blockIdx.x];
    if (sp.n < min_rows) return;
    const int h = blockIdx.y, col0 = blockIdx.z * CT, kh = h / (p.Hv / p.Hk), tid = threadIdx.x, kd = p.Hk * DK;
    const int64_t vd = (int64_t)p.Hv * p.dv;
    const float *wq = work_q(p), *wk = work_k(p), *wg = work_g(p), *tinv = work_tinv(p), *amat = work_amat(p);
    // this thread: state rows si + 32 m (m < 4), rows rr and rr + 32 of the chunk, columns j0 .. j0 + 3
    const int si = tid / 8, rr = tid / 8, j0 = 4 * (tid % 8);
    float* S = s_buf(p.seqs[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0 + j0;
    float st[4][4];
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) st[m][e] = S[(int64_t)(si + 32 * m) * p.dv + e];

    for (int c0 = 0; c0 < sp.n; c0 += CC) {
        const int nc = min(CC, sp.n - c0), row0 = sp.row0 + c0;
        // stage the chunk (rows past nc zero-filled), and the state into shared memory
        for (int i = tid; i < CC * (DK / 4); i += CH_THREADS) {
            const int r = i / (DK / 4), c4 = (i % (DK / 4)) * 4;
            const int64_t src = (int64_t)(row0 + min(r, nc - 1)) * kd + kh * DK + c4;
            cp_async16_zfill(sk + r * KP + c4, wk + src, r < nc);
            cp_async16_zfill(sq + r * KP + c4, wq + src, r < nc);
        }
        for (int i = tid; i < CC * (CT / 4); i += CH_THREADS) {
            const int r = i / (CT / 4), c4 = (i % (CT / 4)) * 4;
            cp_async16_zfill(sv + r * CTP + c4, p.o + (int64_t)(row0 + min(r, nc - 1)) * vd + h * p.dv + col0 + c4, r < nc);
        }
        for (int i = tid; i < CC * (CC / 4); i += CH_THREADS) {
            const int r = i / (CC / 4), c4 = (i % (CC / 4)) * 4;
            const int64_t src = ((int64_t)h * p.T + row0 + min(r, nc - 1)) * CC + c4;
            cp_async16_zfill(sT + r * MP + c4, tinv + src, r < nc);
            cp_async16_zfill(sA + r * MP + c4, amat + src, r < nc);
        }
        for (int t = tid; t < nc; t += CH_THREADS) cp_async8(sg + 2 * t, wg + ((int64_t)h * p.T + row0 + t) * 2);
        cp_async_commit();
#pragma unroll
        for (int m = 0; m < 4; m++)
            *reinterpret_cast<float4*>(sS + (si + 32 * m) * CTP + j0) = make_float4(st[m][0], st[m][1], st[m][2], st[m][3]);
        cp_async_wait<0>();
        __syncthreads();
        const float g_last = sg[2 * (nc - 1) + 1];
        if (tid < nc) s_el[tid] = expf(g_last - sg[2 * tid + 1]);

        // 1. K S and Q S for rows rr, rr + 32
        float ks[2][4], qs[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int e = 0; e < 4; e++) ks[a][e] = qs[a][e] = 0.0f;
        for (int i = 0; i < DK; i += 4) {
            float4 k4[2], q4[2];
#pragma unroll
            for (int a = 0; a < 2; a++) {
                k4[a] = *reinterpret_cast<const float4*>(sk + (rr + 32 * a) * KP + i);
                q4[a] = *reinterpret_cast<const float4*>(sq + (rr + 32 * a) * KP + i);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float4 s4 = *reinterpret_cast<const float4*>(sS + (i + e) * CTP + j0);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    const float kc = comp(k4[a], e), qc = comp(q4[a], e);
                    ks[a][0] = fmaf(kc, s4.x, ks[a][0]), ks[a][1] = fmaf(kc, s4.y, ks[a][1]);
                    ks[a][2] = fmaf(kc, s4.z, ks[a][2]), ks[a][3] = fmaf(kc, s4.w, ks[a][3]);
                    qs[a][0] = fmaf(qc, s4.x, qs[a][0]), qs[a][1] = fmaf(qc, s4.y, qs[a][1]);
                    qs[a][2] = fmaf(qc, s4.z, qs[a][2]), qs[a][3] = fmaf(qc, s4.w, qs[a][3]);
                }
            }
        }
        // 2. R = beta V - beta e^gamma (K S)
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int r = rr + 32 * a;
            if (r >= nc) continue;  // never read (Delta's sum runs over s < nc)
            const float b = sg[2 * r], bg = b * expf(sg[2 * r + 1]);
#pragma unroll
            for (int e = 0; e < 4; e++) sR[r * CTP + j0 + e] = fmaf(-bg, ks[a][e], b * sv[r * CTP + j0 + e]);
        }
        __syncthreads();
        // 3. Delta = Tinv R
        float d[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int e = 0; e < 4; e++) d[a][e] = 0.0f;
        for (int s = 0, s_end = min(nc, rr + 33); s < s_end; s++) {  // Tinv is lower triangular
            const float4 r4 = *reinterpret_cast<const float4*>(sR + s * CTP + j0);
#pragma unroll
            for (int a = 0; a < 2; a++) {
                const float t = sT[(rr + 32 * a) * MP + s];
                d[a][0] = fmaf(t, r4.x, d[a][0]), d[a][1] = fmaf(t, r4.y, d[a][1]);
                d[a][2] = fmaf(t, r4.z, d[a][2]), d[a][3] = fmaf(t, r4.w, d[a][3]);
            }
        }
#pragma unroll
        for (int a = 0; a < 2; a++)
            *reinterpret_cast<float4*>(sD + (rr + 32 * a) * CTP + j0) = make_float4(d[a][0], d[a][1], d[a][2], d[a][3]);
        __syncthreads();
        // 4. O = e^gamma (Q S) + A Delta, into p.o (this chunk's v rows are staged already)
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int r = rr + 32 * a;
            if (r >= nc) continue;
            const float eg = expf(sg[2 * r + 1]);
            float o[4] = {eg * qs[a][0], eg * qs[a][1], eg * qs[a][2], eg * qs[a][3]};
            for (int s = 0; s <= r; s++) {
                const float4 d4 = *reinterpret_cast<const float4*>(sD + s * CTP + j0);
                const float av = sA[r * MP + s];
                o[0] = fmaf(av, d4.x, o[0]), o[1] = fmaf(av, d4.y, o[1]), o[2] = fmaf(av, d4.z, o[2]), o[3] = fmaf(av, d4.w, o[3]);
            }
            *reinterpret_cast<float4*>(p.o + (int64_t)(row0 + r) * vd + h * p.dv + col0 + j0) = make_float4(o[0], o[1], o[2], o[3]);
        }
        // 5. S = e^gamma_last S + sum_r (k_r e^(gamma_last - gamma_r)) Delta_r^T
        const float el = expf(g_last);
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[m][e] *= el;
        for (int r = 0; r < nc; r++) {
            const float4 d4 = *reinterpret_cast<const float4*>(sD + r * CTP + j0);
            const float w = s_el[r];
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const float kv = sk[r * KP + si + 32 * m] * w;
                st[m][0] = fmaf(kv, d4.x, st[m][0]), st[m][1] = fmaf(kv, d4.y, st[m][1]);
                st[m][2] = fmaf(kv, d4.z, st[m][2]), st[m][3] = fmaf(kv, d4.w, st[m][3]);
            }
        }
        __syncthreads();  // everyone is done with this chunk's staging before the next one overwrites it
    }
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) S[(int64_t)(si + 32 * m) * p.dv + e] = st[m][e];
}

template <int K>
void launch_prep(const gdn_params& p, int min_rows, cudaStream_t stream) {
    const int units = p.Hk + (p.Hv * p.dv + DK - 1) / DK;  // key heads (q and k), then v in 128-channel blocks
    const dim3 grid((unsigned)((p.T + PREP_ROWS - 1) / PREP_ROWS), (unsigned)units);
    prep_kernel<K><<<grid, DK, 0, stream>>>(p, min_rows);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

void gdn_prefill(const gdn_params& p, int min_rows, cudaStream_t stream) {
    TANSY_CHECK(p.work != nullptr, "cuda deltanet: spans of %d+ rows need gdn_params::work "
                "(gdn_prefill_workspace_floats(T, ...) floats)", min_rows);
    TANSY_CHECK(p.dk == DK && p.dv % SCAN_COLS == 0 && p.Hv % p.Hk == 0,
                "cuda deltanet prefill: dk %d (needs %d), dv %d (a multiple of %d), Hv %d, Hk %d", p.dk, DK, p.dv,
                SCAN_COLS, p.Hv, p.Hk);
    TANSY_CHECK(min_rows >= p.K - 1 && min_rows >= 1, "cuda deltanet prefill: min_rows %d < K-1 = %d", min_rows,
                p.K - 1);
    TANSY_CHECK(((uintptr_t)p.work | (uintptr_t)p.o) % 16 == 0, "cuda deltanet prefill: work/o not 16-byte aligned");
    if (p.T == 0 || p.n_spans == 0) return;
    switch (p.K) {
        case 4: launch_prep<4>(p, min_rows, stream); break;
        default: TANSY_ABORT("cuda deltanet prefill: conv kernel %d", p.K);
    }
    // the chunked form needs 146 KB of shared memory per block (sm_80/90; sm_86/89 offer 99 KB: token scan)
    if (p.chunked && max_dynamic_smem() >= CSCAN_SMEM) {
        allow_dynamic_smem<chunk_kernel>(CHUNK_SMEM);
        allow_dynamic_smem<chunk_scan_kernel>(CSCAN_SMEM);
        // chunks of the longest span (a block past its own span's end returns at once)
        const int max_chunks = ((p.max_span > 0 ? p.max_span : p.T - (p.n_spans - 1)) + CC - 1) / CC;
        chunk_kernel<<<dim3((unsigned)max_chunks, (unsigned)p.Hv, (unsigned)p.n_spans), CH_THREADS, CHUNK_SMEM, stream>>>(
            p, min_rows);
        CUDA_CHECK_LAUNCH();
        chunk_scan_kernel<<<dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / CT)), CH_THREADS, CSCAN_SMEM,
                            stream>>>(p, min_rows);
        CUDA_CHECK_LAUNCH();
        return;
    }
    allow_dynamic_smem<scan_kernel>(SCAN_SMEM);
    scan_kernel<<<dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / SCAN_COLS)), SCAN_WARPS * 32, SCAN_SMEM,
                  stream>>>(p, min_rows);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
