// Lesson 02, the CPU side: the conversions on views (CPU path and argument checks), rounding by
// definition, and the experiments the chapter quotes.
#include <algorithm>
#include <cmath>

#include "bf16.h"
#include "common/errors.h"
#include "common/exercise.h"
#include "common/random.h"

namespace tvllm {

const std::vector<std::string>& bf16_kernel_versions() {
  static const std::vector<std::string> versions = {"v1", "v2", "v3"};
  return versions;
}

namespace {

void require_pair(const char* what, const TensorView& out, DType out_dtype, const TensorView& x, DType x_dtype) {
  const std::string name = what;
  TVLLM_REQUIRE(x.dtype == x_dtype && out.dtype == out_dtype,
                name + ": expects x " + std::string(dtype_name(x_dtype)) + " and out " +
                    std::string(dtype_name(out_dtype)) + ", got x " + x.describe() + " and out " + out.describe());
  TVLLM_REQUIRE(x.numel() == out.numel(), name + ": x " + x.describe() + " and out " + out.describe() +
                                              " have different element counts");
  TVLLM_REQUIRE(x.device == out.device,
                name + ": x " + x.describe() + " and out " + out.describe() + " are on different devices");
  TVLLM_REQUIRE(x.is_contiguous() && out.is_contiguous(), name + ": x and out must be contiguous");
  TVLLM_REQUIRE(x.numel() == 0 || (x.data && out.data), name + ": null data pointer");
}

}  // namespace

void convert_f32_to_bf16(const TensorView& out, const TensorView& x, const std::string& kernel,
                         cudaStream_t stream) {
  require_pair("convert_f32_to_bf16", out, DType::BF16, x, DType::F32);
  const std::vector<std::string>& versions = bf16_kernel_versions();
  TVLLM_REQUIRE(std::find(versions.begin(), versions.end(), kernel) != versions.end(),
                "convert_f32_to_bf16: unknown kernel '" + kernel + "' (expected v1, v2 or v3)");
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    const float* in = x.ptr<float>();
    uint16_t* o = out.ptr<uint16_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(in[i]);
  } else {
    f32_to_bf16_cuda(out.ptr<uint16_t>(), x.ptr<float>(), n, kernel, stream);
  }
}

void convert_bf16_to_f32(const TensorView& out, const TensorView& x, cudaStream_t stream) {
  require_pair("convert_bf16_to_f32", out, DType::F32, x, DType::BF16);
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    const uint16_t* in = x.ptr<uint16_t>();
    float* o = out.ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = bf16_to_f32(in[i]);
  } else {
    bf16_to_f32_cuda(out.ptr<float>(), x.ptr<uint16_t>(), n, stream);
  }
}

void convert_f32_to_f16(const TensorView& out, const TensorView& x, cudaStream_t stream) {
  require_pair("convert_f32_to_f16", out, DType::F16, x, DType::F32);
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    const float* in = x.ptr<float>();
    uint16_t* o = out.ptr<uint16_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_f16(in[i]);
  } else {
    f32_to_f16_cuda(out.ptr<uint16_t>(), x.ptr<float>(), n, stream);
  }
}

void fill_f32_bit_patterns(const TensorView& x, uint32_t first, cudaStream_t stream) {
  TVLLM_REQUIRE(x.dtype == DType::F32 && x.is_contiguous(),
                "fill_f32_bit_patterns: expects a contiguous F32 view, got " + x.describe());
  const int64_t n = x.numel();
  if (x.device == Device::CPU) {
    uint32_t* bits = x.ptr<uint32_t>();
    for (int64_t i = 0; i < n; ++i) bits[i] = first + static_cast<uint32_t>(i);
  } else {
    fill_f32_bit_patterns_cuda(x.ptr<uint32_t>(), n, first, stream);
  }
}

// ---- rounding by definition ----------------------------------------------------------------------------

namespace {

struct Format {
  int significant_bits;  // p, counting the implicit leading 1: bf16 8, fp16 11
  int exponent_bits;     // bf16 8, fp16 5
  int min_exponent;      // exponent of the smallest normal number: bf16 -126, fp16 -14
  int max_exponent;      // exponent of the largest finite number, also the bias: bf16 127, fp16 15
};
constexpr Format kBf16Format{8, 8, -126, 127};
constexpr Format kF16Format{11, 5, -14, 15};

uint16_t round_by_definition(float x, const Format& f) {
  // --- exercise 02.1: rounding by definition --------------------------------------------------------
  // Task: return the bits of the value of format f (bf16 or fp16) nearest to x, found the slow and
  //   obvious way: take the two neighbours of |x| in the format, compare their distances in double
  //   arithmetic, keep the nearer (on a tie, the one whose last mantissa bit is 0), and encode it with
  //   the sign of x. Overflow (rounding to 2^(max_exponent + 1) or beyond) gives inf, NaN the canonical
  //   quiet NaN (all-ones exponent, top mantissa bit set, the sign of x). Share no line with
  //   common/dtype.h: this is the oracle the bit tricks are checked against.
  // Hint: std::frexp(a, &e) puts a in [2^(e-1), 2^e); below 2^min_exponent the spacing stays that of the
  //   smallest normal binade (the subnormals). spacing = 2^(binade - (significant_bits - 1)).
  // Hint: every step is exact in double: |x| has at most 24 significant bits and the spacing is a power
  //   of two. Rounding up may carry into the next binade: find the exponent of the rounded value.
  // Tests: RoundByDefinition.AgreesWithTheFastConversionsOnRandomPatterns RoundByDefinition.KnownAnswers
  // Tests: RoundByDefinition.EveryBf16TieGoesToEven lesson02_bf16.cpu
  // Stub:
  //   (void)x, (void)f;
  //   throw NotWrittenYet("02.1", "rounding by definition");
  // --- solution ---
  const int mbits = f.significant_bits - 1;  // stored mantissa bits
  const uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
  const uint32_t all_ones = ((1u << f.exponent_bits) - 1u) << mbits;  // the exponent field of inf and NaN
  if (std::isnan(x)) return static_cast<uint16_t>(sign | all_ones | (1u << (mbits - 1)));
  if (std::isinf(x)) return static_cast<uint16_t>(sign | all_ones);
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return static_cast<uint16_t>(sign);

  // The spacing of the format's values around a: 2^(e - mbits) in the binade [2^e, 2^(e+1)), and the
  // fixed spacing of the smallest normal binade all the way down to zero (the subnormals).
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1), so a is in [2^(e-1), 2^e)
  const int binade = std::max(e - 1, f.min_exponent);
  const double spacing = std::ldexp(1.0, binade - mbits);
  // The two neighbours are below = floor(a / spacing) * spacing and below + spacing. All exact: a has
  // at most 24 significant bits and the spacing is a power of two.
  const double steps = a / spacing;
  const double below = std::floor(steps);
  const double distance_below = steps - below;  // in units of the spacing; the other is 1 - this
  double chosen;
  if (distance_below < 0.5) {
    chosen = below;
  } else if (distance_below > 0.5) {
    chosen = below + 1;
  } else {
    chosen = std::fmod(below, 2.0) == 0.0 ? below : below + 1;  // a tie: the even one
  }
  const double value = chosen * spacing;
  // Rounding up past the largest finite value lands on 2^(max_exponent + 1): that is overflow, inf.
  if (value >= std::ldexp(1.0, f.max_exponent + 1)) return static_cast<uint16_t>(sign | all_ones);
  if (value < std::ldexp(1.0, f.min_exponent)) {
    // subnormal: exponent field 0, the mantissa counts spacings
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(value / spacing));
  }
  int ve = 0;
  std::frexp(value, &ve);  // rounding up may have moved the value into the next binade
  const int value_binade = ve - 1;
  const uint32_t exponent_field = static_cast<uint32_t>(value_binade + f.max_exponent);
  const uint32_t mantissa =
      static_cast<uint32_t>(value / std::ldexp(1.0, value_binade - mbits)) - (1u << mbits);  // drop the leading 1
  return static_cast<uint16_t>(sign | (exponent_field << mbits) | mantissa);
  // --- end of exercise 02.1 ---
}

}  // namespace

uint16_t bf16_round_by_definition(float x) { return round_by_definition(x, kBf16Format); }
uint16_t f16_round_by_definition(float x) { return round_by_definition(x, kF16Format); }

// ---- experiments -------------------------------------------------------------------------------------

namespace {

float through_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
float through_f16(float x) { return f16_to_f32(f32_to_f16(x)); }

RangeRow range_row(std::string what, double exact) {
  float f = static_cast<float>(exact);
  return RangeRow{std::move(what), exact, f, through_f16(f), through_bf16(f)};
}

}  // namespace

std::vector<RangeRow> range_experiments() {
  std::vector<RangeRow> rows;
  rows.push_back(range_row("0.1", 0.1));
  rows.push_back(range_row("257 (an integer)", 257.0));
  rows.push_back(range_row("3000 (an activation outlier)", 3000.0));
  rows.push_back(range_row("65504 (largest fp16)", 65504.0));
  rows.push_back(range_row("3000^2 (one square in RMSNorm)", 3000.0 * 3000.0));
  // the sum of squares RMSNorm computes over a 2048-wide row of ordinary activations, std 8
  Rng rng(7);
  double sum_sq = 0.0;
  for (int i = 0; i < 2048; ++i) {
    double v = 8.0 * rng.normal();
    sum_sq += v * v;
  }
  rows.push_back(range_row("sum of 2048 squares, std 8", sum_sq));
  rows.push_back(range_row("exp(12) (softmax, max not subtracted)", std::exp(12.0)));
  rows.push_back(range_row("exp(40)", std::exp(40.0)));
  rows.push_back(range_row("1e-6 (an fp16 subnormal: 4 bits left)", 1e-6));
  rows.push_back(range_row("1e-8 (a tiny probability)", 1e-8));
  rows.push_back(range_row("1e-30", 1e-30));
  rows.push_back(range_row("3.4e38 (near fp32's largest)", 3.4e38));
  return rows;
}

std::vector<PrecisionRow> precision_experiments(int64_t n, uint64_t seed) {
  // log-uniform over [2^-10, 2^10): every binade equally often, inside fp16's normal range
  Rng rng(seed);
  double worst_f32 = 0, worst_f16 = 0, worst_bf16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    // fp32's own rounding: a double (with more bits than a float) rounded once to fp32
    double d = std::exp2(20.0 * (rng.next_u64() >> 11) * 0x1p-53 - 10.0);
    float f = static_cast<float>(d);
    worst_f32 = std::max(worst_f32, std::fabs(f - d) / d);
    // fp16 and bf16: that fp32 value rounded once more (x is exact; only this rounding counts)
    double x = f;
    worst_f16 = std::max(worst_f16, std::fabs(through_f16(f) - x) / x);
    worst_bf16 = std::max(worst_bf16, std::fabs(through_bf16(f) - x) / x);
  }
  return {
      {"fp32", 24, std::ldexp(1.0, -24), worst_f32},
      {"fp16", 11, std::ldexp(1.0, -11), worst_f16},
      {"bf16", 8, std::ldexp(1.0, -8), worst_bf16},
  };
}

std::vector<BiasRow> bias_experiments(int64_t n, uint64_t seed) {
  std::vector<BiasRow> rows;
  for (bool positive : {false, true}) {
    Rng rng(seed);
    double trunc_rel = 0, rne_rel = 0, exact_sum = 0, abs_sum = 0, trunc_sum = 0, rne_sum = 0;
    int64_t counted = 0;
    for (int64_t i = 0; i < n; ++i) {
      float x = rng.normal();
      if (positive) x = std::fabs(x);
      if (x == 0.0f) continue;
      float t = bf16_to_f32(f32_to_bf16_truncate(x));
      float r = bf16_to_f32(f32_to_bf16(x));
      // signed error of the magnitude: negative means "moved towards zero"
      trunc_rel += (std::fabs(t) - std::fabs(x)) / std::fabs(static_cast<double>(x));
      rne_rel += (std::fabs(r) - std::fabs(x)) / std::fabs(static_cast<double>(x));
      exact_sum += x;
      abs_sum += std::fabs(x);
      trunc_sum += t;
      rne_sum += r;
      ++counted;
    }
    rows.push_back(BiasRow{positive ? "|N(0,1)| (all positive)" : "N(0,1)", trunc_rel / counted, rne_rel / counted,
                           (trunc_sum - exact_sum) / abs_sum, (rne_sum - exact_sum) / abs_sum});
  }
  return rows;
}

float count_in_bf16(int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total = through_bf16(total + 1.0f);  // the sum is exact in fp32, then rounded
  return total;
}

float count_in_f16(int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total = through_f16(total + 1.0f);
  return total;
}

}  // namespace tvllm
