// Small kernels: embedding lookup, fp32 RMSNorm, row gather, argmax, end-of-step bookkeeping.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/gemv.cuh"
#include "backend/cuda/seq_layout.h"

namespace tansy::cuda {

// x[t] = dequantised row ids[t] of table (ids clamped into range). CPU twin: matrix::row_f32.
void embed_rows(float* x, const int32_t* ids, int T, const dmat& table, cudaStream_t stream);

// y[t] = x[t] / rms(x[t]) * w. CPU twin: cpu::rms_norm. y16 (optional, row stride n): the same values as fp16, as
// to_f16(y16, y, T, n, n, 1) would write them, in the same pass (the fast GEMMs' A operand without a second pass
// over y); y may then be nullptr, when nothing reads the fp32 values.
void rms_norm_f32(float* y, const float* x, const float* w, int T, int64_t n, float eps, cudaStream_t stream,
                  uint16_t* y16 = nullptr);

// out[i] = in[rows[i]], rows in device memory. rows_n <= T.
void gather_rows_f32(float* out, const float* in, const int32_t* rows, int n, int64_t cols, cudaStream_t stream);

// ids[r] = argmax of logits row r (first maximum); only the first n_valid columns compete. Two passes over
// up to k_argmax_parts blocks per row; scratch holds 2 * rows * k_argmax_parts floats.
constexpr int k_argmax_parts = 256;
void argmax_rows(int32_t* ids, const float* logits, int rows, int64_t vocab, int64_t n_valid, float* scratch,
                 cudaStream_t stream);

// out[r] = vals[row_slot[r]], and vals[row_slot[r]] = in[r], for r < rows (int32). CPU twins: backend's
// gather_slots / scatter_slots.
void gather_slots_i32(int32_t* out, const int32_t* vals, const int32_t* row_slot, int rows, cudaStream_t stream);
void scatter_slots_i32(int32_t* vals, const int32_t* in, const int32_t* row_slot, int rows, cudaStream_t stream);

// For each span i: meta[0] (n_past) += spans[i].n, meta[1] (steps) += 1.
void advance_seqs(const dseq* seqs, const dspan* spans, int n, cudaStream_t stream);

}  // namespace tansy::cuda
