// parse_safetensors_header: bytes in memory -> a validated SafetensorsHeader.
//
// Pure parsing: no files, no CUDA (this file is also built alone, with common/dtype.cpp, into the fuzz
// target tests/fuzz/fuzz_safetensors.cpp). Every rule below is one the reference implementation (the
// Rust `safetensors` crate) enforces too; README.md lists each rule and the attack it stops.
//
//   [8 bytes: N, u64 little-endian][N bytes: UTF-8 JSON object][data section: file_size - 8 - N bytes]
#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "common/exercise.h"
#include "common/input_error.h"
#include "json_strict.h"
#include "safetensors.h"

namespace tvllm {

using nlohmann::json;

// ---- strict JSON helpers (declared in json_strict.h) ------------------------------------------------

bool is_valid_utf8(std::string_view s, size_t* bad_offset) {
  // --- exercise 01.2: valid UTF-8, strictly ---------------------------------------------------------
  // Task: return true when s is well-formed UTF-8; else store the offset of the first bad byte in
  //   *bad_offset (when it is not null) and return false. Reject what the reference rejects: a stray
  //   continuation byte, a truncated sequence, an overlong encoding (C0 80 for NUL), a UTF-16 surrogate
  //   half (U+D800..U+DFFF), anything above U+10FFFF.
  // Hint: the lead byte says the length: 0xxxxxxx 1, 110xxxxx 2, 1110xxxx 3, 11110xxx 4; every
  //   following byte is 10xxxxxx and adds 6 bits to the code point.
  // Hint: an overlong encoding is a code point that would fit in fewer bytes (3 bytes below U+0800).
  // Tests: SafetensorsParse.RejectsInvalidUtf8
  // Stub:
  //   (void)s;
  //   (void)bad_offset;
  //   throw NotWrittenYet("01.2", "valid UTF-8, strictly");
  // --- solution ---
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  auto fail = [&](size_t at) {
    if (bad_offset) *bad_offset = at;
    return false;
  };
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) { ++i; continue; }  // ASCII: the common case
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }        // 0xC0, 0xC1 would be overlong
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }   // above 0xF4 is past U+10FFFF
    else return fail(i);                                            // stray continuation or bad lead
    if (n - i < len) return fail(i);                                // truncated sequence
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return fail(i);
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return fail(i);  // overlong
    if (cp >= 0xD800 && cp <= 0xDFFF) return fail(i);                            // UTF-16 surrogate
    if (cp > 0x10FFFF) return fail(i);
    i += len;
  }
  return true;
  // --- end of exercise 01.2 ---
}

std::string json_snippet(const json& value, size_t max_chars) {
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > max_chars) s = s.substr(0, max_chars) + "...";
  return s;
}

json parse_json_strict(std::string_view text, const std::string& what) {
  // nlohmann reads a NUL byte as the end of the input and ignores what follows, where a strict parser
  // (the reference's serde_json) rejects it. JSON never contains a raw NUL (not even inside strings),
  // so refusing it up front removes that disagreement: "{}\0{...}" must not mean "{}".
  if (size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw InputError(what + ": not valid JSON: NUL byte at offset " + std::to_string(nul));
  // One set of seen keys per object currently open; the parser tells us when objects start and end.
  std::vector<std::set<std::string>> open_objects;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        // depth is that of the enclosing value: the root object starts at depth 0
        if (depth + 1 > kMaxJsonDepth)
          throw InputError(what + ": JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
        if (event == json::parse_event_t::object_start) open_objects.emplace_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (open_objects.empty() || !open_objects.back().insert(key).second)
          throw InputError(what + ": duplicate key \"" + key + "\" (a JSON object may name each key once)");
        break;
      }
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    throw InputError(what + ": not valid JSON: " + e.what());
  }
}

// ---- checksums ------------------------------------------------------------------------------------

uint64_t fnv1a64(const void* data, size_t size, uint64_t hash) {
  // --- exercise 01.5: the FNV-1a checksum ---------------------------------------------------------
  // Task: FNV-1a, 64-bit, over `size` bytes at `data`, starting from `hash` (so a caller can continue
  //   over several pieces). The lesson executable compares it with reference/manifest.json.
  // Hint: for each byte: xor it into the hash first ("1a"), then multiply by the FNV prime
  //   0x100000001b3; uint64_t arithmetic wraps around, which is what FNV wants.
  // Tests: Fnv1a64.KnownAnswers BundledModel.WeightsMatchTheManifestChecksums
  // Tests: lesson01_safetensors.cpu lesson01_safetensors.gpu
  // Stub:
  //   (void)data;
  //   (void)size;
  //   (void)hash;
  //   throw NotWrittenYet("01.5", "the FNV-1a checksum");
  // --- solution ---
  constexpr uint64_t kPrime = 0x100000001b3ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= p[i];   // xor the byte in first ("1a"), then multiply
    hash *= kPrime;
  }
  return hash;
  // --- end of exercise 01.5 ---
}

std::string fnv1a64_hex(uint64_t hash) {
  static const char* hex = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, hash >>= 4) s[i] = hex[hash & 15];
  return s;
}

// ---- the safetensors header -----------------------------------------------------------------------

namespace {

// The reference implementation refuses headers above 100 MB: a real header needs 100-150 bytes per
// tensor (the 1B model has 146), and without a cap an 8-byte lie in the length field would make us
// allocate and parse gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// N, the header length: the first 8 bytes of the file (file_size >= 8), once it is known to be sane.
uint64_t read_header_length(const uint8_t* bytes, uint64_t file_size) {
  // --- exercise 01.1: the header length -----------------------------------------------------------
  // Task: read N, the unsigned 64-bit little-endian integer in bytes[0..8), and reject (InputError, the
  //   message naming the problem) an N above kMaxHeaderBytes ("... limit ..."), an N that runs past the
  //   end of the file ("runs past the end of the file") and N = 0 ("header is empty"). Return N.
  // Hint: byte 0 is the least significant: build N from byte 7 down, shifting left by 8 each time.
  // Hint: check the limit first, and compare N with file_size - 8 (not N + 8 with file_size: a lie of
  //   2^64 - 1 would wrap the sum around to 7).
  // Tests: SafetensorsParse.RejectsHeaderLengthPastEndOfFile SafetensorsParse.RejectsAbsurdHeaderLength
  // Tests: SafetensorsParse.RejectsEmptyHeader
  // Stub:
  //   (void)bytes;
  //   (void)file_size;
  //   throw NotWrittenYet("01.1", "the header length");
  // --- solution ---
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // byte 0 is the least significant
  if (n > kMaxHeaderBytes)
    throw InputError("header length " + std::to_string(n) + " is above the " + std::to_string(kMaxHeaderBytes) +
                     "-byte limit (corrupt file, or not a safetensors file)");
  if (n > file_size - 8)
    throw InputError("header length " + std::to_string(n) + " runs past the end of the file (" +
                     std::to_string(file_size - 8) + " bytes follow the length field)");
  if (n == 0) throw InputError("header is empty (length 0): expected a JSON object");
  return n;
  // --- end of exercise 01.1 ---
}

[[maybe_unused]] std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// supported_dtypes() and as_u64() are the helpers exercise 01.3 uses ([[maybe_unused]]: its stub does not).
[[maybe_unused]] std::string supported_dtypes() {
  std::string s;
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32, DType::I16,
                  DType::I8, DType::U8, DType::BOOL, DType::F8_E4M3, DType::F8_E5M2}) {
    s += (s.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  return s;
}

// A JSON value that must be a non-negative integer that fits in uint64 (nlohmann stores non-negative
// integers as number_unsigned; negatives as number_integer; 2.0 or 1e3 as number_float).
[[maybe_unused]] bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) { *out = v.get<uint64_t>(); return true; }
  if (v.is_number_integer()) {  // signed storage: only non-negative values are acceptable
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
    return true;
  }
  return false;
}

SafetensorsEntry parse_entry(const std::string& name, const json& v, uint64_t data_bytes) {
  // --- exercise 01.3: one tensor entry ------------------------------------------------------------
  // Task: validate v, the header's entry for tensor `name`, and return it as a SafetensorsEntry. Reject
  //   (InputError naming the tensor and the problem): v not an object; a field other than dtype, shape,
  //   data_offsets, or one missing; a dtype that is not a string or not known (name it); a shape that is
  //   not an array of non-negative integers, or whose element count or byte size overflows 64 bits;
  //   data_offsets that are not two non-negative integers [begin, end] with begin <= end <= data_bytes
  //   (the size of the data section) and end - begin = the tensor's byte size.
  // Hint: parse_dtype() and dtype_size() (common/dtype.h) know the dtypes; as_u64() and
  //   supported_dtypes() above read a JSON integer and list the dtypes for a message.
  // Hint: check the product before each multiplication: count > kMax / d means count * d would wrap.
  // Tests: SafetensorsParse.RejectsEntryThatIsNotAnObject SafetensorsParse.RejectsMissingFields
  // Tests: SafetensorsParse.RejectsExtraFields SafetensorsParse.RejectsWrongFieldTypes
  // Tests: SafetensorsParse.RejectsUnknownDtypeNamingIt SafetensorsParse.RejectsNegativeOrFractionalShape
  // Tests: SafetensorsParse.RejectsShapeProductOverflow SafetensorsParse.RejectsByteCountMismatch
  // Tests: SafetensorsParse.RejectsBeginAfterEnd SafetensorsParse.RejectsEndPastDataSection
  // Tests: SafetensorsParse.AcceptsEveryDtype SafetensorsFile.ReadsKnownValuesOfEachFloatDtype
  // Stub:
  //   (void)name;
  //   (void)v;
  //   (void)data_bytes;
  //   throw NotWrittenYet("01.3", "one tensor entry");
  // --- solution ---
  const std::string where = "tensor " + quoted(name) + ": ";
  if (!v.is_object()) throw InputError(where + "entry must be a JSON object, got " + json_snippet(v));
  for (const auto& [key, _] : v.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      throw InputError(where + "unknown field " + quoted(key) + " (an entry has exactly dtype, shape, data_offsets)");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) throw InputError(where + "missing field \"" + field + "\"");
  }

  SafetensorsEntry e;
  e.name = name;

  const json& dt = v["dtype"];
  if (!dt.is_string()) throw InputError(where + "dtype must be a string, got " + json_snippet(dt));
  auto dtype = parse_dtype(dt.get_ref<const std::string&>());
  if (!dtype)
    throw InputError(where + "unknown dtype " + json_snippet(dt) + " (supported: " + supported_dtypes() + ")");
  e.dtype = *dtype;

  // Element count = product of the dimensions, checked at every step: [2^40, 2^40] must not wrap
  // around to a small number that then "matches" a small byte range.
  const json& shape = v["shape"];
  if (!shape.is_array()) throw InputError(where + "shape must be an array, got " + json_snippet(shape));
  constexpr uint64_t kMaxCount = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    uint64_t d;
    if (!as_u64(shape[i], &d))
      throw InputError(where + "shape[" + std::to_string(i) + "] must be a non-negative integer, got " +
                       json_snippet(shape[i]));
    if (d > kMaxCount)
      throw InputError(where + "shape[" + std::to_string(i) + "] = " + std::to_string(d) + " is too large");
    if (d != 0 && count > kMaxCount / d)
      throw InputError(where + "the element count (product of shape " + json_snippet(shape) +
                       ") overflows a 64-bit integer");
    count *= d;
    e.shape.push_back(static_cast<int64_t>(d));
  }
  const uint64_t elem = dtype_size(e.dtype);
  if (count > std::numeric_limits<uint64_t>::max() / elem)
    throw InputError(where + "the byte size of shape " + json_snippet(shape) + " overflows a 64-bit integer");
  const uint64_t nbytes = count * elem;

  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2)
    throw InputError(where + "data_offsets must be an array [begin, end], got " + json_snippet(off));
  if (!as_u64(off[0], &e.begin) || !as_u64(off[1], &e.end))
    throw InputError(where + "data_offsets must hold two non-negative integers, got " + json_snippet(off));
  if (e.begin > e.end)
    throw InputError(where + "data_offsets begin " + std::to_string(e.begin) + " is after end " +
                     std::to_string(e.end));
  if (e.end > data_bytes)
    throw InputError(where + "data_offsets end " + std::to_string(e.end) + " is past the end of the data section (" +
                     std::to_string(data_bytes) + " bytes)");
  if (e.end - e.begin != nbytes)
    throw InputError(where + "data_offsets cover " + std::to_string(e.end - e.begin) + " bytes, but " +
                     std::string(dtype_name(e.dtype)) + json_snippet(shape) + " needs " + std::to_string(nbytes));
  return e;
  // --- end of exercise 01.3 ---
}

// The layout: sorted by offset, the tensors must tile the data section exactly, from byte 0 to the last
// byte, with no gaps (hidden bytes) and no overlaps (one byte read as two tensors).
void sort_and_check_layout(std::vector<SafetensorsEntry>& entries, uint64_t data_bytes) {
  // --- exercise 01.4: the tensors tile the data section -------------------------------------------
  // Task: sort the entries by offset, then check that they cover bytes [0, data_bytes) exactly once.
  //   Reject (InputError) an overlap ("tensor "b" (bytes 4..12) overlaps tensor "a" (bytes 0..8)"), a
  //   hole ("hole in the data section: bytes 4..8 ..."), and bytes after the last tensor ("3 trailing
  //   bytes ...").
  // Hint: sort by (begin, end, name): zero-size tensors at an offset then come first, and the order is
  //   the same whatever the order of the JSON.
  // Hint: walk with a cursor, where the next tensor must start.
  // Tests: SafetensorsParse.RejectsOverlap SafetensorsParse.RejectsHole SafetensorsParse.RejectsTrailingBytes
  // Tests: SafetensorsParse.EntriesAreSortedByOffsetWhateverTheJsonOrder SafetensorsParse.AcceptsZeroSizeTensorsAnywhere
  // Tests: SafetensorsParse.LengthIsLittleEndian
  // Stub:
  //   (void)entries;
  //   (void)data_bytes;
  //   throw NotWrittenYet("01.4", "the tensors tile the data section");
  // --- solution ---
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;  // zero-size tensors at an offset come first
    return a.name < b.name;
  });
  uint64_t cursor = 0;  // where the next tensor must start
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin < cursor)
      throw InputError("tensor " + quoted(e.name) + " (bytes " + std::to_string(e.begin) + ".." +
                       std::to_string(e.end) + ") overlaps tensor " + quoted(prev->name) + " (bytes " +
                       std::to_string(prev->begin) + ".." + std::to_string(prev->end) + ")");
    if (e.begin > cursor)
      throw InputError("hole in the data section: bytes " + std::to_string(cursor) + ".." + std::to_string(e.begin) +
                       " belong to no tensor (before tensor " + quoted(e.name) + ")");
    cursor = e.end;
    prev = &e;
  }
  if (cursor != data_bytes)
    throw InputError("the data section has " + std::to_string(data_bytes - cursor) +
                     " trailing bytes after the last tensor (it is " + std::to_string(data_bytes) +
                     " bytes, the tensors cover " + std::to_string(cursor) + ")");
  // --- end of exercise 01.4 ---
}

}  // namespace

SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t size, uint64_t file_size) {
  if (size > file_size) throw std::invalid_argument("parse_safetensors_header: size > file_size");
  if (file_size < 8)
    throw InputError("file is " + std::to_string(file_size) +
                     " bytes: too short for the 8-byte header length (not a safetensors file)");
  if (size < 8) throw std::invalid_argument("parse_safetensors_header: pass at least the first 8 bytes");

  SafetensorsHeader h;
  h.header_bytes = read_header_length(bytes, file_size);
  const uint64_t n = h.header_bytes;
  if (size - 8 < n) throw std::invalid_argument("parse_safetensors_header: the header bytes were not all passed");
  h.data_offset = 8 + n;
  const uint64_t data_bytes = file_size - h.data_offset;

  std::string_view text(reinterpret_cast<const char*>(bytes + 8), static_cast<size_t>(n));
  size_t bad = 0;
  if (!is_valid_utf8(text, &bad))
    throw InputError("header is not valid UTF-8 (bad byte 0x" + [&] {
      static const char* hex = "0123456789abcdef";
      unsigned char c = static_cast<unsigned char>(text[bad]);
      return std::string{hex[c >> 4], hex[c & 15]};
    }() + " at header offset " + std::to_string(bad) + ")");

  json j = parse_json_strict(text, "header");
  if (!j.is_object()) throw InputError("header must be a JSON object, got " + json_snippet(j));

  for (const auto& [key, value] : j.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // the reference reads null as "no metadata"; so do we
      if (!value.is_object())
        throw InputError("__metadata__ must be an object of string -> string, got " + json_snippet(value));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          throw InputError("__metadata__[\"" + mk + "\"] must be a string, got " + json_snippet(mv));
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(key, value, data_bytes));
  }
  sort_and_check_layout(h.entries, data_bytes);
  return h;
}

}  // namespace tvllm
