#!/usr/bin/env bash
# Fuzz lesson 01's safetensors parser with libFuzzer + AddressSanitizer + UBSan.
#
#   tests/fuzz/run_fuzz.sh [SECONDS=60] [WORKDIR=build-fuzz]
#
# Builds WORKDIR/fuzz_safetensors with clang++ straight from lessons/01_safetensors/safetensors_parse.cpp and
# common/dtype.cpp (no CMake, no CUDA: the parser needs only nlohmann/json headers), writes a small seed
# corpus of valid and invalid files, and fuzzes for SECONDS. The corpus grows in WORKDIR/corpus across
# runs. Exit 0: ran clean. Non-zero: a finding; libFuzzer prints it and leaves WORKDIR/crash-* to replay
# with `WORKDIR/fuzz_safetensors WORKDIR/crash-...`. Exit 77: no clang with libFuzzer here (CTest: skipped).
set -euo pipefail
export LC_ALL=C  # ${#s} counts bytes, not characters

seconds=${1:-60}
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${2:-$root/build-fuzz}
mkdir -p "$work"
work=$(cd "$work" && pwd)

cxx=${FUZZ_CXX:-}
if [[ -z $cxx ]]; then
  for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
if [[ -z $cxx ]]; then
  echo "run_fuzz.sh: skipped: no clang++ found (libFuzzer needs clang)"
  exit 77
fi

sources=("$root/tests/fuzz/fuzz_safetensors.cpp" "$root/lessons/01_safetensors/safetensors_parse.cpp"
         "$root/common/dtype.cpp")
headers=("$root/lessons/01_safetensors/safetensors.h" "$root/lessons/01_safetensors/json_strict.h"
         "$root/common/dtype.h" "$root/common/input_error.h" "$root/common/device.h")
bin=$work/fuzz_safetensors
rebuild=0
[[ -x $bin ]] || rebuild=1
for f in "${sources[@]}" "${headers[@]}"; do [[ $f -nt $bin ]] && rebuild=1; done
if ((rebuild)); then
  echo "== building $bin with $cxx"
  if ! "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
      -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -I"$root" -I"$root/lessons/01_safetensors" "${sources[@]}" -o "$bin.tmp" 2>"$work/build.log"; then
    if grep -q -e "libclang_rt.fuzzer" -e "cannot find.*fuzzer" "$work/build.log"; then
      echo "run_fuzz.sh: skipped: $cxx has no libFuzzer runtime (install libclang-rt-dev)"; exit 77
    fi
    cat "$work/build.log"; exit 1
  fi
  mv "$bin.tmp" "$bin"
fi

# ---- seed corpus: a few valid files and one of each kind of malformed file -------------------------
seeds=$work/seeds
corpus=$work/corpus
mkdir -p "$seeds" "$corpus"
seed() {  # seed NAME HEADER_JSON DATA_BYTES [LENGTH_OVERRIDE]
  local n=${4:-${#2}}
  local le=""
  for i in 0 1 2 3 4 5 6 7; do le+=$(printf '\\x%02x' $(( (n >> (8 * i)) & 255 ))); done
  { printf "$le"; printf '%s' "$2"; head -c "$3" /dev/zero; } > "$seeds/$1"
}
e() { printf '{"dtype":"%s","shape":%s,"data_offsets":%s}' "$1" "$2" "$3"; }
seed valid_one       "{\"w\":$(e F32 '[2,2]' '[0,16]')}" 16
seed valid_three     "{\"__metadata__\":{\"format\":\"pt\"},\"a\":$(e BF16 '[3]' '[0,6]'),\"b\":$(e F16 '[]' '[6,8]'),\"c\":$(e I64 '[0,5]' '[8,8]')}" 8
seed valid_empty     "{}" 0
seed valid_padded    "{\"x\":$(e U8 '[1]' '[0,1]')}        " 1
seed valid_layers    "{\"model.layers.0.self_attn.q_proj.weight\":$(e BF16 '[4,2]' '[0,16]'),\"model.norm.weight\":$(e BF16 '[2]' '[16,20]')}" 20
seed bad_overlap     "{\"a\":$(e F32 '[2]' '[0,8]'),\"b\":$(e F32 '[2]' '[4,12]')}" 12
seed bad_hole        "{\"a\":$(e F32 '[1]' '[0,4]'),\"b\":$(e F32 '[1]' '[8,12]')}" 12
seed bad_trailing    "{\"a\":$(e F32 '[1]' '[0,4]')}" 9
seed bad_overflow    "{\"a\":$(e F32 '[4294967296,4294967296]' '[0,0]')}" 0
seed bad_dtype       "{\"a\":$(e F8_E4M3 '[1]' '[0,1]')}" 1
seed bad_dup         "{\"a\":$(e U8 '[1]' '[0,1]'),\"a\":$(e U8 '[1]' '[0,1]')}" 1
seed bad_length      "{}" 0 4096
seed bad_json        "{\"a\":{\"dtype\":" 0
seed bad_meta        "{\"__metadata__\":{\"k\":1}}" 0
printf '\xff\xff\xff\xff\xff\xff\xff\xff' > "$seeds/bad_huge_length"

# A dictionary: the fuzzer splices these tokens in, which reaches deep checks far sooner than random bytes.
cat > "$work/safetensors.dict" <<'DICT'
"dtype"
"shape"
"data_offsets"
"__metadata__"
"F32"
"F16"
"BF16"
"F64"
"I64"
"I32"
"I16"
"I8"
"U8"
"BOOL"
"F8_E4M3"
"[0,0]"
"[]"
"18446744073709551615"
"9223372036854775808"
"4294967296"
"-1"
"1e400"
"null"
"\\u0000"
"\\ud800"
"\xc0\x80"
"\xed\xa0\x80"
DICT

echo "== fuzzing for ${seconds}s (work dir $work)"
cd "$work"  # crash-* / leak-* / timeout-* files land here
set +e +o pipefail
"$bin" -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -dict="$work/safetensors.dict" "$corpus" "$seeds" 2>&1 | tee "$work/last_run.log" |
  grep -E "^(#[0-9]+[[:space:]]+(INITED|DONE)|Done |stat::|==[0-9]+==ERROR|SUMMARY|INFO: Seed)"
status=${PIPESTATUS[0]}
set -e -o pipefail
if ((status != 0)); then
  echo "run_fuzz.sh: FINDING (exit $status); full log: $work/last_run.log"
  tail -n 60 "$work/last_run.log"
  exit 1
fi
echo "run_fuzz.sh: ran clean for ${seconds}s; corpus: $(ls "$corpus" | wc -l) inputs"
