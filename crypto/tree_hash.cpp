#include "crypto/tree_hash.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FEDMESH_TREE_HASH_AVX2 1
#endif

namespace fedmesh::crypto {
namespace {

constexpr size_t kBlock = 128;  // BLAKE2b's block
constexpr size_t kLeaves = 4;
constexpr size_t kStripe = kBlock * kLeaves;
constexpr uint8_t kLeafBytes = 64;

constexpr std::array<uint64_t, 8> kIv = {0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull,
                                         0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
                                         0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline uint64_t load64(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);  // little-endian, as BLAKE2 reads its words
  return x;
}

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

using Node = detail::TreeNode;

Node start_node(uint8_t digest_bytes, uint64_t node_offset, uint8_t node_depth, bool last_node) {
  Node node;
  node.h = kIv;
  // Parameter block words 0..2: digest length, key length 0, fanout 4,
  // depth 2, leaf length 0; node offset; node depth, inner length 64.
  node.h[0] ^= uint64_t{digest_bytes} | (uint64_t{kLeaves} << 16) | (uint64_t{2} << 24);
  node.h[1] ^= node_offset;
  node.h[2] ^= uint64_t{node_depth} | (uint64_t{kLeafBytes} << 8);
  node.last_node = last_node;
  return node;
}

void compress(Node& node, const uint8_t* block, bool final) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; ++i) {
    v[i] = node.h[i];
    v[i + 8] = kIv[i];
  }
  v[12] ^= node.counter;  // counters stay far below 2^64 bytes: the high word is 0
  if (final) {
    v[14] = ~v[14];
    if (node.last_node) v[15] = ~v[15];
  }
  const auto g = [&v](int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
  };
  for (const auto& s : kSigma) {
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) node.h[i] ^= v[i] ^ v[i + 8];
}

// Feeds a node blocks of `bytes` that start at `first` and follow every
// `stride` bytes (a leaf's share, or all of a root's input), the last one
// (partial or not; an empty input's is all zero) finalizing it.
void run_node(Node& node, std::span<const uint8_t> bytes, size_t first, size_t stride) {
  for (size_t at = first;; at += stride) {
    const size_t left = at < bytes.size() ? bytes.size() - at : 0;
    const bool last = at + stride >= bytes.size() || left <= kBlock;
    if (!last) {
      node.counter += kBlock;
      compress(node, bytes.data() + at, false);
      continue;
    }
    uint8_t block[kBlock] = {};
    const size_t n = left < kBlock ? left : kBlock;
    if (n > 0) std::memcpy(block, bytes.data() + at, n);
    node.counter += n;
    compress(node, block, true);
    return;
  }
}

void digest_bytes(const Node& node, uint8_t* out, size_t n) {
  uint8_t all[64];
  for (int i = 0; i < 8; ++i) std::memcpy(all + 8 * i, &node.h[i], 8);
  std::memcpy(out, all, n);
}

#ifdef FEDMESH_TREE_HASH_AVX2

#define FEDMESH_AVX2 __attribute__((target("avx2")))

FEDMESH_AVX2 inline __m256i rotr32(__m256i x) { return _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)); }
FEDMESH_AVX2 inline __m256i rotr24(__m256i x) {
  const __m256i mask = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10, 3, 4, 5, 6, 7, 0, 1, 2, 11,
                                        12, 13, 14, 15, 8, 9, 10);
  return _mm256_shuffle_epi8(x, mask);
}
FEDMESH_AVX2 inline __m256i rotr16(__m256i x) {
  const __m256i mask = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9, 2, 3, 4, 5, 6, 7, 0, 1, 10,
                                        11, 12, 13, 14, 15, 8, 9);
  return _mm256_shuffle_epi8(x, mask);
}
FEDMESH_AVX2 inline __m256i rotr63(__m256i x) { return _mm256_or_si256(_mm256_srli_epi64(x, 63), _mm256_add_epi64(x, x)); }

// Whole stripes at `data` that are none of the leaves' last blocks, one
// leaf a lane: h[w] holds word w of the four chain values.
FEDMESH_AVX2 void run_stripes_avx2(std::array<Node, kLeaves>& leaves, const uint8_t* data, size_t stripes) {
  if (stripes == 0) return;
  __m256i h[8];
  for (int w = 0; w < 8; ++w) {
    h[w] = _mm256_setr_epi64x(static_cast<long long>(leaves[0].h[w]), static_cast<long long>(leaves[1].h[w]),
                              static_cast<long long>(leaves[2].h[w]), static_cast<long long>(leaves[3].h[w]));
  }
  const __m256i iv[8] = {_mm256_set1_epi64x(static_cast<long long>(kIv[0])), _mm256_set1_epi64x(static_cast<long long>(kIv[1])),
                         _mm256_set1_epi64x(static_cast<long long>(kIv[2])), _mm256_set1_epi64x(static_cast<long long>(kIv[3])),
                         _mm256_set1_epi64x(static_cast<long long>(kIv[4])), _mm256_set1_epi64x(static_cast<long long>(kIv[5])),
                         _mm256_set1_epi64x(static_cast<long long>(kIv[6])), _mm256_set1_epi64x(static_cast<long long>(kIv[7]))};
  for (size_t s = 0; s < stripes; ++s) {
    const uint8_t* stripe = data + s * kStripe;
    __m256i m[16];
    for (int w = 0; w < 16; w += 4) {
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stripe + 0 * kBlock + 8 * w));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stripe + 1 * kBlock + 8 * w));
      const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stripe + 2 * kBlock + 8 * w));
      const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stripe + 3 * kBlock + 8 * w));
      const __m256i t0 = _mm256_unpacklo_epi64(r0, r1), t1 = _mm256_unpackhi_epi64(r0, r1);
      const __m256i t2 = _mm256_unpacklo_epi64(r2, r3), t3 = _mm256_unpackhi_epi64(r2, r3);
      m[w + 0] = _mm256_permute2x128_si256(t0, t2, 0x20);
      m[w + 1] = _mm256_permute2x128_si256(t1, t3, 0x20);
      m[w + 2] = _mm256_permute2x128_si256(t0, t2, 0x31);
      m[w + 3] = _mm256_permute2x128_si256(t1, t3, 0x31);
    }
    const uint64_t counter = leaves[0].counter + (s + 1) * kBlock;  // the same in every lane here
    __m256i v[16];
    for (int i = 0; i < 8; ++i) {
      v[i] = h[i];
      v[i + 8] = iv[i];
    }
    v[12] = _mm256_xor_si256(v[12], _mm256_set1_epi64x(static_cast<long long>(counter)));
#define FEDMESH_G(a, b, c, d, x, y)                                 \
  v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), x);         \
  v[d] = rotr32(_mm256_xor_si256(v[d], v[a]));                      \
  v[c] = _mm256_add_epi64(v[c], v[d]);                              \
  v[b] = rotr24(_mm256_xor_si256(v[b], v[c]));                      \
  v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), y);         \
  v[d] = rotr16(_mm256_xor_si256(v[d], v[a]));                      \
  v[c] = _mm256_add_epi64(v[c], v[d]);                              \
  v[b] = rotr63(_mm256_xor_si256(v[b], v[c]));
    for (const auto& sg : kSigma) {
      FEDMESH_G(0, 4, 8, 12, m[sg[0]], m[sg[1]])
      FEDMESH_G(1, 5, 9, 13, m[sg[2]], m[sg[3]])
      FEDMESH_G(2, 6, 10, 14, m[sg[4]], m[sg[5]])
      FEDMESH_G(3, 7, 11, 15, m[sg[6]], m[sg[7]])
      FEDMESH_G(0, 5, 10, 15, m[sg[8]], m[sg[9]])
      FEDMESH_G(1, 6, 11, 12, m[sg[10]], m[sg[11]])
      FEDMESH_G(2, 7, 8, 13, m[sg[12]], m[sg[13]])
      FEDMESH_G(3, 4, 9, 14, m[sg[14]], m[sg[15]])
    }
#undef FEDMESH_G
    for (int i = 0; i < 8; ++i) h[i] = _mm256_xor_si256(h[i], _mm256_xor_si256(v[i], v[i + 8]));
  }
  for (int w = 0; w < 8; ++w) {
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), h[w]);
    for (size_t leaf = 0; leaf < kLeaves; ++leaf) leaves[leaf].h[w] = lanes[leaf];
  }
  for (Node& leaf : leaves) leaf.counter += stripes * kBlock;
}

bool detect_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

#endif

// Whole stripes that are none of the leaves' last blocks, on AVX2 lanes
// where the CPU has them.
void run_stripes(std::array<Node, kLeaves>& leaves, const uint8_t* data, size_t stripes) {
#ifdef FEDMESH_TREE_HASH_AVX2
  if (tree_hash_uses_avx2()) {
    run_stripes_avx2(leaves, data, stripes);
    return;
  }
#endif
  for (size_t s = 0; s < stripes; ++s) {
    for (size_t i = 0; i < kLeaves; ++i) {
      leaves[i].counter += kBlock;
      compress(leaves[i], data + s * kStripe + i * kBlock, false);
    }
  }
}

// The stripes of `bytes` bytes that can be compressed before the end: each
// leaf keeps a block after them (its last, which finishes it). The bytes
// after them (385 to 896, or all of fewer than 385) are the finish's.
size_t stripes_before_the_last_blocks(size_t bytes) {
  return bytes > 3 * kBlock ? (bytes - 3 * kBlock - 1) / kStripe : 0;
}

std::array<Node, kLeaves> start_leaves() {
  std::array<Node, kLeaves> leaves;
  for (size_t i = 0; i < kLeaves; ++i) leaves[i] = start_node(kLeafBytes, i, 0, i + 1 == kLeaves);
  return leaves;
}

// Each leaf's remaining blocks of `rest` (which starts at a stripe), its
// last finalizing it, then the root over the four digests.
Hash finish_tree(std::array<Node, kLeaves>& leaves, std::span<const uint8_t> rest) {
  uint8_t digests[kLeaves * kLeafBytes];
  for (size_t i = 0; i < kLeaves; ++i) {
    run_node(leaves[i], rest, i * kBlock, kStripe);
    digest_bytes(leaves[i], digests + i * kLeafBytes, kLeafBytes);
  }
  Node root = start_node(static_cast<uint8_t>(kHashBytes), 0, 1, true);
  run_node(root, digests, 0, kBlock);
  Hash hash{};
  digest_bytes(root, hash.data(), hash.size());
  return hash;
}

}  // namespace

bool tree_hash_uses_avx2() {
#ifdef FEDMESH_TREE_HASH_AVX2
  static const bool supported = detect_avx2();
  return supported;
#else
  return false;
#endif
}

Hash tree_hash(std::span<const uint8_t> bytes) {
  std::array<Node, kLeaves> leaves = start_leaves();
  const size_t stripes = stripes_before_the_last_blocks(bytes.size());
  run_stripes(leaves, bytes.data(), stripes);
  return finish_tree(leaves, bytes.subspan(stripes * kStripe));
}

TreeHasher::TreeHasher() : leaves_(start_leaves()) {}

void TreeHasher::update(std::span<const uint8_t> bytes) {
  if (!pending_.empty()) {
    // Complete the pending stripe from the input; compress pending's whole
    // stripes that keep every leaf a block after them.
    const size_t take = std::min((kStripe - pending_.size() % kStripe) % kStripe, bytes.size());
    pending_.insert(pending_.end(), bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(take));
    bytes = bytes.subspan(take);
    const size_t available = pending_.size() + bytes.size();
    size_t stripes = pending_.size() / kStripe;
    while (stripes > 0 && available - stripes * kStripe <= 3 * kBlock) --stripes;
    run_stripes(leaves_, pending_.data(), stripes);
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(stripes * kStripe));
    if (!pending_.empty()) {  // too little input to go past them: it waits with them
      pending_.insert(pending_.end(), bytes.begin(), bytes.end());
      return;
    }
  }
  // Straight from the input, keeping the tail the finish needs.
  const size_t stripes = stripes_before_the_last_blocks(bytes.size());
  run_stripes(leaves_, bytes.data(), stripes);
  pending_.assign(bytes.begin() + static_cast<std::ptrdiff_t>(stripes * kStripe), bytes.end());
}

Hash TreeHasher::finish() { return finish_tree(leaves_, pending_); }

}  // namespace fedmesh::crypto
