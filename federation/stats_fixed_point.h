// The normalization statistics as secure aggregation adds them up (private
// mode): every count, sum and sum of squares of a node's DataStats becomes a
// 192-bit two's-complement fixed-point number with 80 fraction bits, cut in
// twelve 16-bit limbs, one limb per 32-bit word. The masks cancel mod 2^32
// word by word, and a word's limbs from at most 255 sites stay below 2^24,
// so no word wraps: carrying the summed limbs over gives the sum of the
// sites' numbers exactly (each rounded once, at its site, to 2^-81).
//
// A site's values must stay within ±2^103 (about 10^31) so that 255 of them
// cannot overflow; a larger one is refused naming its feature. The summed
// words are the aggregator's untrusted input (a site may mask any words):
// decoding checks that every count is a whole number >= 1 and every sum of
// squares >= 0, and refuses the sum otherwise.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "train/data/data_stats.h"

namespace fedmesh::federation {

inline constexpr int kStatsLimbBits = 16;
inline constexpr size_t kStatsLimbs = 12;          // 192 bits
inline constexpr int kStatsFractionBits = 80;
inline constexpr int kStatsMagnitudeBits = 103;    // |value| < 2^103 at one site
inline constexpr size_t kStatsWordsPerFeature = 3 * kStatsLimbs;  // count, sum, sum of squares

// What a secure-aggregation session's signatures bind the statistics to:
// the federation's name with "#stats", so that nothing signed for the
// statistics can stand for a training round's session or the other way.
std::string stats_secagg_label(const std::string& federation);

// The words of `stats` (features in order; count, sum, sum of squares each
// as kStatsLimbs words). kInvalidArgument naming the feature whose value is
// out of range or not finite.
Result<std::vector<uint32_t>> encode_stats_words(const train::data::DataStats& stats);

// The statistics in `summed` (the words of `parts` sites added mod 2^32),
// with the kind and feature names of `schema`. kInvalidArgument for a length
// that does not fit the schema or a sum that is not statistics (naming the
// feature).
Result<train::data::DataStats> decode_stats_words(std::span<const uint32_t> summed,
                                                  const train::data::DataStats& schema, int64_t parts);

}  // namespace fedmesh::federation
