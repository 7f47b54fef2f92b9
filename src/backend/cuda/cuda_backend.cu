// The CUDA backend factory. The decode and prefill ops arrive with the CUDA issues (#4, #5); until then the
// backend reports itself unavailable, and the kernels that exist are tested op by op (tests/cuda).
#include "backend/backend.h"
#include "backend/cuda/device.h"

namespace tansy {

std::unique_ptr<backend> make_cuda_backend(const model_config&, std::string* why) {
    std::string reason;
    if (cuda::device_count(&reason) == 0) {
        if (why) *why = reason;
        return nullptr;
    }
    if (why) *why = "the CUDA forward pass is not implemented yet (only standalone kernels are)";
    return nullptr;
}

}  // namespace tansy
