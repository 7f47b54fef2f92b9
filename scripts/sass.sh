#!/usr/bin/env bash
# SASS of the kernels of one CUDA source, on a machine without a GPU: compiles FILE for sm_90 (as the device build
# does) and prints the functions whose mangled name matches REGEX (MIX=1: their instruction counts, summed). Needs
# cuobjdump (and the nvdisasm it calls): from the CUDA toolkit when it has them, else from NVIDIA's PyPI wheels (pip
# installs them into ~/.cache/tansy-cuobjdump once; the dev machine's toolkit ships nvcc and ptxas only).
#   scripts/sass.sh src/backend/cuda/moe_decode_warp.cu 'down_warp_kernel' > /tmp/down.sass
#   MIX=1 scripts/sass.sh src/backend/cuda/gemv_warp.cu 'gemv_warp_kernelILi2ELi6ELb0'   (instruction counts only)
set -euo pipefail
file=${1:?usage: sass.sh FILE.cu REGEX}; pat=${2:?usage: sass.sh FILE.cu REGEX}
root=$(cd "$(dirname "$0")/.." && pwd)
tool=$(command -v cuobjdump || true)
if [ -z "$tool" ]; then
  dir=${XDG_CACHE_HOME:-$HOME/.cache}/tansy-cuobjdump
  tool=$(find "$dir" -name cuobjdump -type f 2>/dev/null | head -1 || true)
  if [ -z "$tool" ]; then
    echo "sass.sh: installing NVIDIA's cuobjdump and nvdisasm wheels into $dir" >&2
    pip install --quiet --target "$dir" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
    tool=$(find "$dir" -name cuobjdump -type f | head -1)
  fi
  chmod +x "$tool" "$(dirname "$tool")/nvdisasm"
  export PATH="$(dirname "$tool"):$PATH"
fi
obj=$(mktemp --suffix=.o); trap 'rm -f "$obj"' EXIT
nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -I"$root/src" -c "$file" -o "$obj"
"$tool" -sass "$obj" | awk -v pat="$pat" '/Function : / {f = ($0 ~ pat)} f' |
  if [ "${MIX:-0}" = 1 ]; then
    awk '/^ *\/\*[0-9a-f]+\*\// {sub(/^ *\/\*[0-9a-f]+\*\/ */, ""); sub(/^@!?U?P[0-9T] +/, ""); split($0, a, /[ ;]/); n[a[1]]++}
         END {for (k in n) printf "%6d %s\n", n[k], k}' | sort -rn | head -40
  else
    cat
  fi
