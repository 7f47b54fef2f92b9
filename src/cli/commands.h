// CLI subcommands. Each takes the arguments after its name and returns the process exit status.
#pragma once
#include "cli/args.h"
#include "runtime/engine.h"
#include "sampling/sampler.h"

namespace tansy {

int cmd_logits(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_info(int argc, char** argv);
int cmd_convert(int argc, char** argv);
int cmd_render(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_run(int argc, char** argv);
int cmd_serve(int argc, char** argv);

// --model, --backend, --threads: shared by every command that runs the model.
void add_engine_options(arg_parser& p);
engine_options engine_options_from(const arg_parser& p);
// The value of a KV-cache option (`option`, e.g. "--kv-cache"): true for fp8, false for bf16, else a clear error.
bool kv_fp8_from(const std::string& value, const char* option);

// --temperature, --top-k, --top-p, --min-p, --seed: shared by generate and run.
void add_sampling_options(arg_parser& p);
sampling_params sampling_from(const arg_parser& p);

}  // namespace tansy
