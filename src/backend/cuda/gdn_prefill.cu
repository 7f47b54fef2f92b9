// Gated DeltaNet for prompt processing (MODEL.md §4.2-4.6): the path gdn_forward (gdn.cu) takes for spans of
// more than k_gdn_recur_max_rows rows. fp32 math throughout (the chunked form's matrix products in 3xTF32, ~2^-20
// relative; the state stored in fp32 or bf16, dshape::s16); the conv, SiLU, norms and gates are bit-identical to
// gdn.cu's recur_kernel.
//   prep_kernel                      causal conv + SiLU, q/k L2 norms, beta and alpha per row: fully parallel.
//   chunk_kernel, chunk_scan_kernel  the default: the chunk-parallel form of MODEL.md §4.7 (64-row chunks): the
//                                    intra-chunk products and Tinv = (I + L)^-1 in parallel, then one scan over
//                                    the chunks with the state slice in mma accumulators.
//   scan_kernel                      the token scan (gdn_params::chunked = false, or GPUs without 199 KB of shared
//                                    memory per block): the decode recurrence, differing only in summation order.
// Why fast: the chunked form moves the recurrence's per-token FMAs onto tensor cores (3xTF32 split by masking,
// unrolled k loops: constant shared-memory offsets); the token scan holds its state slice in registers with no
// barrier per token. Measured figures: docs/PERF.md.
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

// prep_kernel, one block of 128 threads per (8 rows, unit), unit = a key head (its 128 q and 128 k channels) or
// 128 v channels; fully parallel. Causal conv (K = 4) over the raw rows, the first K-1 rows of a span taking their
// window from its conv state (parity meta[1]&1), then SiLU; q^ = q rsqrt(|q|^2 + 1e-6)/sqrt(dk) and
// k^ = k rsqrt(|k|^2 + 1e-6) -> work; v -> p.o in place (the scan reads v[t,h,j] from the address it then writes
// o[t,h,j] to, in the same block); beta = sigmoid(b), alpha = exp(-exp(A_log) softplus(a + dt_bias)) -> work as
// [Hv, T, 2] (contiguous per head for the scan); the span's last K-1 raw rows -> the other parity buffer (decode
// reads it once advance_seqs has flipped the parity). A span with a mark (dspan::mark) also writes the window
// at the mark (its raw rows mark-P .. mark-1, older ones from the conv state) into its checkpoint's parity-0
// buffer, and the checkpoint's meta {position, 0}.
template <int K>
__global__ void __launch_bounds__(DK) prep_kernel(const gdn_params p, int min_rows) {
    constexpr int P = K - 1;
    __shared__ int s_span[PREP_ROWS], s_off[PREP_ROWS], s_n[PREP_ROWS];
    __shared__ const float* s_cold[PREP_ROWS];  // the span's conv state (read parity)
    __shared__ float* s_cnew[PREP_ROWS];        // its next conv state (the other parity)
    __shared__ float* s_cmark[PREP_ROWS];       // the checkpoint's window at the span's mark (nullptr: none)
    __shared__ int s_mark[PREP_ROWS];
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
        s_mark[tid] = s.mark;
        s_cmark[tid] = s.mark > 0 ? conv_buf(p.marks[s_span[tid]], p.shape, p.slot, 0) : nullptr;
        if (s.mark > 0 && s_off[tid] == 0 && blockIdx.y == 0) {  // the checkpoint stands at pos0 + mark
            p.marks[s_span[tid]].meta[0] = sq.meta[0] + s.mark;
            p.marks[s_span[tid]].meta[1] = 0;
        }
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
            if (s_cmark[rr]) {  // the window at the mark: this row's place in it, and from the span's first row
                                // the old window's entries it still holds (a mark closer than P to the start)
                const int m = s_mark[rr], ms = off - (m - P);
                if (ms >= 0 && ms < P) s_cmark[rr][(int64_t)ms * C + ch] = x[rr + P];
                if (off == 0)
                    for (int j = 0; j < P - m; j++) s_cmark[rr][(int64_t)j * C + ch] = s_cold[rr][(int64_t)(m + j) * C + ch];
            }
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

// scan_kernel (the token scan), one block of 4 warps per (span, value head, 32 value columns). The state slice
// S[:, 32 cols] (dk = 128 rows) lives in registers: lane l of warp w holds key rows 32(l%4) .. +31 of column
// 8w + l/4. Per token: u = S^T k^ (32 FMAs, 2 shuffles over the lane's 4-lane group), delta = beta (v - alpha u),
// S = alpha S + k^ delta^T, o = S^T q^ (32 FMAs, 2 shuffles, reduced while the next token's u is): no
// shared-memory reduction and no barrier per token. Chunks of 32 tokens of q^, k^, v, (beta, alpha) are staged
// into shared memory by cp.async, double-buffered (2 x 41.2 KB), two barriers per chunk; staged k^/q^ rows are
// padded to 36 floats per 32-row quarter so the 4 quarters' LDS.128 hit distinct banks. Grid for the real shape:
// 32 heads x 4 column blocks = 128 blocks per long span, 512 warps, one per SM sub-partition (132 SMs); 32 columns
// per block because narrower blocks only add copies of the staged k^/q^ without adding warps, wider ones would
// leave SMs idle. ~180 instructions per lane and token (SASS); latency-bound (LDS -> u dot -> 2 shuffles -> delta
// -> update) with one warp per sub-partition.
template <class TS>
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

    TS* S = s_buf<TS>(p.seqs[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0 + lc;
    float st[32];
#pragma unroll
    for (int i = 0; i < 32; i++) st[i] = state_ld(S + (int64_t)(32 * quarter + i) * p.dv);

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
            if (t0 + t + 1 == sp.mark) {  // the checkpoint's state (block-uniform), carried on as it holds it
                TS* M = s_buf<TS>(p.marks[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0 + lc;
#pragma unroll
                for (int i = 0; i < 32; i++) {
                    st[i] = state_round<TS>(st[i]);
                    state_st(M + (int64_t)(32 * quarter + i) * p.dv, st[i]);
                }
            }
        }
        __syncthreads();  // all warps are done with this buffer before the next iteration refills it
    }
    const float o_last = quad_sum(o_part);
    if (quarter == 0) *o_prev_at = o_last;
#pragma unroll
    for (int i = 0; i < 32; i++) state_st(S + (int64_t)(32 * quarter + i) * p.dv, st[i]);
}

// ------------------------------------------------------------------------------------------------ chunked

// The chunk-parallel form (the default; MODEL.md §4.7, the CPU twin's cpu::delta_rule_chunked), chunks of
// CC = 64 rows from each span's start (as the twin cuts them). The matrix products run on the tensor cores in
// 3xTF32 (mma.cuh: ~2^-20 relative per product; the tests hold it to fp32 tolerances); the recurrences in fp32.
//  3. chunk_kernel, one block of 256 threads per (chunk, value head, span), fully parallel: gamma (cumulative
//     log decay, into the alpha slot of (beta, alpha): the scan reads it there); k.k and q.k on and below the
//     diagonal (8 warps, 16 x 8 tiles); the strictly-lower L = beta_r (k_r.k_s) e^(gamma_r - gamma_s) and
//     A = (q_r.k_s) e^(gamma_r - gamma_s); the unit-lower inverse Tinv = (I + L)^-1 by forward substitution,
//     one column per thread of two warps, held in registers (column j needs only its own earlier rows, so
//     no barrier per row). Tinv and A rows go to the workspace as [Hv, T, 64].
//  4. chunk_scan_kernel, one block of 256 threads per (span, value head, 32 value columns), walks the span's
//     chunks with the state slice (128 x 32) in mma accumulators (warp w: key rows 16w .. 16w+15) and a copy
//     in shared memory as the next chunk's B operand:
//       K S (warps 0-3) and Q S (warps 4-7), 64 x 128 x 32;  R = beta V - beta e^gamma (K S);
//       Delta = Tinv R (64 x 64 x 32, lower triangular: k-steps up to the diagonal block);
//       O = e^gamma (Q S) + A Delta (warps 4-7, on their Q S accumulators);
//       S = e^gamma_last S + (K e^(gamma_last - gamma))^T Delta (128 x 64 x 32, every warp its 16 rows).
//     Four barriers per chunk. Rows past a span's end are zero in every staged operand (and beta, the decay
//     weights and gates are forced to 0 there), so full 64-row tiles need no masks. The next chunk's v, Tinv, A
//     and gates land in a second buffer while a chunk is computed, its q^ once Q S is done; only its k^ (read by
//     the state update) waits for the chunk's end. A span with a mark restarts its chunks there (span_chunk).
//  Delta = Tinv R is the twin's U - W S: U = Tinv (beta V) and W = Tinv (beta e^gamma K).
//  Shared-memory strides: KP and MP (= 4 mod 32) make row-major A fragments (rows g, columns t) conflict-free;
//  RP (= 8 mod 32) does the same for B fragments read as [k][n] (rows t, columns g). K read transposed (the
//  state update's A) takes 2-way conflicts.
constexpr int CC = k_gdn_chunk;
constexpr int CH_THREADS = 256;
constexpr int KP = DK + 4;   // staged k^/q^ rows
constexpr int MP = CC + 4;   // staged 64-wide matrix rows (L, Tinv, A)
constexpr int CT = 32;       // value columns per scan block
constexpr int RP = CT + 8;   // rows of the 32-column operands (v, R, Delta, the state)
static_assert(CC == 64 && CH_THREADS == 256 && DK == 128 && CT == 32, "the warp tilings below");
constexpr size_t CHUNK_SMEM = (size_t)(2 * CC * KP + CC * MP) * sizeof(float);  // 85 KB: two blocks per SM
// the scan: k^, q^, R, Delta and the state once; v, Tinv, A and (beta, gamma) twice (the next chunk's land while this
// one is computed)
constexpr size_t CSCAN_SMEM = (size_t)(2 * CC * KP + 2 * CC * RP + DK * RP + 2 * (CC * RP + 2 * CC * MP + 2 * CC)) * sizeof(float);  // 199 KB

__device__ __forceinline__ float* work_tinv(const gdn_params& p) {
    return p.work + gdn_work_chunk_offset(p.T, p.Hk, p.Hv, DK);
}
__device__ __forceinline__ float* work_amat(const gdn_params& p) { return work_tinv(p) + (int64_t)p.Hv * p.T * CC; }

// A fragment of rows r0 and r0 + 8 at column c of a row-major matrix of stride `ld` (c and c + 4).
__device__ __forceinline__ tf32_a frag_a_rows(const float* m, int ld, int r0, int c) {
    const float* p = m + r0 * ld + c;
    return split_a(p[0], p[8 * ld], p[4], p[8 * ld + 4]);
}
// B fragment of a [k][n] matrix of stride `ld`: rows k and k + 4 of column n.
__device__ __forceinline__ tf32_b frag_b_rows(const float* m, int ld, int k, int n) {
    return split_b(m[k * ld + n], m[(k + 4) * ld + n]);
}
// B fragment of the transpose of a row-major matrix: B[k][n] = m[n][k].
__device__ __forceinline__ tf32_b frag_b_cols(const float* m, int ld, int k, int n) {
    return split_b(m[n * ld + k], m[n * ld + k + 4]);
}
// Stores an accumulator tile (rows r0, r0 + 8; columns c, c + 1) to a row-major matrix of stride `ld`.
__device__ __forceinline__ void store_acc(float* m, int ld, int r0, int c, const float (&acc)[4]) {
    *reinterpret_cast<float2*>(m + r0 * ld + c) = make_float2(acc[0], acc[1]);
    *reinterpret_cast<float2*>(m + (r0 + 8) * ld + c) = make_float2(acc[2], acc[3]);
}

// Stages rows row0 .. row0 + nc - 1 of key head kh's k^ (src = work_k) or q^ (work_q) into [CC][KP] (rows past nc
// zero-filled), by cp.async (the caller commits).
__device__ __forceinline__ void stage_rows(const gdn_params& p, float* dst, const float* src, int row0, int nc, int kh,
                                           int tid) {
    const int kd = p.Hk * DK;
    for (int i = tid; i < CC * (DK / 4); i += CH_THREADS) {
        const int r = i / (DK / 4), c4 = (i % (DK / 4)) * 4;
        cp_async16_zfill(dst + r * KP + c4, src + (int64_t)(row0 + min(r, nc - 1)) * kd + kh * DK + c4, r < nc);
    }
}
__device__ __forceinline__ void stage_kq(const gdn_params& p, float* sk, float* sq, int row0, int nc, int kh, int tid) {
    stage_rows(p, sk, work_k(p), row0, nc, kh, tid);
    stage_rows(p, sq, work_q(p), row0, nc, kh, tid);
}

// Chunk c of a span: its rows [c0, c0 + nc), cut every CC rows from the span's start and, for a span with a mark,
// again from the mark, so that the state at the mark is a chunk boundary (cpu::delta_rule_chunked over the two
// parts cuts them so). false past the span's last chunk.
__device__ __forceinline__ bool span_chunk(const dspan& s, int c, int& c0, int& nc) {
    const int head = (s.mark + CC - 1) / CC;  // chunks before the mark (0 without one)
    c0 = c < head ? c * CC : s.mark + (c - head) * CC;
    nc = min(CC, (c < head ? s.mark : s.n) - c0);
    return c0 < s.n;
}

__global__ void __launch_bounds__(CH_THREADS, 2) chunk_kernel(const gdn_params p, int min_rows) {
    extern __shared__ float4 smem_[];
    float* sk = reinterpret_cast<float*>(smem_);  // [CC][KP] k^ rows of the chunk (zeros past its end)
    float* sq = sk + CC * KP;                     // [CC][KP] q^
    float* sL = sq + CC * KP;                     // [CC][MP] L
    __shared__ float s_gam[CC], s_beta[CC];
    const dspan sp = p.spans[blockIdx.z];
    int c0, nc;
    if (sp.n < min_rows || !span_chunk(sp, (int)blockIdx.x, c0, nc)) return;  // block-uniform
    const int h = blockIdx.y, kh = h / (p.Hv / p.Hk), row0 = sp.row0 + c0;
    const int tid = threadIdx.x;
    const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    float* wg = work_g(p);

    // 1. the chunk's rows, and the gates: g = -exp(A_log) softplus(a + dt_bias) as the twin (and prep) compute
    //    it, gamma = its running sum in row order
    stage_kq(p, sk, sq, row0, nc, kh, tid);
    cp_async_commit();
    if (tid < CC) {
        float gate = 0.0f, beta = 0.0f;
        if (tid < nc) {
            const int64_t row = row0 + tid;
            const float A = -expf(p.A_log[h]);
            gate = A * gdn_softplus(p.a[row * p.Hv + h] + p.dt_bias[h]);
            beta = wg[((int64_t)h * p.T + row) * 2];
        }
        s_gam[tid] = gate, s_beta[tid] = beta;
    }
    cp_async_wait<0>();
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int r = 0; r < CC; r++) s_gam[r] = acc += s_gam[r];
    }
    __syncthreads();
    if (tid < nc) wg[((int64_t)h * p.T + row0 + tid) * 2 + 1] = s_gam[tid];

    // 2. k.k and q.k: warp w takes rows 16 (w/2) .. + 15 and the column tiles 8 (w%2 + 2 j), j < 4, computing
    //    those that reach the diagonal; then L (shared memory) and A (the workspace; zeros above the diagonal)
    const int mt = w / 2, r0 = 16 * mt + g;
    float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
    for (int kb = 0; kb < DK; kb += 8) {
        const tf32_a ak = frag_a_rows(sk, KP, r0, kb + t), aq = frag_a_rows(sq, KP, r0, kb + t);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int nt = w % 2 + 2 * j;
            if (8 * nt > 16 * mt + 15) continue;  // above the diagonal (warp-uniform)
            const tf32_b b = frag_b_cols(sk, KP, kb + t, 8 * nt + g);
            mma_tf32x3(kk[j], ak, b);
            mma_tf32x3(qk[j], aq, b);
        }
    }
    float* amat = work_amat(p) + ((int64_t)h * p.T + row0) * CC;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int c = 8 * (w % 2 + 2 * j) + 2 * t;
        float l[4], a[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = r0 + 8 * (e / 2), s = c + e % 2;
            l[e] = a[e] = 0.0f;
            if (s <= r) {
                const float decay = expf(s_gam[r] - s_gam[s]);
                if (s < r) l[e] = s_beta[r] * kk[j][e] * decay;
                a[e] = qk[j][e] * decay;
            }
        }
        store_acc(sL, MP, r0, c, l);
        if (r0 < nc) *reinterpret_cast<float2*>(amat + (int64_t)r0 * CC + c) = make_float2(a[0], a[1]);
        if (r0 + 8 < nc) *reinterpret_cast<float2*>(amat + (int64_t)(r0 + 8) * CC + c) = make_float2(a[2], a[3]);
    }
    __syncthreads();

    // 3. Tinv = (I + L)^-1 by rows: Tinv_r = e_r - sum_{s<r} L_rs Tinv_s; thread j < 64 holds column j
    //    (Tinv_sj = 0 for s < j comes out of the same sums). Every L_rs read is the same address across the
    //    warp (a broadcast). Rows past nc come out as e_r (their L rows are 0) and are not stored.
    if (tid < CC) {
        const int j = tid;
        float col[CC];
#pragma unroll
        for (int r = 0; r < CC; r++) {
            float acc0 = 0.0f, acc1 = 0.0f;  // two partial sums: the later one ends the dependent chain sooner
#pragma unroll
            for (int s4 = 0; s4 < r; s4 += 4) {
                const float4 l4 = *reinterpret_cast<const float4*>(sL + r * MP + s4);
                acc0 = fmaf(l4.x, col[s4], acc0);
                if (s4 + 1 < r) acc1 = fmaf(l4.y, col[s4 + 1], acc1);
                if (s4 + 2 < r) acc0 = fmaf(l4.z, col[s4 + 2], acc0);
                if (s4 + 3 < r) acc1 = fmaf(l4.w, col[s4 + 3], acc1);
            }
            col[r] = r == j ? 1.0f : -(acc0 + acc1);
        }
        float* tinv = work_tinv(p) + ((int64_t)h * p.T + row0) * CC + j;
#pragma unroll
        for (int r = 0; r < CC; r++)
            if (r < nc) tinv[(int64_t)r * CC] = col[r];
    }
}

template <class TS>
__global__ void __launch_bounds__(CH_THREADS) chunk_scan_kernel(const gdn_params p, int min_rows) {
    extern __shared__ float4 smem_[];
    float* sk = reinterpret_cast<float*>(smem_);  // [CC][KP] k^
    float* sq = sk + CC * KP;                     // [CC][KP] q^
    float* sR = sq + CC * KP;                     // [CC][RP] R
    float* sD = sR + CC * RP;                     // [CC][RP] Delta
    float* sS = sD + CC * RP;                     // [DK][RP] the state slice
    // per chunk parity b: v (the block's columns) [CC][RP], Tinv and A [CC][MP], (beta, gamma) [CC][2]
    constexpr int BUF = CC * RP + 2 * CC * MP + 2 * CC;
    float* const sbuf = sS + DK * RP;
    __shared__ float s_el[CC];                    // e^(gamma_last - gamma_r), 0 past the chunk's end
    const dspan sp = p.spans[blockIdx.x];
    if (sp.n < min_rows) return;
    const int h = blockIdx.y, col0 = blockIdx.z * CT, kh = h / (p.Hv / p.Hk), tid = threadIdx.x;
    const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    const int64_t vd = (int64_t)p.Hv * p.dv;
    const float *wg = work_g(p), *tinv = work_tinv(p), *amat = work_amat(p);
    // the state in accumulator layout: warp w, key rows 16w + g and + 8, columns 8 nt + 2t and + 1 (nt < 4)
    TS* S = s_buf<TS>(p.seqs[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0;
    const int srow = 16 * w + g;
    float st[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
        const float2 lo = state_ld2(S + (int64_t)srow * p.dv + 8 * nt + 2 * t);
        const float2 hi = state_ld2(S + (int64_t)(srow + 8) * p.dv + 8 * nt + 2 * t);
        st[nt][0] = lo.x, st[nt][1] = lo.y, st[nt][2] = hi.x, st[nt][3] = hi.y;
    }

    // the state slice from the accumulators to a [dk][dv] head state (this block's 32 columns)
    auto store_state = [&](TS* dst) {
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            state_st2(dst + (int64_t)srow * p.dv + 8 * nt + 2 * t, make_float2(st[nt][0], st[nt][1]));
            state_st2(dst + (int64_t)(srow + 8) * p.dv + 8 * nt + 2 * t, make_float2(st[nt][2], st[nt][3]));
        }
    };
    // a chunk's v, Tinv, A and (beta, gamma) into buffer b (rows past nc zero-filled; the gates only up to nc)
    auto stage_rest = [&](int b, int row0, int nc) {
        float *sv = sbuf + b * BUF, *sT = sv + CC * RP, *sA = sT + CC * MP, *sg = sA + CC * MP;
        for (int i = tid; i < CC * (CT / 4); i += CH_THREADS) {
            const int r = i / (CT / 4), c4 = (i % (CT / 4)) * 4;
            cp_async16_zfill(sv + r * RP + c4, p.o + (int64_t)(row0 + min(r, nc - 1)) * vd + h * p.dv + col0 + c4, r < nc);
        }
        for (int i = tid; i < CC * (CC / 4); i += CH_THREADS) {
            const int r = i / (CC / 4), c4 = (i % (CC / 4)) * 4;
            const int64_t src = ((int64_t)h * p.T + row0 + min(r, nc - 1)) * CC + c4;
            cp_async16_zfill(sT + r * MP + c4, tinv + src, r < nc);
            cp_async16_zfill(sA + r * MP + c4, amat + src, r < nc);
        }
        for (int r = tid; r < nc; r += CH_THREADS) cp_async8(sg + 2 * r, wg + ((int64_t)h * p.T + row0 + r) * 2);
    };
    // Chunk c's q^ and the rest land while chunk c-1 is computed (q^ once chunk c-1's Q S is done, the rest into the
    // other buffer at its start); its k^ is read by chunk c-1's state update, so it is staged after it.
    int c0, nc;
    if (!span_chunk(sp, 0, c0, nc)) return;  // (a span has rows)
    stage_rows(p, sq, work_q(p), sp.row0 + c0, nc, kh, tid);
    stage_rest(0, sp.row0 + c0, nc);
    cp_async_commit();
    for (int ci = 0;; ci++) {
        const int row0 = sp.row0 + c0;
        float *sv = sbuf + (ci & 1) * BUF, *sT = sv + CC * RP, *sA = sT + CC * MP, *sg = sA + CC * MP;
        stage_rows(p, sk, work_k(p), row0, nc, kh, tid);
        cp_async_commit();
#pragma unroll
        for (int nt = 0; nt < 4; nt++) store_acc(sS, RP, srow, 8 * nt + 2 * t, st[nt]);
        cp_async_wait<0>();
        __syncthreads();
        int n0 = 0, nn = 0;
        const bool more = span_chunk(sp, ci + 1, n0, nn);
        if (more) stage_rest((ci + 1) & 1, sp.row0 + n0, nn);  // its buffer was last read by chunk c-1
        cp_async_commit();
        const float g_last = sg[2 * (nc - 1) + 1];
        if (tid < CC) s_el[tid] = tid < nc ? expf(g_last - sg[2 * tid + 1]) : 0.0f;

        // 1. K S (warps 0-3) and Q S (warps 4-7) for chunk rows r0 and r0 + 8
        const int r0 = 16 * (w % 4) + g;
        const float* src = w < 4 ? sk : sq;
        float acc[4][4] = {};
#pragma unroll
        for (int kb = 0; kb < DK; kb += 8) {
            const tf32_a a = frag_a_rows(src, KP, r0, kb + t);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) mma_tf32x3(acc[nt], a, frag_b_rows(sS, RP, kb + t, 8 * nt + g));
        }
        // the row factors: beta and e^gamma, 0 past the chunk's end (sg is not staged there)
        float beta[2], eg[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = r0 + 8 * e;
            beta[e] = r < nc ? sg[2 * r] : 0.0f, eg[e] = r < nc ? expf(sg[2 * r + 1]) : 0.0f;
        }
        // 2. R = beta V - beta e^gamma (K S)
        if (w < 4) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int c = 8 * nt + 2 * t;
                float rv[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = r0 + 8 * (e / 2);
                    rv[e] = beta[e / 2] * fmaf(-eg[e / 2], acc[nt][e], sv[r * RP + c + e % 2]);
                }
                store_acc(sR, RP, r0, c, rv);
            }
        }
        __syncthreads();
        if (more) {  // every warp is past Q S: the next chunk's q^ (waited for with its k^)
            stage_rows(p, sq, work_q(p), sp.row0 + n0, nn, kh, tid);
            cp_async_commit();
        }
        // 3. Delta = Tinv R: warp w, rows 16 (w/2) .. + 15, column tiles 2 (w%2) and + 1
        {
            const int mt = w / 2, dr = 16 * mt + g;
            float d[2][4] = {};
            for (int kb16 = 0; kb16 <= 16 * mt; kb16 += 16)
#pragma unroll
                for (int kb = kb16; kb < kb16 + 16; kb += 8) {
                    const tf32_a a = frag_a_rows(sT, MP, dr, kb + t);
#pragma unroll
                    for (int j = 0; j < 2; j++) mma_tf32x3(d[j], a, frag_b_rows(sR, RP, kb + t, 8 * (2 * (w % 2) + j) + g));
                }
#pragma unroll
            for (int j = 0; j < 2; j++) store_acc(sD, RP, dr, 8 * (2 * (w % 2) + j) + 2 * t, d[j]);
        }
        __syncthreads();
        // 4. O = e^gamma (Q S) + A Delta (warps 4-7), into p.o (this chunk's v rows are staged already)
        if (w >= 4) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[nt][e] *= eg[e / 2];
            for (int kb16 = 0; kb16 <= 16 * (w - 4); kb16 += 16)
#pragma unroll
                for (int kb = kb16; kb < kb16 + 16; kb += 8) {
                    const tf32_a a = frag_a_rows(sA, MP, r0, kb + t);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) mma_tf32x3(acc[nt], a, frag_b_rows(sD, RP, kb + t, 8 * nt + g));
                }
            float* o = p.o + (int64_t)(row0 + r0) * vd + h * p.dv + col0 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                if (r0 < nc) *reinterpret_cast<float2*>(o + 8 * nt) = make_float2(acc[nt][0], acc[nt][1]);
                if (r0 + 8 < nc) *reinterpret_cast<float2*>(o + 8 * vd + 8 * nt) = make_float2(acc[nt][2], acc[nt][3]);
            }
        }
        // 5. S = e^gamma_last S + (K e^(gamma_last - gamma))^T Delta: A[i][r] = k_r[i] e^(gamma_last - gamma_r)
        const float el = expf(g_last);
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[nt][e] *= el;
#pragma unroll
        for (int kb = 0; kb < CC; kb += 8) {
            const float* kc = sk + (kb + t) * KP + srow;
            const float e0 = s_el[kb + t], e1 = s_el[kb + t + 4];
            const tf32_a a = split_a(kc[0] * e0, kc[8] * e0, kc[4 * KP] * e1, kc[4 * KP + 8] * e1);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) mma_tf32x3(st[nt], a, frag_b_rows(sD, RP, kb + t, 8 * nt + g));
        }
        if (c0 + nc == sp.mark) {  // the checkpoint's state, carried on as it holds it
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[nt][e] = state_round<TS>(st[nt][e]);
            store_state(s_buf<TS>(p.marks[blockIdx.x], p.shape, p.slot) + (int64_t)h * DK * p.dv + col0);
        }
        __syncthreads();  // everyone is done with this chunk's k^ and state before the next one overwrites them
        if (!more) break;
        c0 = n0, nc = nn;
    }
    store_state(S);
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
    // the chunked form needs 199 KB of shared memory per block: sm_90 (227 KB); sm_80 (163 KB) and sm_86/89 (99 KB)
    // take the token scan (git show ead3949:docs/experiments/scan-single-buffer.patch keeps sm_80 chunked, untested)
    if (p.chunked && max_dynamic_smem() >= CSCAN_SMEM) {
        allow_dynamic_smem<chunk_kernel>(CHUNK_SMEM);
        // chunks of the longest span (a block past its own span's end returns at once)
        TANSY_CHECK(p.max_span > 0 && p.max_span <= p.T, "cuda deltanet prefill: max_span %d (T %d)", p.max_span, p.T);
        const int max_chunks = (p.max_span + CC - 1) / CC + (p.any_mark ? 1 : 0);
        chunk_kernel<<<dim3((unsigned)max_chunks, (unsigned)p.Hv, (unsigned)p.n_spans), CH_THREADS, CHUNK_SMEM, stream>>>(
            p, min_rows);
        CUDA_CHECK_LAUNCH();
        with_state_type(p.shape.s16, [&](auto ts) {
            using TS = decltype(ts);
            allow_dynamic_smem<chunk_scan_kernel<TS>>(CSCAN_SMEM);
            chunk_scan_kernel<TS><<<dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / CT)), CH_THREADS,
                                    CSCAN_SMEM, stream>>>(p, min_rows);
        });
        CUDA_CHECK_LAUNCH();
        return;
    }
    with_state_type(p.shape.s16, [&](auto ts) {
        using TS = decltype(ts);
        allow_dynamic_smem<scan_kernel<TS>>(SCAN_SMEM);
        scan_kernel<TS><<<dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / SCAN_COLS)), SCAN_WARPS * 32,
                          SCAN_SMEM, stream>>>(p, min_rows);
    });
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
