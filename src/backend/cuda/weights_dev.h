// The CUDA backend's copy of the model weights, found again from the host-side views that the forward pass
// hands to the ops (matrices by the address of their `matrix`, vectors by their data pointer).
// Affine 4/8-bit matrices keep the checkpoint's packed words; their bf16 scales and biases are interleaved into
// one 32-bit word per group. Dense matrices become bf16. Matrices that share an input are concatenated
// (q/k/v; qkv/z/b/a; router + shared-expert gate) and experts are stacked, so each is one launch.
// A matrix whose host data pointer is null gets seeded random weights generated on the device (the synthetic
// full-size model of `tansy bench`).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/cuda/device.h"
#include "backend/cuda/moe.cuh"
#include "core/tensor.h"
#include "model/weights.h"

namespace tansy::cuda {

class device_weights {
  public:
    struct concat {
        struct part {
            dmat W;
            std::vector<int> members;  // indices into the original list, in row order
        };
        std::vector<part> parts;     // one part when every member has the same format (the usual case)
        std::vector<int64_t> row0;   // first row of member i within its part
    };
    struct moe_dev {
        dmoe m;
        concat router;                     // members: 0 = router (E rows), 1 = shared_expert_gate (1 row)
        const float* router_bias = nullptr;  // synthetic routing skew, [E]
    };

    // seed: for synthetic (null-data) matrices; router_skew > 0 biases synthetic routing Zipf-like.
    void bind(const model& m, cudaStream_t stream, uint64_t seed = 1, float router_skew = 0.0f);

    const dmat& mat(const matrix& m) const;
    const float* vec(vec_view v) const;
    bool grouped(const matrix& W) const { return cats_.count(&W) != 0; }  // the first of a bound group
    const concat& cat(const std::vector<const matrix*>& Ws) const;
    const moe_dev& moe(const moe_weights& w) const;
    size_t bytes() const { return bytes_; }

  private:
    dmat upload(const std::vector<const matrix*>& parts);  // stacked rows
    concat upload_concat(const std::vector<const matrix*>& Ws);
    const float* upload_vec(const std::vector<float>& v);

    std::vector<device_buffer> store_;
    std::unordered_map<const void*, dmat> mats_;
    std::unordered_map<const void*, const float*> vecs_;
    std::unordered_map<const void*, concat> cats_;
    std::unordered_map<const void*, moe_dev> moes_;
    size_t bytes_ = 0;
    uint64_t seed_ = 1, synth_counter_ = 0;
    float router_skew_ = 0.0f;
    cudaStream_t stream_ = nullptr;
};

}  // namespace tansy::cuda
