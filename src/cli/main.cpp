// tansy: one binary, subcommands.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "cli/commands.h"
#include "core/check.h"
#ifdef TANSY_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

#ifndef TANSY_VERSION
#define TANSY_VERSION "unknown"
#endif
#ifndef TANSY_GIT_COMMIT
#define TANSY_GIT_COMMIT "unknown"
#endif

using namespace tansy;

namespace {

struct command {
    const char* name;
    int (*fn)(int, char**);
    const char* help;
};

const command k_commands[] = {
    {"serve", cmd_serve, "OpenAI-compatible HTTP server (chat/completions, streaming, tools, continuous batching)"},
    {"run", cmd_run, "chat with the model from the command line (one prompt or interactive), streamed"},
    {"generate", cmd_generate, "prefill token ids, then decode N tokens (greedy or sampled)"},
    {"logits", cmd_logits, "write the full-prompt logits of token ids to a safetensors file"},
    {"eval", cmd_eval, "teacher-forced perplexity, top-1 agreement and KL against reference logits"},
    {"convert", cmd_convert, "quantise a bf16 checkpoint to the MLX 4-bit layout"},
    {"tokenize", cmd_tokenize, "text -> token ids, or token ids -> text (--decode)"},
    {"render", cmd_render, "print the prompt an OpenAI-style chat request renders to (Qwen3.6 chat template)"},
    {"bench", cmd_bench, "decode throughput vs the memory roofline (real or synthetic full-size model); --serve: served speed"},
    {"info", cmd_info, "describe a checkpoint: layout, configuration, sizes; --backend: its kernel plan"},
};

void usage(FILE* f) {
    fprintf(f,
            "tansy: a single-process inference engine for Qwen3.6-35B-A3B (qwen3_5_moe)\n\n"
            "usage: tansy COMMAND [options]   (tansy COMMAND --help for its options)\n\ncommands:\n");
    for (const command& c : k_commands) fprintf(f, "  %-10s %s\n", c.name, c.help);
    fprintf(f, "  %-10s %s\n", "version", "version, git commit and available backends (also --version)");
    fprintf(f, "\nWithout --model, commands use $TANSY_MODEL when set, else the bundled tiny model (%s).\n",
            bundled_model_dir().c_str());
}

// tansy --version / tansy version: what was built and what it can run on.
int version(int, char**) {
    printf("tansy %s (commit %s)\n", TANSY_VERSION, TANSY_GIT_COMMIT);
    printf("backends: cpu");
#ifdef TANSY_HAVE_CUDA
    std::string why;
    const int n = cuda::device_count(&why);
    printf(", cuda (compiled in)\n");
    if (n == 0) printf("cuda devices: none usable (%s)\n", why.c_str());
    for (int d = 0; d < n; d++) {
        const int cc = cuda::device_compute_capability(d);
        printf("cuda device %d: %s (sm_%d)\n", d, cuda::device_name(d).c_str(), cc);
    }
#else
    printf("; cuda not compiled in (no nvcc at configure time, or TANSY_CUDA=OFF)\n");
#endif
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char* name = argv[1];
    if (!strcmp(name, "--help") || !strcmp(name, "-h") || !strcmp(name, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(name, "--version") || !strcmp(name, "version")) return version(argc - 2, argv + 2);
    for (const command& c : k_commands) {
        if (strcmp(c.name, name) != 0) continue;
        try {
            return c.fn(argc - 2, argv + 2);
        } catch (const tansy::error& e) {
            fprintf(stderr, "tansy: error: %s\n", e.what());
            return 1;
        } catch (const std::bad_alloc&) {
            fprintf(stderr, "tansy: error: out of memory\n");
            return 1;
        } catch (const std::exception& e) {
            fprintf(stderr, "tansy: error: %s\n", e.what());
            return 1;
        }
    }
    fprintf(stderr, "tansy: unknown command '%s' (see 'tansy --help')\n", name);
    return 2;
}
