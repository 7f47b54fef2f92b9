// MoE routing as its own launch: per token, one warp takes the top-k of the router's logits (plus bias, topk.cuh),
// softmax-normalised weights over the chosen experts and the sigmoid of the shared-expert gate logit. Used by the
// prompt path (grouped GEMMs) and the general decode form; the decode families fuse the same top-k into their
// gate/up kernels (or take it from the router tap) instead of paying a launch.
#include "backend/cuda/moe_family.cuh"

namespace tansy::cuda::moe_impl {

namespace {

__global__ void topk_kernel(const moe_routing r, int T, int E, int k) {
    pdl_trigger();
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= T) return;  // whole warp
    int chosen[k_max_topk];
    float wt[k_max_topk];
    warp_topk(r.logits + t * r.ld, r.bias, E, k, chosen, wt);
    if (threadIdx.x % 32 == 0) store_route(r, t, E, k, chosen, wt);
}

}  // namespace

}  // namespace tansy::cuda::moe_impl

namespace tansy::cuda {

void moe_topk(const moe_routing& r, int T, int E, int k, cudaStream_t stream) {
    TANSY_CHECK(k >= 1 && k <= k_max_topk && k <= E && E <= k_max_experts, "moe_topk: k=%d E=%d", k, E);
    if (T == 0) return;
    constexpr int warps = 4;
    moe_impl::topk_kernel<<<(T + warps - 1) / warps, warps * 32, 0, stream>>>(r, T, E, k);
    CUDA_CHECK_LAUNCH();
}

}  // namespace tansy::cuda
