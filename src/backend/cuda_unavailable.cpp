// Linked when tansy is built without nvcc: the cuda backend reports why it is missing.
#include "backend/backend.h"

namespace tansy {

std::unique_ptr<backend> make_cuda_backend(const model_config&, const backend_options&, std::string* why) {
    if (why) *why = "this tansy was built without CUDA (nvcc was not found at configure time)";
    return nullptr;
}

}  // namespace tansy
