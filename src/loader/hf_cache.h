// Checkpoints named by Hugging Face repo id, found in the local hub cache (the layout `hf download` writes):
//   CACHE/models--ORG--NAME/refs/REV             the commit hash a branch or tag points at
//   CACHE/models--ORG--NAME/snapshots/HASH/FILE  usually a symlink to ../../blobs/SHA (mmap follows it)
// CACHE is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. Nothing is ever downloaded, so
// HF_HUB_OFFLINE holds trivially.
#pragma once
#include <string>

namespace tansy {

// The hub cache directory from the values of $HF_HUB_CACHE, $HF_HOME and $HOME ("" when all are empty). The
// environment is read by the command line (cli/args.h), not here.
std::string hf_hub_cache_dir(const std::string& hf_hub_cache, const std::string& hf_home, const std::string& home);

// True when `arg` has the shape ORG/NAME or ORG/NAME@REV (and so is looked up in the cache when it is not an
// existing path).
bool is_hf_repo_id(const std::string& arg);

// The repo id of a --model value without its @REV ("" when `arg` is no repo id).
std::string hf_repo_name(const std::string& arg);

// A --model value as a path: an existing file or directory as given (it wins over a same-named repo id); an
// ORG/NAME[@REV] as its snapshot directory in the cache (REV: a branch or tag under refs/, or a commit hash or
// a unique prefix of one; default main) in `cache` (hf_hub_cache_dir); anything else unchanged, for the loader
// to report. A repo id that is absent or incomplete (no config.json) throws tansy::error naming where it looked
// and the `hf download` command that fetches it.
std::string resolve_model_path(const std::string& arg, const std::string& cache);

}  // namespace tansy
