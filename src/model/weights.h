// The one internal weight representation every checkpoint layout is mapped to (src/loader/load_model.cpp).
// Matrices are non-owning views into the mmapped checkpoint (zero copy) or into model::owned (quantised at
// load); small vectors (norms, gates, conv) are converted to fp32 at load, already in the form the math
// applies (zero-centred norms as 1+w).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"

namespace tansy {

class checkpoint;

enum class wfmt : uint8_t {
    dense,   // [rows, cols] of `type` (f32, f16 or bf16)
    affine,  // MLX affine: u32 [rows, cols*bits/32], LSB-first; scales/biases `type` [rows, cols/group]
};

// A weight matrix W [rows, cols] applied as y = W x (nn.Linear [out, in] convention).
struct matrix {
    wfmt fmt = wfmt::dense;
    dtype type = dtype::bf16;  // dense: element type; affine: type of scales and biases
    int64_t rows = 0, cols = 0;
    int bits = 0, group = 0;  // affine only
    const uint8_t* w = nullptr;
    const uint8_t* scales = nullptr;  // affine only
    const uint8_t* biases = nullptr;  // affine only
    std::string name;                 // checkpoint module, for messages

    bool empty() const { return w == nullptr; }
    size_t row_bytes() const;      // bytes of `w` per row
    size_t group_bytes() const;    // bytes of scales (or biases) per row
    size_t bytes() const;          // all bytes this view covers (weights + scales + biases)
    matrix rows_view(int64_t r0, int64_t n) const;  // rows [r0, r0+n)
    void row_f32(int64_t r, float* out) const;      // dequantise/widen row r into out[cols]
    float at(int64_t r, int64_t c) const;           // one element (slow; tests)
};

// Shapes use the symbols of MODEL.md §1.3: D hidden, Hq/Hkv/dh attention heads, Hk/Hv/dk/dv DeltaNet heads,
// C = 2*Hk*dk + Hv*dv conv channels, E experts, F expert width, Fs shared width.
struct attn_weights {
    matrix q_proj;                     // (Hq * 2*dh, D): per head [query dh | output gate dh]
    matrix k_proj, v_proj;             // (Hkv * dh, D)
    matrix o_proj;                     // (D, Hq * dh)
    std::vector<float> q_norm, k_norm;  // (dh) applied multiplier (1+w)
};

struct gdn_weights {
    matrix in_qkv;               // (C, D): [q Hk*dk | k Hk*dk | v Hv*dv]
    matrix in_z;                 // (Hv*dv, D)
    matrix in_b, in_a;           // (Hv, D)
    matrix out_proj;             // (D, Hv*dv)
    std::vector<float> conv;     // (C, K) depthwise causal kernel, tap K-1 multiplies the current token
    std::vector<float> dt_bias;  // (Hv)
    std::vector<float> A_log;    // (Hv)
    std::vector<float> norm;     // (dv) gated RMSNorm weight, plain (not 1+w)
};

struct moe_weights {
    matrix router;                       // (E, D)
    std::vector<matrix> gate, up;        // E x (F, D)
    std::vector<matrix> down;            // E x (D, F)
    matrix shared_gate, shared_up;       // (Fs, D)
    matrix shared_down;                  // (D, Fs)
    matrix shared_expert_gate;           // (1, D)
};

struct layer_weights {
    layer_kind kind = layer_kind::linear_attention;
    std::vector<float> input_norm, post_norm;  // (D) applied multiplier (1+w)
    attn_weights attn;                         // full_attention layers
    gdn_weights gdn;                           // linear_attention layers
    moe_weights moe;
};

enum class checkpoint_layout : uint8_t { hf_text, hf_release, mlx };
const char* layout_name(checkpoint_layout l);

struct model_weights {
    checkpoint_layout layout = checkpoint_layout::hf_text;
    matrix embed;                   // (V, D)
    matrix lm_head;                 // (V, D)
    std::vector<float> final_norm;  // (D) applied multiplier (1+w)
    std::vector<layer_weights> layers;
};

// A loaded model: the config, the mapped checkpoint the views point into, and the weights.
struct model {
    std::string dir;
    model_config cfg;
    std::shared_ptr<const checkpoint> ckpt;
    model_weights w;
    // Memory that matrix views point into besides the checkpoint: weights quantised at load
    // (src/quant/quantize_model.h). Kept alive, and never moved, for the model's lifetime.
    std::vector<std::shared_ptr<const void>> owned;
    // Synthetic model whose matrices have no host data (src/model/synthetic.h): only a backend that generates
    // weights itself (cuda) can bind it.
    bool synthetic = false;
};

}  // namespace tansy
