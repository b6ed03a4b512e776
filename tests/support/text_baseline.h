// The bar a language-model federation must clear in a test: the bits per
// byte that a byte unigram of the whole corpus's training text (every
// document but its held-out last 5%) reaches on the held-out windows a
// simulation scores. A model that ignores context can do no better.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "train/data/text_corpus.h"
#include "train/data/tokenized_text.h"

namespace fedmesh::testing {

inline double byte_unigram_bits_per_byte(const train::data::TextCorpus& corpus, const train::data::TextWindows& held_out,
                                         int64_t context) {
  std::vector<size_t> all(corpus.documents.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = d;
  const train::data::TextSplit split = train::data::split_documents(corpus, all, train::data::kHeldOutText);
  const train::data::HeldOutBaseline baseline = train::data::held_out_baseline(split.train, held_out.tokens(), context, nullptr);
  return baseline.byte_unigram_loss / std::log(2.0);
}

}  // namespace fedmesh::testing
