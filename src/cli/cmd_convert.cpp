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
                 "(language_model.model.*, switch_mlp experts, U32-packed weights with bf16 scales/biases per group;\n"
                 "routers and the shared-expert gate at 8 bits), loadable by tansy and MLX tools. Tokenizer, chat\n"
                 "template and generation config are copied. Works tensor by tensor: memory stays far below the\n"
                 "checkpoint's size.");
    p.option("--model", "DIR", "bf16 source checkpoint")
        .option("--out", "DIR", "output directory (created; must not hold a checkpoint)")
        .option("--bits", "N", "bits per weight: 4 (default), 2 or 8")
        .option("--group-size", "N", "columns per scale/bias group (default 64)")
        .option("--method", "NAME", "quantiser: minmax (MLX's rule, default)")
        .option("--shard-size", "GB", "maximum output file size in GB (default 5)")
        .option("--quiet", "", "no progress bar", "-q");
    if (!p.parse(argc, argv)) return 0;
    if (!p.has("--model")) fail("convert: --model is required");
    if (!p.has("--out")) fail("convert: --out is required");
    convert_options o;
    o.src = p.str("--model");
    o.out = p.str("--out");
    o.bits = (int)p.integer("--bits", 4);
    o.group = (int)p.integer("--group-size", 64);
    o.method = parse_quant_method(p.str("--method", "minmax"));
    const double gb = p.number("--shard-size", 5.0);
    if (!(gb > 0)) fail("convert: --shard-size must be positive");
    o.shard_bytes = (uint64_t)(gb * 1e9);
    o.progress = !p.has("--quiet");
    convert_report r = convert_to_mlx(o);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr, "tansy: wrote %lld tensors in %lld file(s), %.1f MB -> %.1f MB, %.1f s, peak RSS %.0f MB (%s)\n",
            (long long)r.tensors, (long long)r.files, r.bytes_in / 1e6, r.bytes_out / 1e6, r.seconds,
            ru.ru_maxrss / 1024.0, o.out.c_str());
    return 0;
}

}  // namespace tansy
