#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, and chat with the bundled tiny model
# (models/tiny-chat-q4: 15M parameters of the Qwen3.6-35B-A3B architecture, MLX 4-bit layout).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
echo "--- tansy run: a question (reasoning first: dimmed on a terminal, on stderr through a pipe; --verbose: speed)"
build/bin/tansy run --prompt "What does json.dumps do?" -n 120 --verbose
echo "--- tansy run: the same model with tools: it answers with an XML tool call"
build/bin/tansy run --prompt "Use a tool to find out what heapq.heappush does." \
  --tools models/tiny-chat-q4/demo_tools.json -n 120
