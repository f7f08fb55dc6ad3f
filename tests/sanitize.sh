#!/usr/bin/env bash
# Build and run a lesson's CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer, without presets.
#
#   tests/sanitize.sh [BUILD_DIR=build-asan] [LABEL=lesson01]
#
# Configures BUILD_DIR with -DTVLLM_SANITIZE=ON (host code instrumented; see the top-level CMakeLists.txt),
# builds the test executables whose names start with test_NN_ plus the programs the CLI tests run, and
# runs `ctest -L LABEL -LE "gpu|fuzz"` with leak detection on and every UBSan report fatal.
# The same as `cmake --workflow --preset asan`, for CMake versions or trees without the presets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-asan}
label=${2:-lesson01}
nn=${label#lesson}

cmake -S "${TVLLM_SOURCE_DIR:-$root}" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTVLLM_SANITIZE=ON
# Only this lesson's tests and the executables they run: a sanitized build of everything is slow.
targets=$(cmake --build "$build" --target help | sed -n "s/^\(test_${nn}_[A-Za-z0-9_]*\):.*/\1/p" | grep -v '_gpu$' || true)
[[ -n $targets ]] || { echo "sanitize.sh: no test_${nn}_* targets"; exit 1; }
cmake --build "$build" -j"${JOBS:-2}" --target $targets tiny-vllm $(cmake --build "$build" --target help |
  sed -n "s/^\(lesson${nn}_[A-Za-z0-9_]*\):.*/\1/p")

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$build" -L "$label" -LE "gpu|fuzz" --output-on-failure -j"${JOBS:-2}"
