#!/usr/bin/env bash
# Fills .carry/deps (git-ignored) with what the GPU machine lacks and cannot download: the headers, shared
# libraries and pkg-config files of our Debian dependencies (cpp-httplib with what its header includes and its
# .pc requires: OpenSSL, zlib, brotli) and the GoogleTest sources. The device tool carries it with
# `carry: [".carry"]`; scripts/device.sh builds against it (-DTANSY_DEPS_DIR, which also puts
# .carry/deps/lib/pkgconfig first on pkg-config's path, and LD_LIBRARY_PATH=.carry/deps/lib at run time).
# The .pc files are made relocatable (prefix=${pcfiledir}/../..), so they hold wherever the tree lands.
# Run here, on the Debian machine (needs libcpp-httplib-dev, libssl-dev, zlib1g-dev, libbrotli-dev,
# libpcre2-dev, libutf8proc-dev, nlohmann-json3-dev, googletest).
set -euo pipefail
cd "$(dirname "$0")/.."
d=.carry/deps
L=/usr/lib/x86_64-linux-gnu
rm -rf "$d" && mkdir -p "$d/include" "$d/lib/pkgconfig"

# headers: ours, and those httplib.h includes (openssl/*.h, zlib.h, brotli/*.h)
cp -r /usr/include/nlohmann "$d/include/"
cp /usr/include/pcre2.h /usr/include/utf8proc.h /usr/include/httplib.h "$d/include/"
cp -r /usr/include/openssl /usr/include/brotli "$d/include/"
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$d/include/openssl/"  # Debian's per-architecture opensslconf.h, configuration.h
cp /usr/include/zlib.h /usr/include/zconf.h "$d/include/"

# shared libraries: the runtime files with their soname links and the -lNAME development links. The server
# binary links libcpp-httplib, which needs libssl, libcrypto, libz and libbrotli{dec,enc,common} at run time.
# (libgomp, libstdc++, libgcc_s and libc come with the compiler and C library there.)
for lib in pcre2-8 utf8proc cpp-httplib ssl crypto z brotlicommon brotlidec brotlienc; do
  ls "$L/lib$lib.so" > /dev/null  # the development link must exist here
  cp -P "$L"/lib$lib.so "$L"/lib$lib.so.* "$d/lib/"
done
for f in "$d"/lib/*.so*; do  # links with an absolute target (Debian's libz.so -> /lib/...) point inside the carry
  t=$(readlink "$f" || true)
  case "$t" in /*) [ -e "$d/lib/${t##*/}" ] && ln -sfn "${t##*/}" "$f" || { echo "prepare-device-carry: $f -> $t" >&2; exit 1; } ;; esac
done

# pkg-config files, relocated into the carry (Debian's say prefix=/usr and libdir=${prefix}/lib/<triplet>)
for pc in cpp-httplib openssl libssl libcrypto zlib libbrotlicommon libbrotlidec libbrotlienc libpcre2-8 libutf8proc; do
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

# check: the carry alone resolves cpp-httplib and everything it requires
PKG_CONFIG_LIBDIR="$PWD/$d/lib/pkgconfig" PKG_CONFIG_PATH= pkg-config --cflags --libs --print-errors cpp-httplib > /dev/null
du -sh "$d"
