// Strict JSON for untrusted files: nlohmann::json with the three things its defaults let through.
//
//   duplicate keys   nlohmann keeps the last value silently; two readers of the same file could then
//                    disagree about what it says (one takes the first, one the last). We reject them.
//   deep nesting     "[[[[..." a million levels deep: we stop at kMaxJsonDepth instead of building it.
//   parse errors     nlohmann throws its own exception type; we turn it into InputError (exit 2).
//
// No CUDA here: the safetensors parser and its fuzz target use this header.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tvllm {

// Nothing we read (safetensors headers, config.json, the shard index) nests deeper than a few levels.
inline constexpr int kMaxJsonDepth = 64;

// Parses `text` as one JSON document. Throws InputError "WHAT: ..." on malformed JSON, a duplicate key
// (naming it), or nesting deeper than kMaxJsonDepth.
nlohmann::json parse_json_strict(std::string_view text, const std::string& what);

// True when `bytes` is well-formed UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF).
// On failure, *bad_offset (if given) is the offset of the first byte of the bad sequence.
bool is_valid_utf8(std::string_view bytes, size_t* bad_offset = nullptr);

// A JSON value for an error message, shortened: got "8" / got 3.5 / got [1,2,...].
std::string json_snippet(const nlohmann::json& value, size_t max_chars = 60);

}  // namespace tvllm
