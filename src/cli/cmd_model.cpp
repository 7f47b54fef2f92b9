// tansy logits | generate | info
#include <chrono>
#include <cstdio>
#include <string>

#include "backend/cuda/kernel_plan.h"
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "loader/checkpoint.h"
#include "loader/load_model.h"
#include "loader/safetensors.h"
#include "sampling/sampler.h"

namespace tansy {

using clock_type = std::chrono::steady_clock;
static double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void add_engine_options(arg_parser& p) {
    p.option("--model", "DIR|ORG/NAME[@REV]",
             "checkpoint directory (HF bf16 or MLX 4-bit), or a Hugging Face repo id found in the local hub cache "
             "(hf download ORG/NAME); default: the bundled tiny model")
        .option("--backend", "NAME", "cpu or cuda (default cpu)")
        .option("--threads", "N", "CPU threads (default: all cores)")
        .option("--weights", "W",
                "auto (default: the checkpoint's format, except that cuda quantises an unquantised checkpoint to "
                "4 bits), q4 (quantise a bf16 checkpoint at load, as tansy convert does) or bf16")
        .option("--prefill-chunk", "N", "prompt tokens per forward step (default 8192): bounds the activation memory")
        .option("--gemm", "MODE",
                "cuda prompt processing: fast (fp16 tensor-core inputs, the default) or precise (bf16 hi + lo pairs: "
                "~fp32 results, slower)")
        .option("--deltanet", "FORM",
                "DeltaNet prompt spans: auto (the chunk-parallel form, the default), chunked or recurrent (token by "
                "token)")
        .option("--kv-cache", "TYPE",
                "KV cache: bf16 (the default) or fp8 (E4M3 with a power-of-two scale per position and KV head: half "
                "the memory and decode traffic of long contexts, ~2^-4 relative rounding of K and V)")
        .option("--deltanet-state", "TYPE",
                "DeltaNet recurrent state: fp32 (the default) or bf16 (computed in fp32, stored rounded after each "
                "step: half the state's memory and decode traffic, the largest term of big decode batches; "
                "docs/QUALITY.md)")
        .option("--kernels", "KEY=VALUE,...",
                "cuda kernel families, for A/B runs (the plan's choice otherwise; tansy info --backend cuda prints "
                "it): mma=FAMILIES ('+'-joined gemv1, gemvn, gate_up, down, or all / none: decode products on tensor "
                "cores; default gemvn), int8=on|off (int8 inputs of the one-row 4-bit decode kernels; default on), "
                "wgmma=on|off (Hopper wgmma for the prompt GEMMs; default on), tma=on|off (their prompt-sized dense and routed "
                "down calls' X tiles by TMA; default on), moe_groups=N / dense_groups=N (MoE "
                "blocks / dense products of 17..N rows on the decode kernels in groups; default 96 / 0, 0: off), "
                "gemm_split=N (the most K slices of a dense GEMM whose tiles leave most SMs idle; default 16, 0: off), "
                "dense_rows=N (the most rows of a dense group, 16..32; default 32 where the kernel takes them), "
                "moe_small=N (MoE blocks of 32..N rows, or 17..N with moe_groups=0, fast mode, on the small-M grouped "
                "MoE kernels; default 256, 0: off), moe_small_gu=N / moe_small_dn=N (their items per warp, 1..8; "
                "default 1 / 2), recur=0|1 (DeltaNet decode: the state in registers or staged in shared memory; "
                "default: registers below 8 sequences)")
        .option("--verbose", "", "log loading details", "-v");
}

kernel_options kernel_options_from(const arg_parser& p) {
    kernel_options k;
    if (p.has("--kernels")) {
        const std::string why = cuda::parse_kernel_options(p.str("--kernels"), &k);
        if (!why.empty()) fail("--kernels: %s", why.c_str());
    }
    return k;
}

engine_options engine_options_from(const arg_parser& p) {
    engine_options o;
    o.model_dir = model_path_arg(p, "--model", default_model_dir());
    o.backend = p.str("--backend", "cpu");
    o.threads = (int)p.integer("--threads", 0);
    if (o.threads < 0) fail("--threads must be >= 0");
    o.weights = p.str("--weights", "auto");
    const std::string gm = p.str("--gemm", "fast");
    if (gm != "fast" && gm != "precise") fail("--gemm must be fast or precise, got '%s'", gm.c_str());
    o.backend_opt.precise_gemm = gm == "precise";
    if (p.has("--prefill-chunk")) {
        o.prefill_chunk = p.integer("--prefill-chunk", 0);
        if (o.prefill_chunk < 1) fail("--prefill-chunk must be >= 1 token");
    }
    const std::string dn = p.str("--deltanet", "auto");
    if (dn == "auto") o.gdn = gdn_mode::auto_select;
    else if (dn == "chunked") o.gdn = gdn_mode::chunked;
    else if (dn == "recurrent") o.gdn = gdn_mode::recurrent;
    else fail("--deltanet must be auto, chunked or recurrent, got '%s'", dn.c_str());
    o.backend_opt.kv_fp8 = kv_fp8_from(p.str("--kv-cache", "bf16"), "--kv-cache");
    o.backend_opt.state_bf16 = state_bf16_from(p.str("--deltanet-state", "fp32"), "--deltanet-state");
    o.backend_opt.kernels = kernel_options_from(p);
    if (p.has("--verbose")) set_log_level(log_level::debug);
    return o;
}

bool state_bf16_from(const std::string& value, const char* option) {
    if (value != "fp32" && value != "bf16") fail("%s must be fp32 or bf16, got '%s'", option, value.c_str());
    return value == "bf16";
}

bool kv_fp8_from(const std::string& value, const char* option) {
    if (value != "bf16" && value != "fp8") fail("%s must be bf16 or fp8, got '%s'", option, value.c_str());
    return value == "fp8";
}

void add_sampling_options(arg_parser& p) {
    p.option("--temperature", "T", "sample at temperature T (default 0: greedy)")
        .option("--top-k", "K", "keep the K most likely tokens")
        .option("--top-p", "P", "keep the smallest set with probability >= P")
        .option("--min-p", "P", "drop tokens below P x the top probability")
        .option("--seed", "S", "random seed (default 0)");
}

sampling_params sampling_from(const arg_parser& p) {
    sampling_params sp;
    sp.temperature = (float)p.number("--temperature", 0.0);
    sp.top_k = (int)p.integer("--top-k", 0);
    sp.top_p = (float)p.number("--top-p", 1.0);
    sp.min_p = (float)p.number("--min-p", 0.0);
    sp.seed = (uint64_t)p.integer("--seed", 0);
    return sp;
}

int cmd_logits(int argc, char** argv) {
    arg_parser p("logits", "--ids-file F --out OUT.safetensors [options]",
                 "Runs one prefill over the token ids in F and writes tensor 'logits' (F32, [n, vocab]).");
    add_engine_options(p);
    p.option("--ids-file", "F", "token ids, separated by whitespace").option("--out", "PATH", "output .safetensors file");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--ids-file")) fail("logits: --ids-file is required");
    if (!p.has("--out")) fail("logits: --out is required");
    std::vector<int32_t> ids = read_ids_file(p.str("--ids-file"));
    engine eng(engine_options_from(p));
    eng.check_ids(ids);
    auto st = eng.new_sequence((int64_t)ids.size());
    auto t0 = clock_type::now();
    std::vector<float> logits = eng.step(*st, ids, logits_rows::all);
    double dt = seconds_since(t0);
    write_safetensors(p.str("--out"), {{"logits", dtype::f32, {(int64_t)ids.size(), eng.cfg().vocab}, logits.data()}},
                      {{"format", "pt"}});
    fprintf(stderr, "tansy: %zu tokens in %.3f s (%.0f tok/s) on %s -> %s\n", ids.size(), dt, ids.size() / dt,
            eng.be().name(), p.str("--out").c_str());
    return 0;
}

int cmd_generate(int argc, char** argv) {
    arg_parser p("generate", "--ids-file F -n N [--greedy] [options]",
                 "Prefills the token ids in F, then generates N tokens through the cache (KV cache + DeltaNet\n"
                 "state), one decode step per token. Does not stop at end-of-turn tokens.");
    add_engine_options(p);
    p.option("--ids-file", "F", "prompt token ids, separated by whitespace")
        .option("-n", "N", "tokens to generate (default 16)", "--max-tokens")
        .option("--greedy", "", "pick the most likely token (the default when no temperature is given)")
        .option("--output-ids", "", "print the generated ids, space-separated, on one line (the default)")
        .option("--no-graphs", "", "run every decode step eagerly (no CUDA graph replay)");
    add_sampling_options(p);
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--ids-file")) fail("generate: --ids-file is required");
    const int64_t n = p.integer("-n", 16);
    if (n < 0) fail("generate: -n must be >= 0");
    sampling_params sp = sampling_from(p);
    if (p.has("--greedy") && sp.temperature != 0) fail("generate: --greedy contradicts --temperature");
    std::vector<int32_t> ids = read_ids_file(p.str("--ids-file"));
    engine eng(engine_options_from(p));
    eng.check_ids(ids);
    auto st = eng.new_sequence((int64_t)ids.size() + n);
    generation_request req;
    req.prompt = ids;
    req.max_tokens = n;
    req.sampling = sp;
    req.use_graphs = !p.has("--no-graphs");
    std::vector<int32_t> out;
    generation_stats gs = eng.generate(*st, req, [&](int32_t id) {
        out.push_back(id);
        return true;
    });
    for (size_t i = 0; i < out.size(); i++) printf("%s%d", i ? " " : "", out[i]);
    printf("\n");
    fprintf(stderr, "tansy: prefill %lld tokens %.3f s (%.0f tok/s), decode %lld tokens %.3f s (%.1f tok/s), %s%s\n",
            (long long)gs.prompt_tokens, gs.prefill_s, gs.prompt_tokens / gs.prefill_s,
            (long long)std::max<int64_t>(gs.generated - 1, 0), gs.decode_s,
            gs.generated > 1 ? (gs.generated - 1) / gs.decode_s : 0.0, eng.be().name(), gs.graphs ? " (graphs)" : "");
    return 0;
}

int cmd_info(int argc, char** argv) {
    arg_parser p("info", "[--model DIR] [--backend NAME [--gemm MODE] [--kernels SPEC]]",
                 "Loads a checkpoint and describes it; with --backend, also which kernels that backend runs for\n"
                 "which rows and shapes (the CUDA backend's kernel plan, as --gemm and --kernels set it).");
    p.option("--model", "DIR|ORG/NAME[@REV]",
             "checkpoint directory or Hugging Face repo id (local hub cache); default: the bundled tiny model")
        .option("--backend", "NAME", "cpu or cuda: print its kernel plan")
        .option("--gemm", "MODE", "fast (the default) or precise, as for the commands that run the model")
        .option("--kernels", "KEY=VALUE,...", "kernel families, as for the commands that run the model");
    if (!p.parse(argc, argv)) return 0;
    backend_options bo;  // checked before the model is described: an error stays one line
    const std::string gm = p.str("--gemm", "fast");
    if (gm != "fast" && gm != "precise") fail("--gemm must be fast or precise, got '%s'", gm.c_str());
    bo.precise_gemm = gm == "precise";
    bo.kernels = kernel_options_from(p);
    std::string dir = model_path_arg(p, "--model", default_model_dir());
    model m = load_model(dir);
    size_t weight_bytes = 0;
    for (const st_tensor* t : m.ckpt->tensors()) weight_bytes += t->nbytes();
    printf("model      %s\nlayout     %s (%zu file%s, %.1f MB)\nconfig     %s\n", dir.c_str(), layout_name(m.w.layout),
           m.ckpt->n_files(), m.ckpt->n_files() == 1 ? "" : "s", weight_bytes / 1e6, m.cfg.summary().c_str());
    std::string kinds;
    for (layer_kind k : m.cfg.layers) kinds += k == layer_kind::full_attention ? 'A' : 'D';
    printf("layers     %s  (D = Gated DeltaNet, A = full attention)\n", kinds.c_str());
    auto eos = load_eos_ids(dir);
    printf("eos ids   ");
    for (int32_t e : eos) printf(" %d", e);
    printf("\n");
    if (p.has("--backend")) {
        printf("kernels    ");
        const std::string name = p.str("--backend");
        if (name == "cuda") {  // no GPU is not an error here: say so
            std::string why;
            auto be = make_cuda_backend(m.cfg, bo, &why);
            printf("%s\n", be ? be->kernel_summary("           ").c_str() : ("cuda unavailable: " + why).c_str());
        } else {
            printf("%s\n", make_backend(name, m.cfg, bo)->kernel_summary("           ").c_str());
        }
    }
    return 0;
}

}  // namespace tansy
