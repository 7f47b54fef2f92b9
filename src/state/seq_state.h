// Per-sequence state of the hybrid model: a KV cache for each full-attention layer, and for each Gated
// DeltaNet layer the conv tail (last K-1 pre-conv inputs) and the fp32 recurrent state S. One object owns all
// of it (llama.cpp's memory-hybrid analogue); it can be cloned for snapshots (speculative decoding, prefix
// caching) and is freed with the object. Backends provide the storage.
#pragma once
#include <cstdint>
#include <memory>

namespace tansy {

class seq_state {
  public:
    virtual ~seq_state() = default;
    int64_t n_past() const { return n_past_; }   // tokens already processed (= next position)
    void set_n_past(int64_t n) { n_past_ = n; }
    int64_t capacity() const { return capacity_; }  // max tokens the KV cache can hold
    virtual std::unique_ptr<seq_state> clone() const = 0;
    virtual size_t bytes() const = 0;  // memory held
    virtual void reset() = 0;          // back to an empty sequence, keeping the memory

  protected:
    int64_t n_past_ = 0;
    int64_t capacity_ = 0;
};

}  // namespace tansy
