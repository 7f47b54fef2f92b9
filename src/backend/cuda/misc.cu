#include <algorithm>
#include <cfloat>

#include "backend/cuda/common.cuh"
#include "backend/cuda/misc.cuh"
#include "backend/cuda/mma.cuh"  // pack_f16

namespace tansy::cuda {

namespace {

__global__ void embed_kernel(float* x, const int32_t* ids, const dmat table) {
    const int t = blockIdx.x;
    int64_t id = ids[t];
    id = id < 0 ? 0 : id >= table.rows ? table.rows - 1 : id;  // ids are validated on the host; stay in bounds
    const uint32_t* w = table.w + id * table.row_words();
    float* out = x + (int64_t)t * table.cols;
    for (int64_t c = threadIdx.x; c < table.cols; c += blockDim.x) {
        float v;
        if (table.fmt == dfmt::bf16) {
            const uint32_t word = w[c / 2];
            v = __uint_as_float((c & 1) ? (word & 0xFFFF0000u) : (word << 16));
        } else {
            const int bits = table.bits(), per = 32 / bits;
            const uint32_t q = (w[c / per] >> (bits * (c % per))) & ((1u << bits) - 1);
            const uint32_t sb = table.sb[id * table.n_groups() + c / table.group];
            v = sb_scale(sb) * (float)q + sb_bias(sb);
        }
        out[c] = v;
    }
}

// One block per row; 16-byte accesses where the row allows them (4x fewer loads in flight per byte than
// scalar ones, which left the kernel at about half the DRAM bandwidth on prompts). y and/or y16 (fp16).
__global__ void rms_norm_kernel(float* y, uint16_t* y16, const float* x, const float* w, int64_t n, float eps) {
    __shared__ float scratch[32];
    pdl_trigger();
    const float* xr = x + blockIdx.x * n;
    float* yr = y ? y + blockIdx.x * n : nullptr;
    uint16_t* hr = y16 ? y16 + blockIdx.x * n : nullptr;
    const bool vec = n % 4 == 0 && (((uintptr_t)xr | (uintptr_t)yr | (uintptr_t)w) & 15) == 0 && ((uintptr_t)hr & 7) == 0;
    float ss = 0;
    if (vec) {
        for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(xr)[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)n + eps);
    if (vec) {
        for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(xr)[i], g = reinterpret_cast<const float4*>(w)[i];
            const float4 o = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
            if (yr) reinterpret_cast<float4*>(yr)[i] = o;
            if (hr) reinterpret_cast<uint2*>(hr)[i] = make_uint2(pack_f16(o.x, o.y), pack_f16(o.z, o.w));
        }
    } else {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const float o = xr[i] * inv * w[i];
            if (yr) yr[i] = o;
            if (hr) hr[i] = (uint16_t)(pack_f16(o, 0.0f) & 0xFFFFu);
        }
    }
}

__global__ void gather_kernel(float* out, const float* in, const int32_t* rows, int64_t cols) {
    const int64_t src = rows[blockIdx.x];
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[blockIdx.x * cols + c] = in[src * cols + c];
}

// (value, index) pairs reduced so that the larger value wins and ties go to the lower index.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

__device__ void block_best(float& v, int& i) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) s_v[warp] = v, s_i[warp] = i;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? s_v[lane] : -INFINITY;
        i = lane < (int)(blockDim.x / 32) ? s_i[lane] : INT_MAX;
        for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
}

// pass 1: block b of row r scans columns [b*span, (b+1)*span) and writes its best pair.
__global__ void argmax_partial_kernel(float* pv, int* pi, const float* logits, int64_t vocab, int64_t n_valid,
                                      int64_t span) {
    const float* l = logits + blockIdx.y * vocab;
    const int64_t lo = blockIdx.x * span, hi = min(n_valid, lo + span);
    float v = -INFINITY;
    int i = INT_MAX;
    for (int64_t c = lo + threadIdx.x; c < hi; c += blockDim.x) better(v, i, l[c], (int)c);
    block_best(v, i);
    if (threadIdx.x == 0) pv[blockIdx.y * gridDim.x + blockIdx.x] = v, pi[blockIdx.y * gridDim.x + blockIdx.x] = i;
}

// pass 2: one block per row folds the partials.
__global__ void argmax_final_kernel(int32_t* ids, const float* pv, const int* pi, int n_part) {
    float v = -INFINITY;
    int i = INT_MAX;
    for (int b = threadIdx.x; b < n_part; b += blockDim.x) better(v, i, pv[blockIdx.x * n_part + b], pi[blockIdx.x * n_part + b]);
    block_best(v, i);
    if (threadIdx.x == 0) ids[blockIdx.x] = i == INT_MAX ? 0 : i;
}

__global__ void gather_slots_kernel(int32_t* out, const int32_t* vals, const int32_t* row_slot, int rows) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) out[r] = vals[row_slot[r]];
}
__global__ void scatter_slots_kernel(int32_t* vals, const int32_t* in, const int32_t* row_slot, int rows) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) vals[row_slot[r]] = in[r];
}

__global__ void advance_kernel(const dseq* seqs, const dspan* spans, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    seqs[i].meta[0] += spans[i].n;
    seqs[i].meta[1] += 1;
}

}  // namespace

void embed_rows(float* x, const int32_t* ids, int T, const dmat& table, cudaStream_t stream) {
    if (T == 0) return;
    embed_kernel<<<(unsigned)T, 256, 0, stream>>>(x, ids, table);
    CUDA_CHECK_LAUNCH();
}

void rms_norm_f32(float* y, const float* x, const float* w, int T, int64_t n, float eps, cudaStream_t stream,
                  uint16_t* y16) {
    TANSY_CHECK(y || y16, "rms_norm: no output");
    if (T == 0) return;
    rms_norm_kernel<<<(unsigned)T, 256, 0, stream>>>(y, y16, x, w, n, eps);
    CUDA_CHECK_LAUNCH();
}

void gather_rows_f32(float* out, const float* in, const int32_t* rows, int n, int64_t cols, cudaStream_t stream) {
    if (n == 0) return;
    gather_kernel<<<(unsigned)n, 256, 0, stream>>>(out, in, rows, cols);
    CUDA_CHECK_LAUNCH();
}

void argmax_rows(int32_t* ids, const float* logits, int rows, int64_t vocab, int64_t n_valid, float* scratch,
                 cudaStream_t stream) {
    if (rows == 0) return;
    const int n_part = (int)std::min<int64_t>(k_argmax_parts, (n_valid + 2047) / 2048);
    const int64_t span = (n_valid + n_part - 1) / n_part;
    float* pv = scratch;
    int* pi = (int*)(scratch + (size_t)rows * n_part);
    argmax_partial_kernel<<<dim3((unsigned)n_part, (unsigned)rows), 256, 0, stream>>>(pv, pi, logits, vocab, n_valid, span);
    CUDA_CHECK_LAUNCH();
    argmax_final_kernel<<<(unsigned)rows, 256, 0, stream>>>(ids, pv, pi, n_part);
    CUDA_CHECK_LAUNCH();
}

void gather_slots_i32(int32_t* out, const int32_t* vals, const int32_t* row_slot, int rows, cudaStream_t stream) {
    if (rows == 0) return;
    gather_slots_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, stream>>>(out, vals, row_slot, rows);
    CUDA_CHECK_LAUNCH();
}
void scatter_slots_i32(int32_t* vals, const int32_t* in, const int32_t* row_slot, int rows, cudaStream_t stream) {
    if (rows == 0) return;
    scatter_slots_kernel<<<(unsigned)((rows + 127) / 128), 128, 0, stream>>>(vals, in, row_slot, rows);
    CUDA_CHECK_LAUNCH();
}

void advance_seqs(const dseq* seqs, const dspan* spans, int n, cudaStream_t stream) {
    if (n == 0) return;
    advance_kernel<<<(unsigned)((n + 127) / 128), 128, 0, stream>>>(seqs, spans, n);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
