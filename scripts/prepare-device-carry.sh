#!/usr/bin/env bash
# Fills .carry/deps (git-ignored) with what the GPU machine lacks and cannot download: the headers, shared
# libraries and pkg-config files of our Debian dependencies (pcre2, utf8proc; standalone Asio and nlohmann-json,
# header-only) and the GoogleTest sources. The device tool carries it with `carry: [".carry"]`;
# scripts/device.sh builds against it (-DTANSY_DEPS_DIR, which also puts .carry/deps/lib/pkgconfig first on
# pkg-config's path, and LD_LIBRARY_PATH=.carry/deps/lib at run time).
# The .pc files are made relocatable (prefix=${pcfiledir}/../..), so they hold wherever the tree lands.
# Run here, on the Debian machine (needs libpcre2-dev, libutf8proc-dev, libasio-dev, nlohmann-json3-dev,
# googletest).
set -euo pipefail
cd "$(dirname "$0")/.."
d=.carry/deps
L=/usr/lib/x86_64-linux-gnu
rm -rf "$d" && mkdir -p "$d/include" "$d/lib/pkgconfig"

# headers: the server's Asio (header-only, ~5 MB), nlohmann-json, pcre2, utf8proc
cp -r /usr/include/nlohmann /usr/include/asio "$d/include/"
cp /usr/include/asio.hpp /usr/include/pcre2.h /usr/include/utf8proc.h "$d/include/"

# shared libraries: the runtime files with their soname links and the -lNAME development links.
# (libgomp, libstdc++, libgcc_s and libc come with the compiler and C library there.)
for lib in pcre2-8 utf8proc; do
  ls "$L/lib$lib.so" > /dev/null  # the development link must exist here
  cp -P "$L"/lib$lib.so "$L"/lib$lib.so.* "$d/lib/"
done
for f in "$d"/lib/*.so*; do  # links with an absolute target point inside the carry
  t=$(readlink "$f" || true)
  case "$t" in /*) [ -e "$d/lib/${t##*/}" ] && ln -sfn "${t##*/}" "$f" || { echo "prepare-device-carry: $f -> $t" >&2; exit 1; } ;; esac
done

# pkg-config files, relocated into the carry (Debian's say prefix=/usr and libdir=${prefix}/lib/<triplet>)
for pc in libpcre2-8 libutf8proc; do
  sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^exec_prefix=.*|exec_prefix=${prefix}|' \
      -e 's|^libdir=.*|libdir=${prefix}/lib|' -e 's|^sharedlibdir=.*|sharedlibdir=${libdir}|' \
      -e 's|^includedir=.*|includedir=${prefix}/include|' "$L/pkgconfig/$pc.pc" > "$d/lib/pkgconfig/$pc.pc"
done
# every path in the carried .pc files must now point into the carry
if grep -nE '(^|[=[:space:]])/usr' "$d"/lib/pkgconfig/*.pc; then echo "prepare-device-carry: a .pc file still names /usr" >&2; exit 1; fi
for pc in "$d"/lib/pkgconfig/*.pc; do
  for v in libdir includedir; do
    [ "$(cd "$(pkg-config --variable=$v "$pc")" && pwd -P)" = "$(cd "$d/${v%dir}" && pwd -P)" ] ||
      { echo "prepare-device-carry: $pc: $v is not $d/${v%dir}" >&2; exit 1; }
  done
done

# GoogleTest sources, without their own tests and samples (built only with gtest_build_tests/samples)
cp -r /usr/src/googletest "$d/googletest-src"
rm -rf "$d"/googletest-src/googletest/{test,samples} "$d"/googletest-src/googlemock/test

# check: the carry alone resolves the libraries, and holds the server's header
PKG_CONFIG_LIBDIR="$PWD/$d/lib/pkgconfig" PKG_CONFIG_PATH= pkg-config --cflags --libs --print-errors libpcre2-8 libutf8proc > /dev/null
[ -f "$d/include/asio.hpp" ] && [ -f "$d/include/asio/version.hpp" ]
echo "prepare-device-carry: $(du -sh "$d" | cut -f1) in $d (tracked tree: $(git ls-files -z | du -ch --files0-from=- 2>/dev/null | tail -1 | cut -f1))"
