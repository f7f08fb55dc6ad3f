#!/usr/bin/env bash
# The whole GPU pass, in one command, on a machine with an NVIDIA GPU:
#   1. configure for this GPU's architecture and build everything
#   2. ctest: every test (the GPU ones now run instead of skipping)
#   3. every lesson executable on the bundled tiny model
#   4. compute-sanitizer (memcheck; racecheck on the reduction kernels) over the lesson executables
#   5. a random-weight model with Llama 3.2 1B's shapes + its Hugging Face references, made here
#   6. every lesson executable on that model, then --bench at 1B shapes, then PyTorch's own kernels on the
#      same shapes for comparison
# Logs and a summary (report.md) go to $OUT (default: ./gpu-pass-out).
#
#   bash tests/gpu_pass.sh                       # everything
#   STAGES="build test tiny" bash tests/gpu_pass.sh
#   LESSONS="03 04" bash tests/gpu_pass.sh        # only these lesson executables in stages 3-6
#
# Dependencies the machine lacks (CLI11, ...) can travel in .deps/ (see the README's GPU section).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/gpu-pass-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test tiny sanitize random bench baseline"}
LESSONS=${LESSONS:-""}
BUILD=${BUILD:-$root/build-gpu}
RANDOM_MODEL=${RANDOM_MODEL:-/tmp/tvllm-random-1b}
RANDOM_LAYERS=${RANDOM_LAYERS:-16}   # fewer layers make the model and its references faster; shapes stay 1B's
CTEST_LABEL=${CTEST_LABEL:-""}       # e.g. CTEST_LABEL=gpu runs only the GPU tests
report=$OUT/report.md
status=0

has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
note() { echo "$*" | tee -a "$report"; }
# run NAME TIMEOUT CMD...: runs a step with a time limit, logs it to $OUT/NAME.log, records pass/fail
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local verdict=PASS
  if [ $rc -eq 77 ]; then verdict=SKIP; elif [ $rc -ne 0 ]; then verdict="FAIL (exit $rc)"; status=1; fi
  note "| $name | $verdict | $((SECONDS - t0)) s |"
  return $rc
}

if [ -d .deps ]; then
  export PKG_CONFIG_PATH=$root/.deps/lib/pkgconfig LD_LIBRARY_PATH=$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  prefix_arg=-DCMAKE_PREFIX_PATH=$root/.deps
else
  prefix_arg=
fi

# A report per invocation; a second invocation into the same $OUT keeps the first one's.
[ -f "$report" ] && mv "$report" "$OUT/report.$(date +%s).md"
: >"$report"
note "# tiny-vllm GPU pass, $(date -u +%Y-%m-%dT%H:%MZ)"
note ""
note '```'
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$report"
note "nvcc: $(nvcc --version | tail -1)"
note '```'
note ""
note "| step | result | time |"
note "| --- | --- | --- |"

lesson_exes() {
  local exe
  for exe in "$BUILD"/bin/lesson[0-9][0-9]_*; do
    [ -x "$exe" ] || continue
    local n; n=$(basename "$exe" | sed -E 's/^lesson([0-9][0-9])_.*/\1/')
    if [ -z "$LESSONS" ] || [[ " $LESSONS " == *" $n "* ]]; then echo "$exe"; fi
  done
}

if has_stage build; then
  run configure 300 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $prefix_arg || { cat "$OUT/configure.log"; exit 1; }
  run build 480 cmake --build "$BUILD" -j "$(nproc)" || { tail -50 "$OUT/build.log"; exit 1; }
fi

if has_stage test; then
  run ctest 480 ctest --test-dir "$BUILD" -j 4 --output-on-failure --timeout 300 --output-junit "$OUT/ctest.xml" \
    ${CTEST_LABEL:+-L "$CTEST_LABEL"}
  grep -E "tests passed|tests failed|Skipped|\(Failed\)|\(SEGFAULT\)|\(Timeout\)" "$OUT/ctest.log" | tee -a "$report"
fi

if has_stage tiny; then
  for exe in $(lesson_exes); do
    run "tiny.$(basename "$exe")" 300 "$exe" --device cuda
  done
fi

if has_stage sanitize && command -v compute-sanitizer >/dev/null; then
  for exe in $(lesson_exes); do
    name=$(basename "$exe")
    case $name in
      # lesson 02 sweeps all 2^32 fp32 patterns: far too slow under memcheck; check its GPU tests instead
      lesson02_*) run "memcheck.$name" 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
                    "$BUILD/bin/test_02_bf16_gpu" ;;
      *) run "memcheck.$name" 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$exe" --device cuda ;;
    esac
  done
  for exe in $(lesson_exes); do
    case $(basename "$exe") in lesson04_*|lesson07_*)
      run "racecheck.$(basename "$exe")" 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$exe" --device cuda ;;
    esac
  done
fi

if has_stage random; then
  if [ ! -f "$RANDOM_MODEL/reference/activations.safetensors" ]; then
    run make_random_model 300 python3 weights/tools/make_random_model.py --preset llama-3.2-1b --out "$RANDOM_MODEL" \
      --layers "$RANDOM_LAYERS"
    run make_random_reference 400 python3 weights/tools/make_reference.py "$RANDOM_MODEL" --device cuda
  fi
  for exe in $(lesson_exes); do
    run "1b.$(basename "$exe")" 300 "$exe" --device cuda --model "$RANDOM_MODEL"
  done
fi

if has_stage bench; then
  bench_model=$RANDOM_MODEL
  [ -f "$bench_model/config.json" ] || bench_model=$root/weights/tiny-llama3
  for exe in $(lesson_exes); do
    run "bench.$(basename "$exe")" 300 "$exe" --device cuda --model "$bench_model" --bench
  done
fi

if has_stage baseline && [ -f weights/tools/torch_kernel_baseline.py ]; then
  run torch_baseline 300 python3 weights/tools/torch_kernel_baseline.py --tokens 16384
fi

# The tables every lesson printed, gathered in one place.
{
  echo ""
  echo "## Lesson output (PASS/FAIL lines and benchmark tables)"
  for log in "$OUT"/tiny.*.log "$OUT"/1b.*.log "$OUT"/bench.*.log "$OUT"/torch_baseline.log; do
    [ -f "$log" ] || continue
    echo ""
    echo "### $(basename "$log" .log)"
    echo '```'
    # from the first table on: the comparison table, its verdict and any benchmark tables
    sed -n '/^== /,$p' "$log" | grep -v '^[[:space:]]*$' | tail -70
    echo '```'
  done
} >>"$report"

# Full logs in one archive (the device tool brings back a few files only).
tar -czf "$OUT/logs.$(date +%s).tar.gz" -C "$OUT" --exclude report.md $(cd "$OUT" && ls *.log *.xml 2>/dev/null) 2>/dev/null
find "$OUT" -maxdepth 1 -name '*.log' -delete
find "$OUT" -maxdepth 1 -name '*.xml' -delete
echo "GPU pass: $([ $status -eq 0 ] && echo PASS || echo FAIL) (report: $report)"
exit $status
