#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, and run tansy on the bundled tiny chat model
# (models/tiny-chat-q4, a 15M-parameter model of the Qwen3.6-35B-A3B architecture in the MLX 4-bit layout).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
echo "--- tansy generate: 40 greedy tokens after a chat prompt (examples/chat_prompt.ids)"
build/bin/tansy generate --ids-file examples/chat_prompt.ids -n 40 --greedy --output-ids
