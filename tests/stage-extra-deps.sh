#!/usr/bin/env bash
# Stages into ./.deps the libraries the GPU pass needs on a machine that cannot reach a package registry, beyond
# the usual ones (nlohmann/json, CLI11, PCRE2, cpp-httplib, GoogleTest): utf8proc, lesson 09's NFC normalizer
# (Debian libutf8proc-dev, a static library: nothing needed at run time). Run it from the project root on a
# machine that has the package (or can install it); tests/gpu_pass.sh then finds it (README "Working with a GPU").
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .deps/include .deps/lib/pkgconfig
dpkg -s libutf8proc-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libutf8proc-dev >/dev/null; }
cp /usr/include/utf8proc.h .deps/include/
cp /usr/lib/x86_64-linux-gnu/libutf8proc.a .deps/lib/
cp /usr/lib/x86_64-linux-gnu/pkgconfig/libutf8proc.pc .deps/lib/pkgconfig/
# pkg-config paths relative to the .pc file, so .deps works wherever the tree lands
sed -i "s|^prefix=.*|prefix=\${pcfiledir}/../..|; s|^libdir=.*|libdir=\${prefix}/lib|; s|^includedir=.*|includedir=\${prefix}/include|" \
  .deps/lib/pkgconfig/libutf8proc.pc
echo "staged utf8proc into .deps/"
