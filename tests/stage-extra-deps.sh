#!/usr/bin/env bash
# Adds to ./.deps what the project needs on the GPU machine beyond what ../shared/tools/stage-device-deps.sh
# stages: utf8proc (lesson 09's NFC normalizer; Debian libutf8proc-dev, a static library, nothing at run time).
# Run it from the project root after that script, before a device call that carries .deps.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .deps/lib/pkgconfig ] || { echo "error: run ../shared/tools/stage-device-deps.sh first (no .deps/)"; exit 1; }
dpkg -s libutf8proc-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libutf8proc-dev >/dev/null; }
cp /usr/include/utf8proc.h .deps/include/
cp /usr/lib/x86_64-linux-gnu/libutf8proc.a .deps/lib/
cp /usr/lib/x86_64-linux-gnu/pkgconfig/libutf8proc.pc .deps/lib/pkgconfig/
sed -i "s|^prefix=.*|prefix=\${pcfiledir}/../..|; s|^libdir=.*|libdir=\${prefix}/lib|; s|^includedir=.*|includedir=\${prefix}/include|" \
  .deps/lib/pkgconfig/libutf8proc.pc
echo "staged utf8proc into .deps/"
