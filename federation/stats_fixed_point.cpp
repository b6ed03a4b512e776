#include "federation/stats_fixed_point.h"

#include <array>
#include <cmath>

namespace fedmesh::federation {

namespace {

using train::data::DataStats;
using Wide = std::array<uint64_t, 3>;  // 192 bits, least significant word first

void negate(Wide& w) {
  uint64_t carry = 1;
  for (uint64_t& word : w) {
    word = ~word + carry;
    carry = (carry != 0 && word == 0) ? 1 : 0;
  }
}

// round(v * 2^kStatsFractionBits) in two's complement; false when |v| is
// 2^kStatsMagnitudeBits or more (or not finite).
bool to_fixed(double v, Wide& out) {
  out = {0, 0, 0};
  if (!std::isfinite(v) || std::fabs(v) >= std::ldexp(1.0, kStatsMagnitudeBits)) return false;
  if (v == 0.0) return true;
  int exponent = 0;
  const double fraction = std::frexp(std::fabs(v), &exponent);  // |v| = fraction 2^exponent, fraction in [0.5, 1)
  const auto mantissa = static_cast<uint64_t>(std::ldexp(fraction, 53));  // exact: |v| = mantissa 2^(exponent - 53)
  const int shift = exponent - 53 + kStatsFractionBits;
  if (shift >= 0) {  // mantissa < 2^53 and shift + 53 <= 183: within the 192 bits
    const int word = shift / 64, offset = shift % 64;
    out[static_cast<size_t>(word)] |= mantissa << offset;
    if (offset > 0 && word + 1 < 3) out[static_cast<size_t>(word) + 1] |= mantissa >> (64 - offset);
  } else if (-shift <= 53) {  // round half up
    const int right = -shift;
    out[0] = (mantissa >> right) + ((mantissa >> (right - 1)) & 1u);
  }
  if (v < 0.0) negate(out);
  return true;
}

void put_limbs(const Wide& w, uint32_t* words) {
  for (size_t k = 0; k < kStatsLimbs; ++k) {
    words[k] = static_cast<uint32_t>((w[k / 4] >> (kStatsLimbBits * (k % 4))) & 0xffffu);
  }
}

// Carries the summed limbs over into one 192-bit number (mod 2^192).
Wide from_limbs(const uint32_t* words) {
  Wide w{0, 0, 0};
  uint64_t carry = 0;
  for (size_t k = 0; k < kStatsLimbs; ++k) {
    carry += words[k];
    w[k / 4] |= (carry & 0xffffu) << (kStatsLimbBits * (k % 4));
    carry >>= kStatsLimbBits;
  }
  return w;
}

bool negative(const Wide& w) { return (w[2] >> 63) != 0; }

double to_double(Wide w) {
  const bool minus = negative(w);
  if (minus) negate(w);
  const double magnitude = std::ldexp(static_cast<double>(w[2]), 128 - kStatsFractionBits) +
                           std::ldexp(static_cast<double>(w[1]), 64 - kStatsFractionBits) +
                           std::ldexp(static_cast<double>(w[0]), -kStatsFractionBits);
  return minus ? -magnitude : magnitude;
}

}  // namespace

std::string stats_secagg_label(const std::string& federation) { return federation + "#stats"; }

Result<std::vector<uint32_t>> encode_stats_words(const DataStats& stats) {
  std::vector<uint32_t> words(stats.features.size() * kStatsWordsPerFeature);
  for (size_t i = 0; i < stats.features.size(); ++i) {
    const train::data::FeatureSums& f = stats.features[i];
    const double values[3] = {static_cast<double>(f.count), f.sum, f.sum_squares};
    const char* what[3] = {"count", "sum", "sum of squares"};
    for (size_t q = 0; q < 3; ++q) {
      Wide fixed;
      if (f.count < 0 || !to_fixed(values[q], fixed)) {
        return invalid_argument("statistics: the " + std::string(what[q]) + " of '" + f.name.substr(0, 64) + "' (" +
                                std::to_string(values[q]) + ") is beyond what secure aggregation adds up (|value| < 2^" +
                                std::to_string(kStatsMagnitudeBits) + ")");
      }
      put_limbs(fixed, words.data() + i * kStatsWordsPerFeature + q * kStatsLimbs);
    }
  }
  return words;
}

Result<DataStats> decode_stats_words(std::span<const uint32_t> summed, const DataStats& schema, int64_t parts) {
  if (summed.size() != schema.features.size() * kStatsWordsPerFeature) {
    return invalid_argument("statistics: " + std::to_string(summed.size()) + " summed words for " +
                            std::to_string(schema.features.size()) + " features (" +
                            std::to_string(kStatsWordsPerFeature) + " each)");
  }
  DataStats out;
  out.kind = schema.kind;
  out.parts = parts;
  for (size_t i = 0; i < schema.features.size(); ++i) {
    const uint32_t* words = summed.data() + i * kStatsWordsPerFeature;
    const std::string name = schema.features[i].name;
    const auto refuse = [&](const std::string& why) {
      return invalid_argument("statistics: the masked sum is not statistics: '" + name.substr(0, 64) + "' " + why +
                              " (a site masked words that are not its sums)");
    };
    const Wide count = from_limbs(words);
    // A whole number: no fraction bits (all of word 0, the low 16 of word 1), 1 <= count < 2^62.
    const uint64_t whole = (count[1] >> 16) | (count[2] << 48);
    if (negative(count) || count[0] != 0 || (count[1] & 0xffffu) != 0 || (count[2] >> 14) != 0 || whole < 1 ||
        whole >= (uint64_t{1} << 62)) {
      return refuse("has a count that is not a whole number of values");
    }
    train::data::FeatureSums f{name, static_cast<int64_t>(whole), to_double(from_limbs(words + kStatsLimbs)),
                               to_double(from_limbs(words + 2 * kStatsLimbs))};
    if (f.sum_squares < 0.0) return refuse("has a negative sum of squares");
    out.features.push_back(std::move(f));
  }
  return out;
}

}  // namespace fedmesh::federation
