// Lesson 01: the safetensors parser on hand-written bytes. Every malformed case must be rejected with an
// InputError whose message names the problem; every valid case must read back exactly the values written.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "common/errors.h"
#include "common/random.h"
#include "common/tensor.h"
#include "safetensors.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

using testing::Bytes;
using testing::raw_safetensors;
using testing::SafetensorsBuilder;
using testing::zeros;

SafetensorsHeader parse(const Bytes& b) { return parse_safetensors_header(b.data(), b.size(), b.size()); }

// Parsing must fail with an InputError whose message contains `needle`.
void expect_rejected(const Bytes& b, const std::string& needle) {
  try {
    parse(b);
    ADD_FAILURE() << "accepted a malformed file; expected an error mentioning: " << needle;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected it to mention: " << needle;
  }
}

// One tensor entry as JSON text, for hand-made headers.
std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}
std::string one(const std::string& name, const std::string& e) { return "{\"" + name + "\":" + e + "}"; }

// ---- the length prefix --------------------------------------------------------------------------------

TEST(SafetensorsParse, RejectsFilesShorterThanTheLengthField) {
  for (size_t n = 0; n < 8; ++n) expect_rejected(zeros(n), "too short");
}

TEST(SafetensorsParse, RejectsHeaderLengthPastEndOfFile) {
  const std::string h = one("a", entry("F32", "[1]", "[0,4]"));
  expect_rejected(raw_safetensors(h, zeros(4), static_cast<int64_t>(h.size() + 5)), "runs past the end of the file");
}

TEST(SafetensorsParse, RejectsAbsurdHeaderLength) {
  // Above the 100 MB cap, before even comparing with the file size: a lie here must not make us read or
  // allocate gigabytes.
  expect_rejected(raw_safetensors("{}", {}, 100'000'001), "limit");
  expect_rejected(raw_safetensors("{}", {}, std::numeric_limits<int64_t>::max()), "limit");
  Bytes all_ones(16, 0xFF);  // N = 2^64 - 1
  expect_rejected(all_ones, "limit");
}

TEST(SafetensorsParse, RejectsEmptyHeader) { expect_rejected(raw_safetensors("", {}), "empty"); }

TEST(SafetensorsParse, LengthIsLittleEndian) {
  // A header of exactly 0x0102 = 258 bytes: the file starts 02 01 00 00 00 00 00 00.
  std::string h = one("x", entry("U8", "[2]", "[0,2]"));
  h.resize(258, ' ');
  Bytes b = raw_safetensors(h, {7, 9});
  ASSERT_EQ(b[0], 0x02);
  ASSERT_EQ(b[1], 0x01);
  SafetensorsHeader hdr = parse(b);
  EXPECT_EQ(hdr.header_bytes, 258u);
  EXPECT_EQ(hdr.data_offset, 266u);
  ASSERT_EQ(hdr.entries.size(), 1u);
  EXPECT_EQ(b[hdr.data_offset + hdr.entries[0].begin], 7);
}

// ---- the header text ----------------------------------------------------------------------------------

TEST(SafetensorsParse, RejectsInvalidUtf8) {
  const std::string good = one("a", entry("U8", "[1]", "[0,1]"));
  for (std::string bad : {std::string("\xff"), std::string("\xc0\x80"),   // 0xFF never; C0 80 = overlong NUL
                          std::string("\xed\xa0\x80"),                    // a UTF-16 surrogate half
                          std::string("\xf4\x90\x80\x80"),                // above U+10FFFF
                          std::string("\xe2\x82")}) {                     // truncated 3-byte sequence
    std::string h = one("a" + bad, entry("U8", "[1]", "[0,1]"));
    expect_rejected(raw_safetensors(h, zeros(1)), "UTF-8");
  }
  // and valid multi-byte names are fine
  SafetensorsHeader ok = parse(raw_safetensors(one("gewicht_\xc3\xa4_\xe2\x82\xac_\xf0\x9f\x98\x80", entry("U8", "[1]", "[0,1]")), zeros(1)));
  EXPECT_EQ(ok.entries.at(0).name, "gewicht_\xc3\xa4_\xe2\x82\xac_\xf0\x9f\x98\x80");
  (void)good;
}

TEST(SafetensorsParse, RejectsNonJson) {
  expect_rejected(raw_safetensors("{not json}", {}), "not valid JSON");
  expect_rejected(raw_safetensors(R"({"a":{"dtype":"F32")", {}), "not valid JSON");  // truncated
  expect_rejected(raw_safetensors("{} {}", {}), "not valid JSON");                   // two documents
  expect_rejected(raw_safetensors(std::string("{}\0\0\0\0\0\0", 8), {}), "not valid JSON");  // NUL padding
}

TEST(SafetensorsParse, RejectsJsonThatIsNotAnObject) {
  expect_rejected(raw_safetensors("[1,2,3]", {}), "must be a JSON object");
  expect_rejected(raw_safetensors("\"text\"", {}), "must be a JSON object");
  expect_rejected(raw_safetensors("42", {}), "must be a JSON object");
  expect_rejected(raw_safetensors("null", {}), "must be a JSON object");
}

TEST(SafetensorsParse, RejectsDeepNesting) {
  std::string h = R"({"__metadata__":)" + std::string(200, '[') + std::string(200, ']') + "}";
  expect_rejected(raw_safetensors(h, {}), "nests deeper");
}

TEST(SafetensorsParse, RejectsDuplicateNames) {
  const std::string e = entry("F32", "[1]", "[0,4]");
  expect_rejected(raw_safetensors(R"({"a":)" + e + R"(,"a":)" + e + "}", zeros(4)), "duplicate key \"a\"");
  // and a duplicated field inside one entry
  expect_rejected(raw_safetensors(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", zeros(4)),
                  "duplicate key \"dtype\"");
}

// ---- one entry ----------------------------------------------------------------------------------------

TEST(SafetensorsParse, RejectsEntryThatIsNotAnObject) {
  expect_rejected(raw_safetensors(R"({"w":[1,2]})", {}), "tensor \"w\": entry must be a JSON object");
  expect_rejected(raw_safetensors(R"({"w":"F32"})", {}), "entry must be a JSON object");
}

TEST(SafetensorsParse, RejectsMissingFields) {
  expect_rejected(raw_safetensors(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", zeros(4)), "missing field \"dtype\"");
  expect_rejected(raw_safetensors(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", zeros(4)), "missing field \"shape\"");
  expect_rejected(raw_safetensors(R"({"w":{"dtype":"F32","shape":[1]}})", zeros(4)), "missing field \"data_offsets\"");
}

TEST(SafetensorsParse, RejectsExtraFields) {
  expect_rejected(raw_safetensors(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"offsets":[0,4]}})", zeros(4)),
                  "unknown field \"offsets\"");
}

TEST(SafetensorsParse, RejectsWrongFieldTypes) {
  expect_rejected(raw_safetensors(one("w", R"({"dtype":32,"shape":[1],"data_offsets":[0,4]})"), zeros(4)),
                  "dtype must be a string");
  expect_rejected(raw_safetensors(one("w", entry("F32", "\"1\"", "[0,4]")), zeros(4)), "shape must be an array");
  expect_rejected(raw_safetensors(one("w", entry("F32", "{\"0\":1}", "[0,4]")), zeros(4)), "shape must be an array");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "{\"begin\":0}")), zeros(4)),
                  "data_offsets must be an array");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[0]")), zeros(4)), "data_offsets must be an array");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[0,4,8]")), zeros(4)), "data_offsets must be an array");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[0,\"4\"]")), zeros(4)), "two non-negative integers");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[0,4.0]")), zeros(4)), "two non-negative integers");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[-4,0]")), zeros(4)), "two non-negative integers");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[0,1e40]")), zeros(4)), "two non-negative integers");
}

TEST(SafetensorsParse, RejectsUnknownDtypeNamingIt) {
  // F8_E4M3 and F8_E5M2 parse (lesson 16); newer 8-bit kinds are still unknown
  expect_rejected(raw_safetensors(one("w", entry("F8_E8M0", "[1]", "[0,1]")), zeros(1)), "unknown dtype \"F8_E8M0\"");
  expect_rejected(raw_safetensors(one("w", entry("f32", "[1]", "[0,4]")), zeros(4)), "unknown dtype \"f32\"");
  expect_rejected(raw_safetensors(one("w", entry("", "[1]", "[0,4]")), zeros(4)), "unknown dtype \"\"");
}

TEST(SafetensorsParse, RejectsNegativeOrFractionalShape) {
  expect_rejected(raw_safetensors(one("w", entry("F32", "[-1]", "[0,4]")), zeros(4)),
                  "shape[0] must be a non-negative integer, got -1");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1,2.0]", "[0,8]")), zeros(8)),
                  "shape[1] must be a non-negative integer, got 2.0");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[\"2\"]", "[0,8]")), zeros(8)),
                  "shape[0] must be a non-negative integer");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[null]", "[0,8]")), zeros(8)),
                  "shape[0] must be a non-negative integer");
  // 2^63 fits a uint64 but not an int64 dimension
  expect_rejected(raw_safetensors(one("w", entry("U8", "[9223372036854775808]", "[0,1]")), zeros(1)), "too large");
}

TEST(SafetensorsParse, RejectsShapeProductOverflow) {
  // 2^40 * 2^40 = 2^80: an unchecked uint64 product would wrap to 0 and "match" an empty byte range.
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1099511627776,1099511627776]", "[0,0]")), {}), "overflows");
  // 2^32 * 2^32 = 2^64 wraps to exactly 0
  expect_rejected(raw_safetensors(one("w", entry("U8", "[4294967296,4294967296]", "[0,0]")), {}), "overflows");
  // the element count fits, the byte count (x4) does not
  expect_rejected(raw_safetensors(one("w", entry("F32", "[4611686018427387904]", "[0,0]")), {}), "overflows");
  // ...and a zero dimension first is fine (the reference folds left to right too)
  SafetensorsHeader h = parse(raw_safetensors(one("w", entry("F32", "[0,1099511627776,1099511627776]", "[0,0]")), {}));
  EXPECT_EQ(h.entries.at(0).shape, (std::vector<int64_t>{0, int64_t{1} << 40, int64_t{1} << 40}));
}

TEST(SafetensorsParse, RejectsByteCountMismatch) {
  expect_rejected(raw_safetensors(one("w", entry("F32", "[2]", "[0,4]")), zeros(4)), "cover 4 bytes, but F32[2] needs 8");
  expect_rejected(raw_safetensors(one("w", entry("BF16", "[3]", "[0,8]")), zeros(8)), "needs 6");
  expect_rejected(raw_safetensors(one("w", entry("F32", "[]", "[0,0]")), {}), "needs 4");  // a scalar has 1 element
}

TEST(SafetensorsParse, RejectsBeginAfterEnd) {
  expect_rejected(raw_safetensors(one("w", entry("F32", "[1]", "[8,4]")), zeros(8)), "begin 8 is after end 4");
}

TEST(SafetensorsParse, RejectsEndPastDataSection) {
  expect_rejected(raw_safetensors(one("w", entry("F32", "[256]", "[0,1024]")), zeros(16)),
                  "end 1024 is past the end of the data section (16 bytes)");
  // huge offsets must not overflow any arithmetic either
  expect_rejected(raw_safetensors(one("w", entry("U8", "[1]", "[18446744073709551614,18446744073709551615]")), zeros(1)),
                  "past the end of the data section");
}

// ---- the layout of the data section -------------------------------------------------------------------

TEST(SafetensorsParse, RejectsOverlap) {
  std::string h = "{\"a\":" + entry("F32", "[2]", "[0,8]") + ",\"b\":" + entry("F32", "[2]", "[4,12]") + "}";
  expect_rejected(raw_safetensors(h, zeros(12)), "overlaps");
  // two tensors on the very same bytes
  h = "{\"a\":" + entry("F32", "[1]", "[0,4]") + ",\"b\":" + entry("F32", "[1]", "[0,4]") + "}";
  expect_rejected(raw_safetensors(h, zeros(4)), "overlaps");
}

TEST(SafetensorsParse, RejectsHole) {
  std::string h = "{\"a\":" + entry("F32", "[1]", "[0,4]") + ",\"b\":" + entry("F32", "[1]", "[8,12]") + "}";
  expect_rejected(raw_safetensors(h, zeros(12)), "hole in the data section: bytes 4..8");
  // a hole at the very start
  expect_rejected(raw_safetensors(one("a", entry("F32", "[1]", "[4,8]")), zeros(8)), "bytes 0..4");
}

TEST(SafetensorsParse, RejectsTrailingBytes) {
  expect_rejected(raw_safetensors(one("a", entry("F32", "[1]", "[0,4]")), zeros(5)), "1 trailing bytes");
  expect_rejected(raw_safetensors("{}", zeros(3)), "3 trailing bytes");
}

TEST(SafetensorsParse, RejectsBadMetadata) {
  const std::string e = entry("U8", "[1]", "[0,1]");
  expect_rejected(raw_safetensors(R"({"__metadata__":3,"a":)" + e + "}", zeros(1)), "__metadata__ must be an object");
  expect_rejected(raw_safetensors(R"({"__metadata__":["x"],"a":)" + e + "}", zeros(1)), "__metadata__ must be an object");
  expect_rejected(raw_safetensors(R"({"__metadata__":{"format":1},"a":)" + e + "}", zeros(1)),
                  "__metadata__[\"format\"] must be a string");
  expect_rejected(raw_safetensors(R"({"__metadata__":{"x":{"y":"z"}},"a":)" + e + "}", zeros(1)), "must be a string");
  expect_rejected(raw_safetensors(R"({"__metadata__":{"k":"v"},"__metadata__":{},"a":)" + e + "}", zeros(1)),
                  "duplicate key \"__metadata__\"");
}

// ---- valid files ------------------------------------------------------------------------------------

TEST(SafetensorsParse, AcceptsEmptyFileOfTensors) {
  SafetensorsHeader h = parse(raw_safetensors("{}", {}));
  EXPECT_TRUE(h.entries.empty());
  EXPECT_EQ(h.data_offset, 10u);
}

TEST(SafetensorsParse, AcceptsMetadataAndNullMetadata) {
  Bytes b = SafetensorsBuilder().metadata("format", "pt").metadata("note", "caf\xc3\xa9").add("a", "U8", {1}, {5}).build();
  SafetensorsHeader h = parse(b);
  ASSERT_EQ(h.metadata.size(), 2u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.metadata.at("note"), "caf\xc3\xa9");
  // null means "none", as the reference reads it
  h = parse(raw_safetensors(R"({"__metadata__":null,"a":)" + entry("U8", "[1]", "[0,1]") + "}", zeros(1)));
  EXPECT_TRUE(h.metadata.empty());
  EXPECT_EQ(h.entries.size(), 1u);
}

TEST(SafetensorsParse, EntriesAreSortedByOffsetWhateverTheJsonOrder) {
  std::string h = "{\"z_first\":" + entry("U8", "[2]", "[0,2]") + ",\"a_last\":" + entry("U8", "[3]", "[2,5]") +
                  ",\"m_empty\":" + entry("F32", "[0,7]", "[5,5]") + "}";
  SafetensorsHeader hdr = parse(raw_safetensors(h, zeros(5)));
  ASSERT_EQ(hdr.entries.size(), 3u);
  EXPECT_EQ(hdr.entries[0].name, "z_first");
  EXPECT_EQ(hdr.entries[1].name, "a_last");
  EXPECT_EQ(hdr.entries[2].name, "m_empty");
  EXPECT_EQ(hdr.entries[1].begin, 2u);
  EXPECT_EQ(hdr.entries[1].end, 5u);
}

TEST(SafetensorsParse, AcceptsZeroSizeTensorsAnywhere) {
  Bytes b = SafetensorsBuilder()
                .add("empty_first", "F32", {0}, {})
                .add("x", "F32", {1}, testing::f32_bytes({1.f}))
                .add("empty_mid", "BF16", {3, 0, 5}, {})
                .add("y", "U8", {3}, {1, 2, 3})
                .add("empty_last", "I64", {0}, {})
                .build();
  SafetensorsHeader h = parse(b);
  ASSERT_EQ(h.entries.size(), 5u);
  for (const SafetensorsEntry& e : h.entries) EXPECT_LE(e.begin, e.end);
}

TEST(SafetensorsParse, AcceptsHeaderPaddedWithSpaces) {
  std::string h = one("a", entry("U8", "[1]", "[0,1]")) + std::string(13, ' ');
  EXPECT_EQ(parse(raw_safetensors(h, zeros(1))).entries.size(), 1u);
}

TEST(SafetensorsParse, AcceptsEveryDtype) {
  const std::pair<const char*, size_t> dtypes[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                   {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1},
                                                   {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (auto [name, size] : dtypes) {
    SafetensorsHeader h = parse(SafetensorsBuilder().add("t", name, {3}, zeros(3 * size)).build());
    ASSERT_EQ(h.entries.size(), 1u) << name;
    EXPECT_EQ(dtype_name(h.entries[0].dtype), name);
  }
}

// A mutation test: flip random bytes of a valid file. Each result must either parse or be rejected with
// an InputError - never another exception, a crash, or (under ASan) an out-of-bounds read.
TEST(SafetensorsParse, RandomCorruptionsNeverCrash) {
  const Bytes valid = SafetensorsBuilder()
                          .metadata("format", "pt")
                          .add("model.embed_tokens.weight", "BF16", {4, 3}, zeros(24))
                          .add("model.norm.weight", "F32", {3}, testing::f32_bytes({1.f, 2.f, 3.f}))
                          .add("scalar", "F16", {}, zeros(2))
                          .build();
  Rng rng(20240101);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    Bytes b = valid;
    int flips = 1 + static_cast<int>(rng.below(4));
    for (int f = 0; f < flips; ++f) b[rng.below(static_cast<int64_t>(b.size()))] = static_cast<uint8_t>(rng.next_u64());
    if (rng.below(4) == 0) b.resize(rng.below(static_cast<int64_t>(b.size()) + 1));  // truncate sometimes
    try {
      parse(b);
      ++accepted;
    } catch (const InputError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);  // most corruptions are caught...
  EXPECT_GT(accepted, 0);     // ...while flips inside tensor data are, correctly, still valid files
}

// ---- SafetensorsFile: the same through a real file ------------------------------------------------------

TEST(SafetensorsFile, ReadsKnownValuesOfEachFloatDtype) {
  testing::TempDir dir;
  // bf16: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00;  fp16: 1.0 = 0x3C00, 3.140625 = 0x4248, -0.5 = 0xB800
  Bytes b = SafetensorsBuilder()
                .add("bf16", "BF16", {3}, testing::u16_bytes({0x3F80, 0xC000, 0x3F00}))
                .add("f16", "F16", {3}, testing::u16_bytes({0x3C00, 0x4248, 0xB800}))
                .add("f32", "F32", {2, 2}, testing::f32_bytes({0.1f, -7.25f, 1e30f, -0.0f}))
                .add("scalar", "F32", {}, testing::f32_bytes({42.5f}))
                .add("ids", "I32", {2}, testing::i32_bytes({-1, 128000}))
                .build();
  testing::write_file(dir / "t.safetensors", b);
  auto f = SafetensorsFile::open(dir / "t.safetensors");
  ASSERT_EQ(f->entries().size(), 5u);

  TensorView bf = f->host_view("bf16");
  EXPECT_EQ(bf.dtype, DType::BF16);
  EXPECT_EQ(bf.shape, (Shape{3}));
  EXPECT_EQ(bf.device, Device::CPU);
  EXPECT_EQ(to_f32_vector(bf), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ(to_f32_vector(f->host_view("f16")), (std::vector<float>{1.0f, 3.140625f, -0.5f}));
  TensorView f32 = f->host_view("f32");
  EXPECT_EQ(f32.shape, (Shape{2, 2}));
  std::vector<float> v = to_f32_vector(f32);
  EXPECT_EQ(v[0], 0.1f);
  EXPECT_EQ(v[1], -7.25f);
  EXPECT_EQ(v[2], 1e30f);
  EXPECT_TRUE(std::signbit(v[3]));
  TensorView s = f->host_view("scalar");
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(*s.ptr<float>(), 42.5f);
  TensorView ids = f->host_view("ids");
  EXPECT_EQ(ids.ptr<int32_t>()[0], -1);
  EXPECT_EQ(ids.ptr<int32_t>()[1], 128000);

  // raw bytes: the first BF16 value sits right at the start of the data section
  const SafetensorsEntry* e = f->find("bf16");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(f->tensor_bytes(*e)[0], 0x80);
  EXPECT_EQ(f->tensor_bytes(*e)[1], 0x3F);
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(SafetensorsFile, MisalignedTensorsAreReadThroughAnAlignedCopy) {
  testing::TempDir dir;
  // BF16[1] first puts the F32 at data offset 2: not a multiple of 4 in the file.
  Bytes b = SafetensorsBuilder()
                .add("odd", "BF16", {1}, testing::u16_bytes({0x3F80}))
                .add("f", "F32", {2}, testing::f32_bytes({3.5f, -1.25f}))
                .build();
  testing::write_file(dir / "m.safetensors", b);
  auto file = SafetensorsFile::open(dir / "m.safetensors");
  TensorView v = file->host_view("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % alignof(float), 0u);
  EXPECT_EQ(v.ptr<float>()[0], 3.5f);
  EXPECT_EQ(v.ptr<float>()[1], -1.25f);
  // the raw bytes in the mapping are still there, unaligned
  EXPECT_EQ(reinterpret_cast<uintptr_t>(file->tensor_bytes(*file->find("f"))) % 4, 2u);
}

TEST(SafetensorsFile, ErrorsNameTheFileAndTheProblem) {
  testing::TempDir dir;
  auto expect_open_error = [](const std::filesystem::path& p, const std::string& needle) {
    try {
      SafetensorsFile::open(p);
      ADD_FAILURE() << "opened " << p;
    } catch (const InputError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg << "\nexpected: " << needle;
    }
  };
  expect_open_error(dir / "missing.safetensors", "no such file");
  expect_open_error(dir.path(), "is a directory");
  // a FIFO must be refused, not waited on forever
  ASSERT_EQ(mkfifo((dir / "fifo.safetensors").c_str(), 0600), 0);
  expect_open_error(dir / "fifo.safetensors", "not a regular file");
  testing::write_file(dir / "empty.safetensors", Bytes{});
  expect_open_error(dir / "empty.safetensors", "empty");
  testing::write_file(dir / "short.safetensors", Bytes{1, 2, 3});
  expect_open_error(dir / "short.safetensors", "too short");
  testing::write_file(dir / "trailing.safetensors", raw_safetensors(one("a", entry("U8", "[1]", "[0,1]")), zeros(2)));
  expect_open_error(dir / "trailing.safetensors", "trailing bytes");
  EXPECT_THROW(SafetensorsFile::open(dir / "trailing.safetensors"), InputError);

  testing::write_file(dir / "ok.safetensors", SafetensorsBuilder().add("a", "U8", {1}, {1}).build());
  auto f = SafetensorsFile::open(dir / "ok.safetensors");
  try {
    f->host_view("b");
    ADD_FAILURE();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor named \"b\""), std::string::npos) << e.what();
  }
}

TEST(Fnv1a64, KnownAnswers) {
  // Published FNV-1a 64 test vectors.
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
  // continuing over pieces equals hashing the whole
  EXPECT_EQ(fnv1a64("bar", 3, fnv1a64("foo", 3)), fnv1a64("foobar", 6));
  EXPECT_EQ(fnv1a64_hex(0xaf63dc4c8601ec8cull), "af63dc4c8601ec8c");
  EXPECT_EQ(fnv1a64_hex(0x1), "0000000000000001");
}

}  // namespace
}  // namespace tvllm
