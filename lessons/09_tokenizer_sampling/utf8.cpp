// UTF-8 helpers the tokenizer needs beyond lesson 01's validator (is_valid_utf8 in json_strict.h).
//
//   1 byte   0xxxxxxx                              U+0000..U+007F
//   2 bytes  110xxxxx 10xxxxxx                     U+0080..U+07FF
//   3 bytes  1110xxxx 10xxxxxx 10xxxxxx            U+0800..U+FFFF (not the surrogates D800..DFFF)
//   4 bytes  11110xxx 10xxxxxx 10xxxxxx 10xxxxxx   U+10000..U+10FFFF
#include <string>
#include <string_view>

#include "tokenizer_internal.h"

namespace tvllm::tok {

int utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 1;  // a continuation byte or an impossible lead: callers treat it as one (bad) byte
}

uint32_t utf8_decode_at(std::string_view s, size_t i, int* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  const int n = utf8_length(p[0]);
  *len = n;
  if (n == 1) return p[0];
  uint32_t cp = p[0] & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return cp;
}

void utf8_append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_unicode_whitespace(uint32_t cp) {
  // The Unicode White_Space property: a short, stable list.
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

namespace {

// The allowed range of the byte after `lead` (the strict rules: no overlong forms, no surrogates, nothing
// past U+10FFFF); every later byte is 80..BF.
void second_byte_range(unsigned char lead, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (lead == 0xE0) *lo = 0xA0;       // below: an overlong 3-byte form
  else if (lead == 0xED) *hi = 0x9F;  // above: a surrogate
  else if (lead == 0xF0) *lo = 0x90;  // below: an overlong 4-byte form
  else if (lead == 0xF4) *hi = 0x8F;  // above: past U+10FFFF
}

// How many bytes from p[0] (at most `avail`) are a valid start of one character; `need` its full length.
int valid_prefix(const unsigned char* p, size_t avail, int* need) {
  *need = utf8_length(p[0]);
  if (p[0] < 0x80) return 1;
  if (*need == 1) return 0;  // not a lead byte at all
  unsigned char lo, hi;
  second_byte_range(p[0], &lo, &hi);
  int k = 1;
  while (k < *need && static_cast<size_t>(k) < avail) {
    const unsigned char c = p[k];
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) break;
    ++k;
  }
  return k;
}

}  // namespace

size_t utf8_incomplete_tail(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  // The character in progress starts at most 3 bytes before the end.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = p[n - back];
    if (c >= 0x80 && c <= 0xBF) continue;  // a continuation byte: the lead is further back
    int need;
    const int have = valid_prefix(p + n - back, back, &need);
    return (have == static_cast<int>(back) && need > have) ? back : 0;
  }
  return 0;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      out += static_cast<char>(p[i++]);
      continue;
    }
    int need;
    const int have = valid_prefix(p + i, n - i, &need);
    if (have == need) {
      out.append(bytes.substr(i, need));
      i += need;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER for the whole maximal bad subpart
      i += have > 0 ? have : 1;
    }
  }
}

}  // namespace tvllm::tok
