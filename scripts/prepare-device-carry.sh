#!/usr/bin/env bash
# Fills .carry/deps (git-ignored) with what the GPU machine lacks and cannot download: the headers and shared
# libraries of our Debian dependencies and the GoogleTest sources. The device tool carries it with
# `carry: [".carry"]`; scripts/device.sh builds against it. Run here, on the Debian machine.
set -euo pipefail
cd "$(dirname "$0")/.."
d=.carry/deps
rm -rf "$d" && mkdir -p "$d/include" "$d/lib"
cp -r /usr/include/nlohmann "$d/include/"
cp /usr/include/pcre2.h /usr/include/utf8proc.h "$d/include/"
[ -f /usr/include/httplib.h ] && cp /usr/include/httplib.h "$d/include/"
cp -P /usr/lib/x86_64-linux-gnu/libpcre2-8.so* /usr/lib/x86_64-linux-gnu/libutf8proc.so* "$d/lib/"
cp -r /usr/src/googletest "$d/googletest-src"
du -sh "$d"
