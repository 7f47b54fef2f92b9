#include "quant/quantize_model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/check.h"
#include "core/log.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"

namespace tansy {

std::vector<std::pair<std::string, int>> quant_policy::default_overrides() {
    return {{"mlp.gate", 8},
            {"mlp.shared_expert_gate", 8},
            {"embed_tokens", 8},
            {"self_attn.v_proj", 8},
            {"linear_attn.in_proj_a", 8},
            {"linear_attn.in_proj_b", 8},
            {"layers.0.linear_attn", 8}};
}

std::vector<std::pair<std::string, int>> quant_policy::default_group_overrides() { return {}; }

namespace {

// The value of the last override whose pattern matches `path` as whole dotted components, else `fallback`.
int matching_override(const std::vector<std::pair<std::string, int>>& overrides, const std::string& path, int fallback) {
    int v = fallback;
    const std::string dotted = "." + path + ".";
    for (const auto& [pat, n] : overrides)
        if (dotted.find("." + pat + ".") != std::string::npos) v = n;
    return v;
}

// "PATTERN=N" -> (PATTERN, N); throws when malformed.
std::pair<std::string, int> split_override(const std::string& spec, const char* what) {
    const size_t eq = spec.rfind('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
        fail("'%s' is not PATTERN=%s", spec.c_str(), what);
    const std::string num = spec.substr(eq + 1);
    if (num.size() > 4 || num.find_first_not_of("0123456789") != std::string::npos)
        fail("'%s': %s must be a number", spec.c_str(), what);
    return {spec.substr(0, eq), std::stoi(num)};
}

std::string dims_str(const std::vector<int64_t>& d) {
    std::string r = "[";
    for (size_t i = 0; i < d.size(); i++) r += (i ? ", " : "") + std::to_string(d[i]);
    return r + "]";
}

}  // namespace

// Columns an activation never reached would otherwise cost nothing to get wrong; a floor of this fraction of
// the mean keeps every weight in the fit (calibration text never covers every input).
constexpr double IMATRIX_FLOOR = 0.02;

std::shared_ptr<const importance> importance::load(const std::string& path) {
    st_file f(path);
    auto imp = std::make_shared<importance>();
    imp->file_ = path;
    for (const st_tensor& t : f.tensors()) {
        if (t.type != dtype::f32 || t.shape.empty() || t.shape.size() > 2)
            fail("%s: '%s' must be F32 [cols] or [experts, cols] (got %s %s)", path.c_str(), t.name.c_str(),
                 dtype_name(t.type), t.shape_str().c_str());
        std::vector<float> v((size_t)t.numel());
        memcpy(v.data(), t.data, t.nbytes());
        const int64_t cols = t.shape.back();
        for (size_t r = 0; r < v.size(); r += (size_t)cols) {
            double mean = 0;
            for (int64_t c = 0; c < cols; c++) {
                if (!(v[r + c] >= 0) || !std::isfinite(v[r + c]))
                    fail("%s: '%s' holds %g; importances are finite and >= 0", path.c_str(), t.name.c_str(),
                         v[r + c]);
                mean += v[r + c];
            }
            mean /= (double)cols;
            for (int64_t c = 0; c < cols; c++) v[r + c] = (float)(v[r + c] + IMATRIX_FLOOR * mean);
        }
        imp->by_path_[t.name] = {t.shape, std::move(v)};
    }
    return imp;
}

std::vector<const float*> importance::for_module(const std::string& path, size_t n_parts, int64_t cols) const {
    auto it = by_path_.find(path);
    if (it == by_path_.end()) return {};
    const auto& [shape, v] = it->second;
    const bool per_part = shape.size() == 2;
    if (shape.back() != cols || (per_part && shape[0] != (int64_t)n_parts))
        fail("%s: '%s' has shape %s; the module has %zu part(s) of %lld columns", file_.c_str(), path.c_str(),
             dims_str(shape).c_str(), n_parts, (long long)cols);
    std::vector<const float*> out;
    for (size_t k = 0; k < n_parts; k++) out.push_back(v.data() + (per_part ? k * (size_t)cols : 0));
    return out;
}

quant_policy quant_policy::mlx() {
    quant_policy p;
    p.method = quant_method::minmax;
    p.overrides = {{"mlp.gate", 8}, {"mlp.shared_expert_gate", 8}};
    p.group_overrides = {};
    return p;
}

std::pair<std::string, int> quant_policy::parse_override(const std::string& spec) {
    auto o = split_override(spec, "BITS (e.g. lm_head=8)");
    if (o.second != 2 && o.second != 4 && o.second != 8) fail("'%s': bits must be 2, 4 or 8", spec.c_str());
    return o;
}

std::pair<std::string, int> quant_policy::parse_group_override(const std::string& spec) {
    auto o = split_override(spec, "GROUP (e.g. layers.3.self_attn=32)");
    if (o.second < 32 || o.second > 256 || o.second % 32 != 0)
        fail("'%s': the group size must be a multiple of 32 from 32 to 256", spec.c_str());
    return o;
}

int quant_policy::bits_for(const std::string& path) const { return matching_override(overrides, path, bits); }

int quant_policy::group_for(const std::string& path) const {
    return matching_override(group_overrides, path, group);
}

std::vector<linear_module> linear_modules(model_weights& w, const model_config& c) {
    std::vector<linear_module> out;
    auto one = [&](std::string path, matrix& m) { out.push_back({std::move(path), {&m}}); };
    auto stacked = [&](std::string path, std::vector<matrix>& ms) {
        linear_module lm{std::move(path), {}};
        for (matrix& m : ms) lm.parts.push_back(&m);
        out.push_back(std::move(lm));
    };
    const std::string P = "language_model.model.";
    one(P + "embed_tokens", w.embed);
    if (!c.tie_embeddings) one("language_model.lm_head", w.lm_head);
    for (size_t i = 0; i < w.layers.size(); i++) {
        layer_weights& l = w.layers[i];
        const std::string p = P + "layers." + std::to_string(i) + ".";
        if (l.kind == layer_kind::full_attention) {
            one(p + "self_attn.q_proj", l.attn.q_proj);
            one(p + "self_attn.k_proj", l.attn.k_proj);
            one(p + "self_attn.v_proj", l.attn.v_proj);
            one(p + "self_attn.o_proj", l.attn.o_proj);
        } else {
            one(p + "linear_attn.in_proj_qkv", l.gdn.in_qkv);
            one(p + "linear_attn.in_proj_z", l.gdn.in_z);
            one(p + "linear_attn.in_proj_b", l.gdn.in_b);
            one(p + "linear_attn.in_proj_a", l.gdn.in_a);
            one(p + "linear_attn.out_proj", l.gdn.out_proj);
        }
        one(p + "mlp.gate", l.moe.router);
        one(p + "mlp.shared_expert_gate", l.moe.shared_expert_gate);
        one(p + "mlp.shared_expert.gate_proj", l.moe.shared_gate);
        one(p + "mlp.shared_expert.up_proj", l.moe.shared_up);
        one(p + "mlp.shared_expert.down_proj", l.moe.shared_down);
        stacked(p + "mlp.switch_mlp.gate_proj", l.moe.gate);
        stacked(p + "mlp.switch_mlp.up_proj", l.moe.up);
        stacked(p + "mlp.switch_mlp.down_proj", l.moe.down);
    }
    return out;
}

namespace {

// True when [p, p+n) lies inside one tensor of the checkpoint's read-only file mappings.
bool in_checkpoint(const checkpoint* ck, const uint8_t* p, size_t n) {
    if (!ck) return false;
    for (const st_tensor* t : ck->tensors())
        if (p >= t->data && p + n <= t->data + t->nbytes()) return true;
    return false;
}

// Drops the process's mapping of a consumed range of a read-only file mapping (whole pages inside it are simply
// re-read from the page cache if touched again), so that reading a 67 GB checkpoint does not grow the resident
// set to 67 GB. note: never call this on anonymous memory, where MADV_DONTNEED zeroes the pages.
void release_pages(const uint8_t* p, size_t n) {
    static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + page - 1) / page * page, b = ((uintptr_t)p + n) / page * page;
    if (b > a) madvise((void*)a, b - a, MADV_DONTNEED);
}

// Rows converted to fp32 per block: bounds the scratch (16 MB at 2048 columns) while giving every thread
// plenty of rows.
constexpr int64_t BLOCK_ROWS = 2048;

}  // namespace

void quantize_matrices(const std::vector<const matrix*>& parts, int bits, int group, quant_method method,
                       quantized_rows* out, const checkpoint* release_from,
                       const std::vector<const float*>& col_weights) {
    TANSY_CHECK(col_weights.empty() || col_weights.size() == parts.size(), "%zu weight vectors for %zu parts",
                col_weights.size(), parts.size());
    TANSY_CHECK(!parts.empty(), "no matrices");
    const int64_t cols = parts[0]->cols;
    int64_t rows = 0;
    for (const matrix* p : parts) {
        TANSY_CHECK(p->fmt == wfmt::dense && p->cols == cols, "%s: dense matrices of %lld columns expected",
                    p->name.c_str(), (long long)cols);
        rows += p->rows;
    }
    const int64_t words = cols * bits / 32, G = cols / group;
    out->packed.resize((size_t)(rows * words));
    out->scales.resize((size_t)(rows * G));
    out->biases.resize((size_t)(rows * G));
    std::vector<float> w((size_t)(std::min<int64_t>(BLOCK_ROWS, rows) * cols));
    int64_t r_out = 0;
    for (size_t k = 0; k < parts.size(); k++) {
        const matrix* p = parts[k];
        const float* h = col_weights.empty() ? nullptr : col_weights[k];
        const bool release = in_checkpoint(release_from, p->w, (size_t)p->rows * p->row_bytes());
        for (int64_t r0 = 0; r0 < p->rows; r0 += BLOCK_ROWS) {
            const int64_t n = std::min(BLOCK_ROWS, p->rows - r0);
            bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (n * cols > (1 << 16))
            for (int64_t r = 0; r < n; r++) {
                float* row = &w[(size_t)(r * cols)];
                p->row_f32(r0 + r, row);
                for (int64_t c = 0; c < cols; c++) finite = finite && std::isfinite(row[c]);
            }
            if (!finite) fail("%s: non-finite weights in rows %lld..%lld; cannot quantise", p->name.c_str(),
                              (long long)r0, (long long)(r0 + n - 1));
            quantize_rows_into(w.data(), n, cols, bits, group, method, &out->packed[(size_t)(r_out * words)],
                               &out->scales[(size_t)(r_out * G)], &out->biases[(size_t)(r_out * G)], h);
            if (release) release_pages(p->w + (size_t)r0 * p->row_bytes(), (size_t)n * p->row_bytes());
            r_out += n;
        }
    }
}

quantize_report quantize_model(model& m, const quant_policy& policy) {
    const auto t0 = std::chrono::steady_clock::now();
    quantize_report rep;
    const bool tied = m.w.lm_head.w == m.w.embed.w;
    for (linear_module& lm : linear_modules(m.w, m.cfg)) {
        const int bits = policy.bits_for(lm.path), group = policy.group_for(lm.path);
        for (matrix* x : lm.parts) {
            if (x->fmt != wfmt::dense || x->cols % group != 0) continue;  // as convert: left dense
            auto q = std::make_shared<quantized_rows>();
            rep.bytes_before += x->bytes();
            std::vector<const float*> h;
            if (policy.imatrix) {
                const size_t k = (size_t)(std::find(lm.parts.begin(), lm.parts.end(), x) - lm.parts.begin());
                std::vector<const float*> all = policy.imatrix->for_module(lm.path, lm.parts.size(), x->cols);
                if (!all.empty()) h = {all[k]};
            }
            quantize_matrices({x}, bits, group, policy.method, q.get(), m.ckpt.get(), h);
            x->fmt = wfmt::affine;
            x->type = dtype::bf16;
            x->bits = bits;
            x->group = group;
            x->w = (const uint8_t*)q->packed.data();
            x->scales = (const uint8_t*)q->scales.data();
            x->biases = (const uint8_t*)q->biases.data();
            rep.bytes_after += x->bytes();
            rep.matrices++;
            rep.params += x->rows * x->cols;
            m.owned.push_back(std::move(q));
        }
    }
    if (tied) m.w.lm_head = m.w.embed;
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TANSY_DEBUG("%s: quantised %lld matrices (%lld params) at load with %s in %.2f s: %.1f MB -> %.1f MB",
                m.dir.c_str(), (long long)rep.matrices, (long long)rep.params, quant_method_name(policy.method),
                rep.seconds, rep.bytes_before / 1e6, rep.bytes_after / 1e6);
    return rep;
}

quantize_report prepare_weights(model& m, const std::string& weights, const std::string& backend) {
    if (weights == "auto" || weights.empty()) {
        // The GPU's kernels are built for 4-bit weights (decode reads every weight every token: 4-bit moves a
        // quarter of bf16's bytes), so an unquantised checkpoint is quantised at load there, with tansy convert's
        // quantiser and policy; the CPU reference keeps the checkpoint's format.
        if (backend != "cuda" || m.synthetic) return {};
        const quant_policy policy;
        bool dense = false, quantised = false;  // an already-quantised checkpoint keeps its choices (e.g. a bf16 gate)
        for (const linear_module& lm : linear_modules(m.w, m.cfg)) {
            dense |= lm.parts[0]->fmt == wfmt::dense && lm.parts[0]->cols % policy.group_for(lm.path) == 0;
            quantised |= lm.parts[0]->fmt == wfmt::affine;
        }
        if (!dense || quantised) return {};
        TANSY_WARN("quantising the bf16 checkpoint to 4 bits for the GPU (--weights bf16 keeps bf16; `tansy convert` "
                 "once saves doing this at every load)");
        quantize_report r = quantize_model(m, policy);
        TANSY_INFO("quantised %lld matrices (%.1f -> %.1f MB) in %.1f s", (long long)r.matrices, r.bytes_before / 1e6,
                 r.bytes_after / 1e6, r.seconds);
        return r;
    }
    if (weights == "checkpoint") return {};
    if (weights == "q4") return quantize_model(m, quant_policy{});
    if (weights == "bf16") {
        for (const linear_module& lm : linear_modules(m.w, m.cfg))
            if (lm.parts[0]->fmt == wfmt::affine)
                fail("%s holds %d-bit weights ('%s'); --weights bf16 needs an unquantised checkpoint", m.dir.c_str(),
                     lm.parts[0]->bits, lm.path.c_str());
        return {};
    }
    fail("unknown weight format '%s' (auto, checkpoint, q4 or bf16)", weights.c_str());
}

}  // namespace tansy
