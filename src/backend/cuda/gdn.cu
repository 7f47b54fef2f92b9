// Gated DeltaNet decode recurrence (MODEL.md §4.2-4.6) and the gated RMS norm.
//   recur_kernel       per (span, value head, 32 value columns): dk = 128 = 4 warps x 32 key rows, one value
//                      column per lane, the fp32 state slice in registers; the tokens of a span in order
//                      (decode and spans of <= k_gdn_recur_max_rows rows; longer ones go to gdn_prefill.cu).
//                      One barrier per token: the L2 norms are scalars applied after the dots (S^T k and S^T q of
//                      raw q, k in one pass over the old state, o = alpha S^T q^ + (k^.q^) delta).
//   recur_smem_kernel  the same per (span, value head) with the head's state staged in shared memory (more state
//                      bytes in flight per SM): decode batches of k_recur_smem_min_spans sequences and more.
//   gated_norm_kernel  out = rms_norm(o) * w * silu(z) per value head (decode steps; prompts: gated_norm_warp_kernel).
// The conv state is double-buffered by step parity, so blocks that share key heads all read the old window while
// its owner writes the new one. Why fast: what needs nothing from the projections (the state, the first token's
// conv terms over the window, the gate constants) loads before the PDL wait, and the new conv window is held in
// registers, so the kernel ends on its state stores (a load after them would wait an L2 round trip).
#include <climits>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gdn.cuh"
#include "backend/cuda/mma.cuh"

namespace tansy::cuda {

namespace {

constexpr int DK = 128, COLS = 32, k_warps = DK / 32;
// recur_smem_kernel: 256 threads, 128 value columns a block (a whole head's state: 64 KB; 32 and 64 columns
// measured slower from 16 sequences on, docs/PERF.md)
constexpr int k_smem_threads = 256, k_smem_cols = 128;
// conv windows of K - 1 <= k_win entries are kept on chip until the kernel's end (else re-read there)
constexpr int k_win = 3;

// Conv output of channel ch for the span's token r (0-based in the span), window = 3 earlier raw inputs:
// from the span's own rows when r-3+j >= 0, else from the parity buffer (rows oldest first).
__device__ __forceinline__ float conv_at(const gdn_params& p, const float* state, int row0, int r, int ch) {
    const int C = (int)p.shape.conv_ch, P = p.K - 1;
    float acc = 0;
    for (int j = 0; j < p.K; j++) {
        const int idx = r - P + j;
        const float x = idx >= 0 ? p.qkv[(int64_t)(row0 + idx) * C + ch] : state[(P + idx) * C + ch];
        acc = fmaf(p.conv_w[ch * p.K + j], x, acc);
    }
    return siluf_(acc);
}

// conv_at's terms j < K-1 for a span's first token (those over the old window), in its order.
__device__ __forceinline__ float window_terms(const gdn_params& p, const float* cstate, int ch) {
    const int C = (int)p.shape.conv_ch;
    float acc = 0;
    for (int j = 0; j < p.K - 1; j++) acc = fmaf(p.conv_w[ch * p.K + j], cstate[j * C + ch], acc);
    return acc;
}

// Token r's conv output of channel ch: the first token from its window terms `pre` (read before the PDL wait).
__device__ __forceinline__ float conv_token(const gdn_params& p, const float* cstate, const dspan& sp, int r, int ch,
                                            float pre) {
    const int P = p.K - 1, C = (int)p.shape.conv_ch;
    return r == 0 ? siluf_(fmaf(p.conv_w[ch * p.K + P], p.qkv[(int64_t)(sp.row0 + r) * C + ch], pre))
                  : conv_at(p, cstate, sp.row0, r, ch);
}

// Raw input j (0 = oldest) of the conv window after the span: one of its rows, or of the old window.
__device__ __forceinline__ const float* window_source(const gdn_params& p, const dspan& sp, const float* cstate, int j,
                                                      int ch) {
    const int P = p.K - 1, C = (int)p.shape.conv_ch, idx = sp.n - P + j;
    return idx >= 0 ? p.qkv + (int64_t)(sp.row0 + idx) * C + ch : cstate + (int64_t)(P + idx) * C + ch;
}

// The gates of one (row, head): s_scal = {beta = sigmoid(b), alpha = exp(-exp(A_log) softplus(a + dt_bias))}
// (A = -exp(A_log)).
__device__ __forceinline__ void gdn_gates(float b, float a, float A, float dtb, float* s_scal) {
    s_scal[0] = sigmoidf_(b);
    s_scal[1] = expf(A * gdn_softplus(a + dtb));
}

// A decode kernel's start: lets the next kernel launch (PDL) and reads the block's span. Spans of more than max_rows
// rows are left to the prefill path: the caller returns on them, and the PDL wait they still owe is taken here.
__device__ __forceinline__ dspan open_span(const gdn_params& p, int span, int max_rows) {
    pdl_trigger();
    const dspan sp = p.spans[span];
    if (sp.n > max_rows) pdl_wait();
    return sp;
}

template <class TS>
__global__ void __launch_bounds__(DK) recur_kernel(const gdn_params p, int max_rows) {
    __shared__ float s_q[DK], s_k[DK], s_v[COLS], s_red[2][k_warps][COLS], s_scal[2];
    __shared__ float s_sum[3][k_warps];
    const int span = blockIdx.x, h = blockIdx.y, cb = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tid = threadIdx.x;
    const dspan sp = open_span(p, span, max_rows);
    if (sp.n > max_rows) return;
    const dseq sq = p.seqs[span];
    const int parity = sq.meta[1] & 1;
    const float* cstate = conv_buf(sq, p.shape, p.slot, parity);
    float* cnext = conv_buf(sq, p.shape, p.slot, parity ^ 1);
    const int group = p.Hv / p.Hk, kh = h / group, kd = p.Hk * p.dk;
    const int ch_q = kh * DK + tid, ch_k = kd + kh * DK + tid, ch_v = 2 * kd + h * p.dv + cb * COLS + lane;
    const int col = cb * COLS + lane;
    TS* S = s_buf<TS>(sq, p.shape, p.slot) + (int64_t)h * DK * p.dv;
    // state slice: rows 32*warp .. +32, column `col`, in registers for the whole span
    float st[32];
#pragma unroll
    for (int i = 0; i < 32; i++) st[i] = state_ld(S + (int64_t)(warp * 32 + i) * p.dv + col);
    // What does not depend on the projection is read while it finishes (PDL): the state (this kernel's own
    // output of the previous step), the first token's conv terms over the state's window, the gate constants.
    const int P = p.K - 1, C = (int)p.shape.conv_ch;
    const float pre_q = window_terms(p, cstate, ch_q), pre_k = window_terms(p, cstate, ch_k);
    const float pre_v = warp == 0 ? window_terms(p, cstate, ch_v) : 0.0f;
    // The new conv window (step 5), each channel by one owner: q/k channels of key head kh by the block of the
    // group's first value head and first column block, v channels by warp 0 of every block. Its entries are held
    // in registers (K - 1 <= k_win): the old window's before the wait, the span's rows with the conv's loads.
    // note: read at the end instead, they followed the state's stores, which loads may not pass (aliasing): one
    // L2 round trip before the kernel could end
    const bool owner_qk = (h % group == 0) && cb == 0, win_regs = P <= k_win;
    float win_q[k_win] = {}, win_k[k_win] = {}, win_v[k_win] = {};
    auto win_src = [&](int j, int ch) -> const float* {  // raw input j (0 = oldest) of the window after the span
        const int idx = sp.n - P + j;
        return idx >= 0 ? p.qkv + (int64_t)(sp.row0 + idx) * C + ch : cstate + (int64_t)(P + idx) * C + ch;
    };
    auto win_load = [&](bool old) {  // the entries from the old window (before the wait) or from the span
#pragma unroll
        for (int j = 0; j < k_win; j++) {
            if (!win_regs || j >= P || (sp.n - P + j < 0) != old) continue;
            if (owner_qk) win_q[j] = *win_src(j, ch_q), win_k[j] = *win_src(j, ch_k);
            if (warp == 0) win_v[j] = *win_src(j, ch_v);
        }
    };
    win_load(true);
    const float A = -expf(p.A_log[h]), dtb = p.dt_bias[h];
    const float qscale = rsqrtf((float)DK);
    // qkv, b and a come from the projection
    pdl_wait();
    // the first token's gate inputs requested at once with its qkv values (in the loop they followed the conv's
    // loads: two L2 round trips)
    float b0 = 0.0f, a0 = 0.0f;
    if (tid == 0 && sp.n > 0) b0 = p.b[(int64_t)sp.row0 * p.Hv + h], a0 = p.a[(int64_t)sp.row0 * p.Hv + h];
    win_load(false);

    for (int r = 0; r < sp.n; r++) {
        const int row = sp.row0 + r;
        // 1. conv + SiLU of this block's channels (raw q, k: the L2 norms are scalars applied below)
        const float qv = conv_token(p, cstate, sp, r, ch_q, pre_q), kv = conv_token(p, cstate, sp, r, ch_k, pre_k);
        if (warp == 0) s_v[lane] = conv_token(p, cstate, sp, r, ch_v, pre_v);
        s_q[tid] = qv, s_k[tid] = kv;  // row warp*32 + lane: read back by this warp only
        // 2. gates: beta = sigmoid(b), alpha = exp(-exp(A_log) softplus(a + dt_bias))
        if (tid == 0)
            gdn_gates(r == 0 ? b0 : p.b[(int64_t)row * p.Hv + h], r == 0 ? a0 : p.a[(int64_t)row * p.Hv + h], A, dtb, s_scal);
        // 3. this warp's parts of |q|^2, |k|^2, q.k and of S^T k, S^T q over its 32 key rows (old state)
        const float sqq = warp_sum(qv * qv), skk = warp_sum(kv * kv), sqk = warp_sum(qv * kv);
        __syncwarp();
        float u = 0, w = 0;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            u = fmaf(st[i], s_k[warp * 32 + i], u);
            w = fmaf(st[i], s_q[warp * 32 + i], w);
        }
        s_red[0][warp][lane] = u, s_red[1][warp][lane] = w;
        if (lane == 0) s_sum[0][warp] = sqq, s_sum[1][warp] = skk, s_sum[2][warp] = sqk;
        __syncthreads();  // the only barrier of a token
        // 4. with q^ = q rq and k^ = k rk (L2-normalised, q also scaled by 1/sqrt(dk)): delta = beta (v - alpha
        //    S^T k^); S' = alpha S + k^ delta^T; o = S'^T q^ = alpha S^T q^ + (k^ . q^) delta (one pass over S)
        float tq = 0, tk = 0, tqk = 0, su = 0, sw = 0;
#pragma unroll
        for (int i = 0; i < k_warps; i++) {
            tq += s_sum[0][i], tk += s_sum[1][i], tqk += s_sum[2][i];
            su += s_red[0][i][lane], sw += s_red[1][i][lane];
        }
        const float rq = rsqrtf(tq + 1e-6f) * qscale, rk = rsqrtf(tk + 1e-6f);
        const float beta = s_scal[0], alpha = s_scal[1];
        const float delta = beta * (s_v[lane] - alpha * (su * rk));
        if (warp == 0) p.o[(int64_t)row * p.Hv * p.dv + h * p.dv + col] = alpha * (sw * rq) + (tqk * rq * rk) * delta;
#pragma unroll
        for (int i = 0; i < 32; i++) st[i] = fmaf(alpha, st[i], (s_k[warp * 32 + i] * rk) * delta);
        if (r + 1 < sp.n) __syncthreads();  // s_q, s_k, s_v, s_red, s_sum are reused by the next token
    }
#pragma unroll
    for (int i = 0; i < 32; i++) state_st(S + (int64_t)(warp * 32 + i) * p.dv + col, st[i]);

    // 5. new conv window (the last K-1 raw inputs) into the other parity buffer
    if (win_regs) {
#pragma unroll
        for (int j = 0; j < k_win; j++) {
            if (j >= P) continue;
            if (owner_qk) cnext[j * C + ch_q] = win_q[j], cnext[j * C + ch_k] = win_k[j];
            if (warp == 0) cnext[j * C + ch_v] = win_v[j];
        }
    } else {
        for (int j = 0; j < P; j++) {
            if (owner_qk) cnext[j * C + ch_q] = *win_src(j, ch_q), cnext[j * C + ch_k] = *win_src(j, ch_k);
            if (warp == 0) cnext[j * C + ch_v] = *win_src(j, ch_v);
        }
    }
}

// recur_kernel with the state staged in shared memory, for decode batches: per (span, value head), the head's
// state [DK, COLS] (64 KB) streams in by cp.async at the start, which holds no registers while in flight, so an SM
// keeps 3 x 64 KB of state in flight where the register form, its 32 state registers a thread capping it at ~5
// blocks of 16 KB, keeps ~80 KB (1.5 TB/s at 64 rows; this form 2.2 TB/s at 256 rows, on the H100). Each thread
// then sums S^T k and S^T q over one column x RPP key rows, and updates 4 columns x VR rows (float4: a warp moves
// 512 contiguous bytes, 256 of a bf16 state); at the span's last token the update goes straight to global memory.
// Roles: threads < DK convolve q and k channel tid, threads DK .. DK + COLS the v channels.
// A bf16 state (TS): in a step whose spans are all single tokens (ONE: gdn_params::max_span 1) it stays bf16 in
// shared memory (32 KB: 4 blocks an SM), read as fp32 and stored at once; in other steps it lands by cp.async in
// the fp32 buffer's upper half and is widened in place before the first token reads it (the tokens of a span
// update it in fp32 between).
template <int COLS, class TS, bool ONE>
__global__ void __launch_bounds__(k_smem_threads, ONE && sizeof(TS) == 2 ? 4 : 3)
    recur_smem_kernel(const gdn_params p, int max_rows) {
    constexpr int NT = k_smem_threads, PARTS = NT / COLS, RPP = DK / PARTS;
    static_assert(NT % COLS == 0 && DK % PARTS == 0 && DK + COLS <= NT && COLS % 32 == 0 && NT % (COLS / 4) == 0 &&
                      DK % (NT / (COLS / 4)) == 0, "recur_smem_kernel shape");
    using TM = std::conditional_t<ONE, TS, float>;  // the staged state's type
    constexpr bool WIDEN = sizeof(TS) < sizeof(TM);
    extern __shared__ float4 s_state4[];
    TM* const sS = reinterpret_cast<TM*>(s_state4);  // [DK][COLS]
    __shared__ float s_q[DK], s_k[DK], s_v[COLS], s_red[2][PARTS][COLS], s_scal[2], s_sum[3][k_warps];
    __shared__ float s_win[k_win][2 * DK + COLS];  // the new conv window's entries [j][q | k | the block's v channels]
    __shared__ __align__(16) float s_delta[COLS];  // the token's delta per column, for the update's layout
    const int span = blockIdx.x, h = blockIdx.y, cb = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const dspan sp = open_span(p, span, max_rows);
    if (sp.n > max_rows) return;
    const dseq sq = p.seqs[span];
    TS* S = s_buf<TS>(sq, p.shape, p.slot) + (int64_t)h * DK * p.dv + cb * COLS;
    // the state first (16-byte aligned: cuda_state's layout): it needs nothing from the projection (PDL), and
    // everything else waits on it
    constexpr int PER16 = 16 / sizeof(TS);  // state entries a 16-byte copy moves
    TS* const staged = reinterpret_cast<TS*>(sS) + (WIDEN ? DK * COLS : 0);  // widened: from the upper half
    for (int c = tid; c < DK * COLS / PER16; c += NT) {
        const int r = c / (COLS / PER16), cc = c % (COLS / PER16);
        cp_async16(staged + r * COLS + cc * PER16, S + (int64_t)r * p.dv + cc * PER16);
    }
    cp_async_commit();
    // bf16: each thread reads its staged entries (8 a 16-byte word), all threads wait, then write them as fp32
    // over the whole buffer (the lower half first held nothing, the upper half's words are all read by then)
    auto widen = [&] {
        if constexpr (WIDEN) {
            constexpr int WORDS = DK * COLS / 8 / NT;
            static_assert(DK * COLS % (8 * NT) == 0, "recur_smem_kernel: bf16 widening shape");
            uint4 w[WORDS];
#pragma unroll
            for (int i = 0; i < WORDS; i++) w[i] = reinterpret_cast<const uint4*>(staged)[tid + i * NT];
            __syncthreads();
#pragma unroll
            for (int i = 0; i < WORDS; i++) {
                const float2 a = bf16x2_bits_to_float2(w[i].x), b = bf16x2_bits_to_float2(w[i].y),
                             c = bf16x2_bits_to_float2(w[i].z), d = bf16x2_bits_to_float2(w[i].w);
                float4* dst = reinterpret_cast<float4*>(sS) + 2 * (tid + i * NT);
                dst[0] = make_float4(a.x, a.y, b.x, b.y);
                dst[1] = make_float4(c.x, c.y, d.x, d.y);
            }
        }
    };
    const int parity = sq.meta[1] & 1;
    const float* cstate = conv_buf(sq, p.shape, p.slot, parity);
    float* cnext = conv_buf(sq, p.shape, p.slot, parity ^ 1);
    const int group = p.Hv / p.Hk, kh = h / group, kd = p.Hk * p.dk;
    const bool qk_role = tid < DK, v_role = tid >= DK && tid < DK + COLS;
    const int ch_q = kh * DK + tid, ch_k = kd + kh * DK + tid, ch_v = 2 * kd + h * p.dv + cb * COLS + (tid - DK);
    const int P = p.K - 1, C = (int)p.shape.conv_ch;
    const float pre_q = qk_role ? window_terms(p, cstate, ch_q) : 0.0f;
    const float pre_k = qk_role ? window_terms(p, cstate, ch_k) : 0.0f, pre_v = v_role ? window_terms(p, cstate, ch_v) : 0.0f;
    // the new conv window, each channel by one owner (as recur_kernel: q/k by the group's first value head's first
    // column block, v by every block), staged in shared memory where K - 1 <= k_win (registers held through the
    // whole kernel would cost occupancy; a load from global memory after the state's stores waits for them)
    const bool owner_qk = qk_role && (h % group == 0) && cb == 0, win_smem = P <= k_win;
    auto win_src = [&](int j, int ch) { return window_source(p, sp, cstate, j, ch); };
    auto win_load = [&](bool old) {  // the entries from the old window (before the wait) or from the span
#pragma unroll
        for (int j = 0; j < k_win; j++) {
            if (!win_smem || j >= P || (sp.n - P + j < 0) != old) continue;
            if (owner_qk) s_win[j][tid] = *win_src(j, ch_q), s_win[j][DK + tid] = *win_src(j, ch_k);
            if (v_role) s_win[j][DK + tid] = *win_src(j, ch_v);
        }
    };
    win_load(true);
    const float A = -expf(p.A_log[h]), dtb = p.dt_bias[h];
    const float qscale = rsqrtf((float)DK);
    pdl_wait();  // qkv, b and a come from the projection
    float b0 = 0.0f, a0 = 0.0f;
    if (tid == 0 && sp.n > 0) b0 = p.b[(int64_t)sp.row0 * p.Hv + h], a0 = p.a[(int64_t)sp.row0 * p.Hv + h];
    win_load(false);

    const int vc = tid % COLS, part = tid / COLS, col = cb * COLS + vc;  // this thread's state column and rows
    const TM* const mine = sS + part * RPP * COLS + vc;                   // its rows' entries, COLS apart
    // the update's layout: columns 4 c4 .. 4 c4 + 3, key rows vg VR .. vg VR + VR - 1
    constexpr int C4 = COLS / 4, VR = DK / (NT / C4);
    const int c4 = tid % C4, vg = tid / C4;
    for (int r = 0; r < sp.n; r++) {
        const int row = sp.row0 + r;
        if (qk_role) {  // whole warps 0 .. DK/32 - 1
            const float qv = conv_token(p, cstate, sp, r, ch_q, pre_q), kv = conv_token(p, cstate, sp, r, ch_k, pre_k);
            s_q[tid] = qv, s_k[tid] = kv;
            const float sqq = warp_sum(qv * qv), skk = warp_sum(kv * kv), sqk = warp_sum(qv * kv);
            if (lane == 0) s_sum[0][warp] = sqq, s_sum[1][warp] = skk, s_sum[2][warp] = sqk;
        }
        if (v_role) s_v[tid - DK] = conv_token(p, cstate, sp, r, ch_v, pre_v);
        if (tid == 0)
            gdn_gates(r == 0 ? b0 : p.b[(int64_t)row * p.Hv + h], r == 0 ? a0 : p.a[(int64_t)row * p.Hv + h], A, dtb, s_scal);
        if (r == 0) {
            cp_async_wait<0>();
            if constexpr (WIDEN) {
                // (each thread reads back only its own copies, waited for above; this barrier keeps that safe
                // should the copy and widening layouts ever differ)
                __syncthreads();
                widen();
            }
        }
        __syncthreads();
        // this thread's parts of S^T k and S^T q over its rows (old state; raw q, k: the norms are scalars)
        float u = 0, w = 0;
#pragma unroll 8
        for (int i = 0; i < RPP; i++) {
            const float s = state_ld(mine + i * COLS);
            u = fmaf(s, s_k[part * RPP + i], u);
            w = fmaf(s, s_q[part * RPP + i], w);
        }
        s_red[0][part][vc] = u, s_red[1][part][vc] = w;
        __syncthreads();
        float tq = 0, tk = 0, tqk = 0, su = 0, sw = 0;
#pragma unroll
        for (int i = 0; i < k_warps; i++) tq += s_sum[0][i], tk += s_sum[1][i], tqk += s_sum[2][i];
#pragma unroll
        for (int i = 0; i < PARTS; i++) su += s_red[0][i][vc], sw += s_red[1][i][vc];
        const float rq = rsqrtf(tq + 1e-6f) * qscale, rk = rsqrtf(tk + 1e-6f);
        const float beta = s_scal[0], alpha = s_scal[1];
        if (part == 0) {
            const float delta = beta * (s_v[vc] - alpha * (su * rk));
            s_delta[vc] = delta;
            p.o[(int64_t)row * p.Hv * p.dv + h * p.dv + col] = alpha * (sw * rq) + (tqk * rq * rk) * delta;
        }
        __syncthreads();
        // S' = alpha S + k^ delta^T, four columns x VR rows a thread: a warp stores 128 contiguous floats at once
        const float4 d4 = reinterpret_cast<const float4*>(s_delta)[c4];
        const bool last = r + 1 == sp.n;
#pragma unroll 4
        for (int i = 0; i < VR; i++) {
            const int k = vg * VR + i;
            float4 x = state_ld4(sS + k * COLS + 4 * c4);
            const float kd = s_k[k] * rk;
            x.x = fmaf(alpha, x.x, kd * d4.x), x.y = fmaf(alpha, x.y, kd * d4.y);
            x.z = fmaf(alpha, x.z, kd * d4.z), x.w = fmaf(alpha, x.w, kd * d4.w);
            if (last) state_st4(S + (int64_t)k * p.dv + 4 * c4, x);
            else state_st4(sS + k * COLS + 4 * c4, x);
        }
        if (!last) __syncthreads();  // the state, s_q, s_k, s_v, s_red, s_sum, s_delta are reused by the next token
    }
    cp_async_wait<0>();  // (a span of no rows: its copies must land before the block ends)

    if (win_smem) {  // (each entry written and read by the same thread)
#pragma unroll
        for (int j = 0; j < k_win; j++) {
            if (j >= P) continue;
            if (owner_qk) cnext[j * C + ch_q] = s_win[j][tid], cnext[j * C + ch_k] = s_win[j][DK + tid];
            if (v_role) cnext[j * C + ch_v] = s_win[j][DK + tid];
        }
    } else {
        for (int j = 0; j < P; j++) {
            if (owner_qk) cnext[j * C + ch_q] = *win_src(j, ch_q), cnext[j * C + ch_k] = *win_src(j, ch_k);
            if (v_role) cnext[j * C + ch_v] = *win_src(j, ch_v);
        }
    }
}

// y = o / rms(o) * w * silu(z) per (row, head) of dv values, in two forms (measured: docs/PERF.md, Prefill):
//  - gated_norm_kernel: one block of dv threads per (row, head), for decode steps, where its few blocks of
//    many threads beat the warp form at batch 1;
//  - gated_norm_warp_kernel: one warp per (row, head), k_norm_warps a block, for steps with a prompt span, where
//    the block form's two barriers a head left it far below the DRAM bandwidth.
__global__ void gated_norm_kernel(const gdn_params p) {
    __shared__ float scratch[32];
    pdl_trigger();
    const int64_t rh = blockIdx.x;  // row * Hv + head
    const int j = threadIdx.x;
    const float w = p.norm_w[j];  // a weight: before the wait
    pdl_wait();  // o comes from the recurrence
    // z with o, before the reduction's barriers: loads are not moved across them, and z after the sum cost a
    // second L2 round trip
    const float o = p.o[rh * p.dv + j], gate = siluf_(p.z[rh * p.dv + j]);
    const float inv = rsqrtf(block_sum(o * o, scratch) / (float)p.dv + p.eps);
    p.out[rh * p.dv + j] = o * inv * w * gate;
}

// V > 0: dv = 32 V, each lane's values loaded at once (one round trip, not V); 0: any dv.
constexpr int k_norm_warps = 8;
template <int V>
__global__ void __launch_bounds__(32 * k_norm_warps) gated_norm_warp_kernel(const gdn_params p) {
    pdl_trigger();
    const int64_t rh = (int64_t)blockIdx.x * k_norm_warps + threadIdx.x / 32;  // row * Hv + head
    const int lane = threadIdx.x % 32;
    const bool live = rh < (int64_t)p.T * p.Hv;
    if constexpr (V > 0) {
        float w[V], o[V], z[V];
#pragma unroll
        for (int i = 0; i < V; i++) w[i] = p.norm_w[lane + 32 * i];  // weights: before the wait
        pdl_wait();  // o comes from the recurrence
        if (!live) return;
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < V; i++) o[i] = p.o[rh * p.dv + lane + 32 * i], z[i] = p.z[rh * p.dv + lane + 32 * i];
#pragma unroll
        for (int i = 0; i < V; i++) ss = fmaf(o[i], o[i], ss);
        const float inv = rsqrtf(warp_sum(ss) / (float)p.dv + p.eps);
#pragma unroll
        for (int i = 0; i < V; i++) p.out[rh * p.dv + lane + 32 * i] = o[i] * inv * w[i] * siluf_(z[i]);
    } else {
        pdl_wait();
        if (!live) return;
        const float *o = p.o + rh * p.dv, *z = p.z + rh * p.dv;
        float ss = 0.0f;
        for (int j = lane; j < p.dv; j += 32) ss = fmaf(o[j], o[j], ss);
        const float inv = rsqrtf(warp_sum(ss) / (float)p.dv + p.eps);
        for (int j = lane; j < p.dv; j += 32) p.out[rh * p.dv + j] = o[j] * inv * p.norm_w[j] * siluf_(z[j]);
    }
}

template <int COLS, class TS, bool ONE>
void launch_recur_smem(const gdn_params& p, int max_rows, cudaStream_t stream) {
    // beyond the default 48 KB (COLS = 128: 64 KB, 32 KB for a bf16 state kept so)
    const size_t smem = (size_t)DK * COLS * (ONE ? sizeof(TS) : sizeof(float));
    allow_dynamic_smem<recur_smem_kernel<COLS, TS, ONE>>(smem);
    launch_pdl(recur_smem_kernel<COLS, TS, ONE>, dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / COLS)),
               dim3(k_smem_threads), smem, stream, p, max_rows);
}

}  // namespace

void gdn_forward(const gdn_params& p, cudaStream_t stream) {
    TANSY_CHECK(p.dk == DK, "cuda deltanet supports key head dim %d, got %d", DK, p.dk);
    TANSY_CHECK(p.dv % COLS == 0 && p.dv <= 1024, "cuda deltanet: value head dim %d", p.dv);
    TANSY_CHECK(p.K >= 2 && p.Hv % p.Hk == 0, "cuda deltanet: conv kernel %d", p.K);
    if (p.T == 0) return;
    // The spans tile the rows with at least one row each, so none is longer than T - (n_spans - 1): decode
    // batches never launch the prefill path, and a lone long span (a prompt) needs no decode launch.
    const bool any_long = p.T - (p.n_spans - 1) > k_gdn_recur_max_rows;
    const bool any_short = !(p.n_spans == 1 && any_long);
    if (any_long) gdn_prefill(p, k_gdn_recur_max_rows + 1, stream);
    if (any_short) {
        const int max_rows = any_long ? k_gdn_recur_max_rows : INT_MAX;
        with_state_type(p.shape.s16, [&](auto ts) {
            using TS = decltype(ts);
            constexpr bool B16 = sizeof(TS) == 2;
            if (!deltanet_recur_smem(p.n_spans) || p.dv % k_smem_cols != 0)
                launch_pdl(recur_kernel<TS>, dim3((unsigned)p.n_spans, (unsigned)p.Hv, (unsigned)(p.dv / COLS)),
                           dim3(DK), 0, stream, p, max_rows);
            else if (B16 && p.max_span == 1)  // every span one token (spans have >= 1 row): bf16 on chip, no widening
                launch_recur_smem<k_smem_cols, TS, B16>(p, max_rows, stream);
            else
                launch_recur_smem<k_smem_cols, TS, false>(p, max_rows, stream);
        });
        CUDA_CHECK_LAUNCH();
    }
    const int64_t heads = (int64_t)p.T * p.Hv;
    if (!any_long) {  // a decode step
        launch_pdl(gated_norm_kernel, dim3((unsigned)heads), dim3((unsigned)p.dv), 0, stream, p);
    } else {
        const dim3 grid((unsigned)((heads + k_norm_warps - 1) / k_norm_warps)), block(32 * k_norm_warps);
        if (p.dv == 128)
            launch_pdl(gated_norm_warp_kernel<4>, grid, block, 0, stream, p);
        else if (p.dv == 64)
            launch_pdl(gated_norm_warp_kernel<2>, grid, block, 0, stream, p);
        else
            launch_pdl(gated_norm_warp_kernel<0>, grid, block, 0, stream, p);
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
