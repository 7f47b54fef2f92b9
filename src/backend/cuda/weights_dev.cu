#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/cuda/common.cuh"
#include "backend/cuda/weights_dev.h"
#include "core/log.h"

namespace tansy::cuda {

namespace {

// splitmix64 of (seed, tensor, index): stateless, so any element can be generated independently.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Random codes, and per group a scale that gives the weights a standard deviation of `std` around zero:
// uniform codes in [0, 2^bits) have sd (2^bits)/sqrt(12); the bias centres them.
__global__ void synth_kernel(uint32_t* w, uint32_t* sb, int64_t n_words, int64_t n_groups, int bits, float std,
                             uint64_t seed) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += stride)
        w[i] = (uint32_t)mix64(seed ^ (uint64_t)i);
    if (!sb) return;
    const float levels = (float)(1 << bits), sd_codes = levels / sqrtf(12.0f);
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < n_groups; g += stride) {
        const uint64_t r = mix64(~seed ^ (uint64_t)g);
        const float scale = std / sd_codes * (0.75f + 0.5f * (float)(r & 0xFFFF) / 65535.0f);
        const float bias = -scale * (levels - 1) * 0.5f;
        sb[g] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(scale)) |
                ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(bias)) << 16);
    }
}

dfmt fmt_of(const matrix& m) {
    if (m.fmt == wfmt::dense) return dfmt::bf16;
    if (m.bits == 4) return dfmt::q4;
    if (m.bits == 8) return dfmt::q8;
    fail("%s: %d-bit weights are not supported by the cuda backend (4 and 8 are)", m.name.c_str(), m.bits);
}

uint16_t to_bf16(const uint8_t* p, dtype t) {
    switch (t) {
        case dtype::bf16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return h;
        }
        case dtype::f16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return f32_to_bf16(f16_to_f32(h));
        }
        case dtype::f32: {
            float f;
            memcpy(&f, p, 4);
            return f32_to_bf16(f);
        }
        default: TANSY_ABORT("dtype %s", dtype_name(t));
    }
}

}  // namespace

dmat device_weights::upload(const std::vector<const matrix*>& parts) {
    const matrix& first = *parts[0];
    dmat d;
    d.fmt = fmt_of(first);
    d.cols = first.cols;
    d.group = first.fmt == wfmt::affine ? first.group : 0;
    for (const matrix* m : parts) {
        TANSY_CHECK(fmt_of(*m) == d.fmt && m->cols == d.cols && (m->fmt == wfmt::dense || m->group == d.group),
                    "stacking %s with %s", m->name.c_str(), first.name.c_str());
        d.rows += m->rows;
    }
    const int64_t rw = d.row_words(), ng = d.n_groups();
    device_buffer buf((size_t)d.rows * (size_t)(rw + ng) * 4);
    uint32_t* w = (uint32_t*)buf.get();
    uint32_t* sb = ng ? w + d.rows * rw : nullptr;
    if (!first.w) {  // synthetic: generated on the device
        const float std = parts.size() > 1 || d.rows < 4 * d.cols ? 1.0f / std::sqrt((float)d.cols) : 1.0f;
        const uint64_t seed = seed_ * 0x100000001B3ull + ++synth_counter_;
        synth_kernel<<<1024, 256, 0, stream_>>>(w, sb, d.rows * rw, d.rows * ng, d.bits(), std, seed);
        CUDA_CHECK_LAUNCH();
    } else {
        int64_t r0 = 0;
        for (const matrix* m : parts) {
            if (m->fmt == wfmt::affine) {
                TANSY_CHECK(m->row_bytes() == (size_t)rw * 4, "%s row bytes", m->name.c_str());
                CUDA_CHECK(cudaMemcpyAsync(w + r0 * rw, m->w, (size_t)m->rows * m->row_bytes(), cudaMemcpyHostToDevice,
                                           stream_));
                std::vector<uint32_t> h((size_t)(m->rows * ng));
                const size_t es = dtype_size(m->type);
                for (int64_t i = 0; i < m->rows * ng; i++)
                    h[(size_t)i] = (uint32_t)to_bf16(m->scales + i * es, m->type) |
                                   ((uint32_t)to_bf16(m->biases + i * es, m->type) << 16);
                CUDA_CHECK(cudaMemcpy(sb + r0 * ng, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
            } else {
                std::vector<uint16_t> h((size_t)(m->rows * m->cols));
                const size_t es = dtype_size(m->type);
                for (int64_t i = 0; i < m->rows * m->cols; i++) h[(size_t)i] = to_bf16(m->w + i * es, m->type);
                CUDA_CHECK(cudaMemcpy(w + r0 * rw, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
            }
            r0 += m->rows;
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    d.w = w;
    d.sb = sb;
    bytes_ += buf.size();
    store_.push_back(std::move(buf));
    return d;
}

device_weights::concat device_weights::upload_concat(const std::vector<const matrix*>& Ws) {
    concat c;
    c.row0.assign(Ws.size(), 0);
    // group consecutive members of one format into one part
    for (size_t i = 0; i < Ws.size();) {
        size_t j = i + 1;
        while (j < Ws.size() && fmt_of(*Ws[j]) == fmt_of(*Ws[i]) && Ws[j]->cols == Ws[i]->cols &&
               (Ws[i]->fmt == wfmt::dense || Ws[j]->group == Ws[i]->group))
            j++;
        concat::part p;
        p.W = upload(std::vector<const matrix*>(Ws.begin() + (ptrdiff_t)i, Ws.begin() + (ptrdiff_t)j));
        int64_t r = 0;
        for (size_t k = i; k < j; k++) {
            p.members.push_back((int)k);
            c.row0[k] = r;
            r += Ws[k]->rows;
        }
        c.parts.push_back(std::move(p));
        i = j;
    }
    return c;
}

const float* device_weights::upload_vec(const std::vector<float>& v) {
    auto it = vecs_.find(v.data());
    if (it != vecs_.end()) return it->second;
    device_buffer buf(std::max<size_t>(v.size(), 1) * 4);
    buf.upload(v.data(), v.size() * 4);
    const float* p = (const float*)buf.get();
    bytes_ += buf.size();
    store_.push_back(std::move(buf));
    vecs_[v.data()] = p;
    return p;
}

void device_weights::bind(const model& m, cudaStream_t stream, uint64_t seed, float router_skew) {
    stream_ = stream, seed_ = seed, router_skew_ = router_skew;
    const model_weights& w = m.w;
    mats_[&w.embed] = upload({&w.embed});
    mats_[&w.lm_head] = w.lm_head.w == w.embed.w && w.lm_head.w ? mats_[&w.embed] : upload({&w.lm_head});
    upload_vec(w.final_norm);
    for (const layer_weights& l : w.layers) {
        upload_vec(l.input_norm);
        upload_vec(l.post_norm);
        if (l.kind == layer_kind::full_attention) {
            cats_[&l.attn.q_proj] = upload_concat({&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj});
            mats_[&l.attn.o_proj] = upload({&l.attn.o_proj});
            upload_vec(l.attn.q_norm);
            upload_vec(l.attn.k_norm);
        } else {
            cats_[&l.gdn.in_qkv] = upload_concat({&l.gdn.in_qkv, &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a});
            mats_[&l.gdn.out_proj] = upload({&l.gdn.out_proj});
            for (const auto* v : {&l.gdn.conv, &l.gdn.A_log, &l.gdn.dt_bias, &l.gdn.norm}) upload_vec(*v);
        }
        const moe_weights& mw = l.moe;
        moe_dev md;
        md.router = upload_concat({&mw.router, &mw.shared_expert_gate});
        auto ptrs = [](const std::vector<matrix>& v) {
            std::vector<const matrix*> p;
            for (const matrix& x : v) p.push_back(&x);
            return p;
        };
        md.m.gate = upload(ptrs(mw.gate));
        md.m.up = upload(ptrs(mw.up));
        md.m.down = upload(ptrs(mw.down));
        md.m.s_gate = upload({&mw.shared_gate});
        md.m.s_up = upload({&mw.shared_up});
        md.m.s_down = upload({&mw.shared_down});
        md.m.E = (int)m.cfg.n_experts, md.m.k = (int)m.cfg.top_k;
        md.m.F = m.cfg.expert_inter, md.m.Fs = m.cfg.shared_inter, md.m.D = m.cfg.hidden;
        if (router_skew > 0) {  // Zipf-like preference over a random permutation of the experts
            std::vector<int> perm((size_t)md.m.E);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), std::mt19937((uint32_t)(seed + moes_.size())));
            std::vector<float> bias((size_t)md.m.E);
            for (int r = 0; r < md.m.E; r++) bias[(size_t)perm[(size_t)r]] = -router_skew * std::log(1.0f + (float)r);
            device_buffer buf(bias.size() * 4);
            buf.upload(bias.data(), bias.size() * 4);
            md.router_bias = (const float*)buf.get();
            store_.push_back(std::move(buf));
        }
        moes_[&mw] = md;
    }
    TANSY_INFO("cuda: %.2f GB of weights on the device", bytes_ / 1e9);
}

const dmat& device_weights::mat(const matrix& m) const {
    auto it = mats_.find(&m);
    TANSY_CHECK(it != mats_.end(), "matrix %s was not bound to the cuda backend", m.name.c_str());
    return it->second;
}

const float* device_weights::vec(vec_view v) const {
    auto it = vecs_.find(v.data);
    TANSY_CHECK(it != vecs_.end(), "vector of %lld values was not bound to the cuda backend", (long long)v.n);
    return it->second;
}

const device_weights::concat& device_weights::cat(const std::vector<const matrix*>& Ws) const {
    auto it = cats_.find(Ws[0]);
    TANSY_CHECK(it != cats_.end() && it->second.row0.size() == Ws.size(), "projection group %s was not bound",
                Ws[0]->name.c_str());
    return it->second;
}

const device_weights::moe_dev& device_weights::moe(const moe_weights& w) const {
    auto it = moes_.find(&w);
    TANSY_CHECK(it != moes_.end(), "moe block was not bound to the cuda backend");
    return it->second;
}

}  // namespace tansy::cuda
