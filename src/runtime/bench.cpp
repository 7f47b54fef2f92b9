#include "runtime/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/check.h"
#include "runtime/decode_step.h"

namespace tansy {

double decode_bytes_per_step(const model& m, int64_t B, int64_t ctx, bool kv_fp8, bool state_bf16) {
    const model_config& c = m.cfg;
    const model_weights& w = m.w;
    double bytes = (double)B * (double)w.embed.bytes() / (double)w.embed.rows + (double)w.lm_head.bytes();
    // expected distinct experts among B tokens choosing k of E each: E (1 - (1 - k/E)^B)  (MODEL.md §9.2)
    const double E = (double)c.n_experts, distinct = E * (1.0 - std::pow(1.0 - (double)c.top_k / E, (double)B));
    for (const layer_weights& l : w.layers) {
        if (l.kind == layer_kind::full_attention)
            bytes += (double)(l.attn.q_proj.bytes() + l.attn.k_proj.bytes() + l.attn.v_proj.bytes() + l.attn.o_proj.bytes());
        else
            bytes += (double)(l.gdn.in_qkv.bytes() + l.gdn.in_z.bytes() + l.gdn.in_b.bytes() + l.gdn.in_a.bytes() +
                              l.gdn.out_proj.bytes());
        const moe_weights& mw = l.moe;
        bytes += (double)(mw.router.bytes() + mw.shared_expert_gate.bytes() + mw.shared_gate.bytes() +
                          mw.shared_up.bytes() + mw.shared_down.bytes());
        bytes += distinct * (double)(mw.gate[0].bytes() + mw.up[0].bytes() + mw.down[0].bytes());
    }
    // per sequence: KV cache read (K and V of every attention layer: bf16, or E4M3 plus an fp32 scale per KV
    // head) and DeltaNet state read + write (fp32, or bf16), its conv window likewise (fp32)
    const double kv_row = kv_fp8 ? (double)c.kv_dim() + 4.0 * (double)c.n_kv_heads : 2.0 * (double)c.kv_dim();
    const double kv = (double)c.n_full_attention() * 2.0 * kv_row * (double)ctx;
    const double n_gdn = (double)(c.n_layers() - c.n_full_attention());
    const double state = n_gdn * 2.0 * (state_bf16 ? 2.0 : 4.0) * (double)(c.lin_v_heads * c.lin_k_dim * c.lin_v_dim) +
                         n_gdn * 2.0 * 4.0 * (double)((c.conv_kernel - 1) * c.lin_conv_dim());
    return bytes + (double)B * (kv + state);
}

bench_point bench_decode(engine& eng, int64_t B, int64_t ctx, const bench_options& o) {
    using clock = std::chrono::steady_clock;
    backend& be = eng.be();
    const int64_t total_steps = (int64_t)o.warmup + 2 + (int64_t)o.runs * o.steps;
    std::vector<std::unique_ptr<seq_state>> states;
    // the step the scheduler and generate run (runtime/decode_step.h), greedy unless o.sampling says otherwise:
    // each step one graph replay, queued back to back as a server queues steps ahead of its host work
    decode_step step(eng, (int)B);
    std::vector<decode_step::row> rows;
    for (int64_t b = 0; b < B; b++) {
        states.push_back(eng.new_sequence(ctx + total_steps + 1));
        be.pretend_context(*states.back(), ctx);
        sampling_params sp = o.sampling;
        sp.seed = o.sampling.seed + (uint64_t)b;
        step.bind((int)b, sp);
        step.set_token((int)b, (int32_t)((b * 7919 + 17) % eng.n_valid_tokens()));
        rows.push_back({(int)b, states.back().get()});
    }
    step.wait(step.launch(rows));  // settles buffers and the batch layout
    step.wait(step.launch(rows));  // captures the step's graph
    bench_point r;
    r.batch = B, r.context = ctx;
    r.graphs = be.supports_graphs();
    uint64_t last = 0;
    for (int i = 0; i < o.warmup; i++) last = step.launch(rows);
    if (last) step.wait(last);
    std::vector<double> per_step;
    for (int run = 0; run < o.runs; run++) {
        auto t0 = clock::now();
        for (int i = 0; i < o.steps; i++) last = step.launch(rows);
        step.wait(last);
        per_step.push_back(std::chrono::duration<double>(clock::now() - t0).count() / o.steps);
    }
    std::sort(per_step.begin(), per_step.end());
    r.step_s = per_step[per_step.size() / 2];
    r.tok_s = (double)B / r.step_s;
    r.bytes_per_step = decode_bytes_per_step(eng.mdl(), B, ctx + (int64_t)o.warmup + o.runs * o.steps / 2, o.kv_fp8,
                                             o.state_bf16);
    r.gbps = r.bytes_per_step / r.step_s / 1e9;
    r.roofline_pct = 100.0 * r.gbps / o.peak_gbps;
    r.peak_gib = (double)be.device_memory_used() / (double)(1ull << 30);
    return r;
}

prefill_flop_count prefill_flop_parts(const model& m, int64_t n, int64_t n_past) {
    const model_config& c = m.cfg;
    const model_weights& w = m.w;
    auto params = [](std::initializer_list<const matrix*> ms) {
        double s = 0;
        for (const matrix* x : ms) s += (double)x->rows * (double)x->cols;
        return s;
    };
    prefill_flop_count f;
    if (n <= 0) return f;
    double per_token = 0;  // matrix weights one token multiplies by (lm_head apart)
    for (const layer_weights& l : w.layers) {
        if (l.kind == layer_kind::full_attention)
            per_token += params({&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj, &l.attn.o_proj});
        else
            per_token += params({&l.gdn.in_qkv, &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a, &l.gdn.out_proj});
        const moe_weights& mw = l.moe;
        per_token += params({&mw.router, &mw.shared_expert_gate, &mw.shared_gate, &mw.shared_up, &mw.shared_down});
        if (!mw.gate.empty()) per_token += (double)c.top_k * params({&mw.gate[0], &mw.up[0], &mw.down[0]});
    }
    const double T = (double)n;
    f.matmul = 2.0 * per_token * T;
    f.lm_head = 2.0 * (double)w.lm_head.rows * (double)w.lm_head.cols;
    // causal (query, key) pairs: sum over p in [n_past, n_past + n) of (p + 1)
    const double pairs = T * (double)n_past + T * (T + 1.0) / 2.0;
    f.attention = (double)c.n_full_attention() * 2.0 * 2.0 * (double)(c.n_q_heads * c.head_dim) * pairs;
    const double n_gdn = (double)(c.n_layers() - c.n_full_attention());
    const double recurrence = 7.0 * (double)c.lin_v_heads * (double)c.lin_k_dim * (double)c.lin_v_dim;
    const double conv = 2.0 * (double)c.conv_kernel * (double)c.lin_conv_dim();
    f.deltanet = n_gdn * (recurrence + conv) * T;
    return f;
}

double prefill_flops(const model& m, int64_t n_prompt, int64_t n_past) {
    return prefill_flop_parts(m, n_prompt, n_past).total();
}

int prefill_runs(int64_t n, const bench_options& o) {
    const int64_t fit = n > 0 ? o.prefill_run_tokens / n : o.runs;
    return (int)std::max<int64_t>(1, std::min<int64_t>(o.runs, fit));
}

prefill_point bench_prefill(engine& eng, int64_t n, const bench_options& o) {
    using clock = std::chrono::steady_clock;
    TANSY_CHECK(n >= 1, "bench_prefill: prompt of %lld tokens", (long long)n);
    backend& be = eng.be();
    forward_pass& fw = eng.fwd();
    prefill_point r;
    r.prompt = n, r.chunk = fw.prefill_chunk, r.runs = prefill_runs(n, o);
    size_t peak = be.device_memory_used();
    auto see_memory = [&] { peak = std::max(peak, be.device_memory_used()); };
    {
        std::unique_ptr<seq_state> st = eng.new_sequence(n + 1);
        buffer ids = be.alloc(n, 1, dtype::i32), tok = be.alloc(1, 1, dtype::i32);
        std::vector<int32_t> prompt((size_t)n);
        for (int64_t i = 0; i < n; i++) prompt[(size_t)i] = (int32_t)((i * 7919 + 17) % eng.n_valid_tokens());
        be.upload(ids.t(), prompt.data());
        see_memory();
        auto one = [&] {
            st->reset();
            be.synchronize();
            const auto t0 = clock::now();
            be.argmax(tok.t(), fw.prefill(ids.t(), *st, logits_rows::last), eng.n_valid_tokens());
            int32_t id = 0;
            be.download(&id, tok.t());
            be.synchronize();
            const double s = std::chrono::duration<double>(clock::now() - t0).count();
            see_memory();
            return s;
        };
        one();  // warm-up: settles the workspace of a chunk and the backend's caches
        std::vector<double> ttft;
        for (int i = 0; i < r.runs; i++) ttft.push_back(one());
        std::sort(ttft.begin(), ttft.end());
        const size_t h = ttft.size() / 2;
        r.ttft_s = ttft.size() % 2 ? ttft[h] : (ttft[h - 1] + ttft[h]) / 2;
    }  // the state and the prompt are freed here
    r.tok_s = (double)n / r.ttft_s;
    r.flops = prefill_flops(eng.mdl(), n);
    r.tflops = r.flops / r.ttft_s / 1e12;
    r.peak_pct = 100.0 * r.tflops / o.peak_tflops;
    r.peak_gib = (double)peak / (double)(1ull << 30);
    return r;
}

}  // namespace tansy
