// tansy convert: bf16 checkpoint -> MLX 4-bit affine checkpoint.
#include <sys/resource.h>

#include <cstdio>

#include "cli/commands.h"
#include "core/check.h"
#include "quant/convert.h"

namespace tansy {

int cmd_convert(int argc, char** argv) {
    arg_parser p("convert", "--model BF16_DIR --out DIR [options]",
                 "Quantises a bf16 checkpoint (HF text-only or release layout) into the MLX affine layout\n"
                 "(language_model.model.*, switch_mlp experts, U32-packed weights with bf16 scales/biases per group),\n"
                 "loadable by tansy and MLX tools; every module quantised at other than --bits is listed in\n"
                 "config.json's quantization block. Tokenizer, chat template and generation config are copied.\n"
                 "Works tensor by tensor: memory stays far below the checkpoint's size.\n\n"
                 "Methods: mse (default) searches each group's scale and bias for the least squared error after\n"
                 "bf16 rounding, and keeps at 8 bits the modules where that pays (routers, shared-expert gate,\n"
                 "embed_tokens, attention v_proj, DeltaNet in_proj_a/b, layer 0's DeltaNet; docs/QUALITY.md).\n"
                 "minmax is MLX's own rule and MLX's bit allocation (routers and shared-expert gate at 8 bits): it\n"
                 "reproduces what mlx-lm writes.");
    p.option("--model", "DIR", "bf16 source checkpoint")
        .option("--out", "DIR", "output directory (created; must not hold a checkpoint)")
        .option("--bits", "N", "bits per weight: 4 (default), 2 or 8")
        .option("--group-size", "N", "columns per scale/bias group (default 64)")
        .option("--method", "NAME", "quantiser: mse (default) or minmax (MLX's rule and bit allocation)")
        .option("--bits-for", "PATTERN=N",
                "bits for the modules whose MLX path contains PATTERN as whole components, e.g. lm_head=8, "
                "v_proj=4 or layers.3.self_attn=8 (repeatable; applied after the method's defaults)",
                "", true)
        .option("--group-for", "PATTERN=N",
                "columns per scale/bias group for the modules whose MLX path contains PATTERN as whole components, "
                "e.g. layers.3.self_attn=32 (repeatable; applied after the defaults)",
                "", true)
        .option("--imatrix", "FILE",
                "per-column input importances (safetensors, F32 [cols] or [experts, cols] per MLX module path) "
                "weighting the mse method's error")
        .option("--shard-size", "GB", "maximum output file size in GB (default 5)")
        .option("--quiet", "", "no progress bar", "-q");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--model")) fail("convert: --model is required");
    if (!p.has("--out")) fail("convert: --out is required");
    convert_options o;
    o.src = model_path_arg(p);
    o.out = p.str("--out");
    const quant_method method = parse_quant_method(p.str("--method", quant_method_name(default_quant_method)));
    if (method == quant_method::minmax) o.policy = quant_policy::mlx();
    o.policy.method = method;
    o.policy.bits = (int)p.integer("--bits", 4);
    o.policy.group = (int)p.integer("--group-size", 64);
    for (const std::string& s : p.all("--bits-for")) o.policy.overrides.push_back(quant_policy::parse_override(s));
    for (const std::string& s : p.all("--group-for"))
        o.policy.group_overrides.push_back(quant_policy::parse_group_override(s));
    if (p.has("--imatrix")) o.policy.imatrix = importance::load(p.str("--imatrix"));
    const double gb = p.number("--shard-size", 5.0);
    if (!(gb > 0)) fail("convert: --shard-size must be positive");
    o.shard_bytes = (uint64_t)(gb * 1e9);
    o.progress = !p.has("--quiet");
    convert_report r = convert_to_mlx(o);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr,
            "tansy: wrote %lld tensors in %lld file(s), %.1f MB -> %.1f MB, %s, %.1f s (%.1f M weights/s), "
            "peak RSS %.0f MB (%s)\n",
            (long long)r.tensors, (long long)r.files, r.bytes_in / 1e6, r.bytes_out / 1e6,
            quant_method_name(o.policy.method), r.seconds, r.seconds > 0 ? r.params / r.seconds / 1e6 : 0.0,
            ru.ru_maxrss / 1024.0, o.out.c_str());
    return 0;
}

}  // namespace tansy
