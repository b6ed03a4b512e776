// Site identities: an Ed25519 key pair (signatures on updates and on the
// roster) and a Curve25519 key pair (CurveZMQ transport encryption), made by
// `fedmesh keygen` and kept in two files:
//
//   DIR/NAME.key  mode 0600, the secret and public halves of both pairs
//   DIR/NAME.pub  mode 0644, the public halves only (what goes on a roster)
//
// Both are small TOML documents with hex-encoded keys, e.g. NAME.pub:
//   name = "site-a"
//   sign_public = "<64 hex>"
//   box_public = "<64 hex>"
// and NAME.key adds sign_secret (128 hex) and box_secret (64 hex). A secret
// file readable by group or others is refused. Secrets live in SecretBytes,
// which wipes them with sodium_memzero, and are never printed or logged.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"

namespace fedmesh::crypto {

inline constexpr size_t kSignPublicBytes = 32;   // crypto_sign_PUBLICKEYBYTES
inline constexpr size_t kSignSecretBytes = 64;   // crypto_sign_SECRETKEYBYTES
inline constexpr size_t kSignatureBytes = 64;    // crypto_sign_BYTES
inline constexpr size_t kBoxPublicBytes = 32;    // crypto_box_PUBLICKEYBYTES (CurveZMQ)
inline constexpr size_t kBoxSecretBytes = 32;    // crypto_box_SECRETKEYBYTES
inline constexpr size_t kMaxSiteNameBytes = 64;  // [a-z0-9._-], starts with a letter or digit

using SignPublicKey = std::array<uint8_t, kSignPublicBytes>;
using BoxPublicKey = std::array<uint8_t, kBoxPublicBytes>;
using Signature = std::array<uint8_t, kSignatureBytes>;

// Calls sodium_init once; FEDMESH_CHECKs that it worked.
void ensure_sodium();

// Fixed-size secret bytes wiped on destruction and on move-from.
template <size_t N>
class SecretBytes {
 public:
  SecretBytes() = default;
  ~SecretBytes();
  SecretBytes(const SecretBytes& other);
  SecretBytes& operator=(const SecretBytes& other);
  uint8_t* data() { return bytes_.data(); }
  const uint8_t* data() const { return bytes_.data(); }
  static constexpr size_t size() { return N; }
  std::span<const uint8_t, N> span() const { return bytes_; }

 private:
  std::array<uint8_t, N> bytes_{};
};

// Site names: 1..kMaxSiteNameBytes of [a-z0-9._-], first a letter or digit.
Status check_site_name(std::string_view name);

struct PublicIdentity {
  std::string name;
  SignPublicKey sign_public{};
  BoxPublicKey box_public{};
  bool operator==(const PublicIdentity&) const = default;
};

struct SiteKeys {
  PublicIdentity identity;
  SecretBytes<kSignSecretBytes> sign_secret;
  SecretBytes<kBoxSecretBytes> box_secret;
};

Result<SiteKeys> generate_site_keys(std::string_view name);

// Writes DIR/NAME.key (0600, created with O_EXCL|O_NOFOLLOW: an existing file
// is never overwritten) and DIR/NAME.pub; creates DIR (0700) if missing.
Status write_site_keys(const SiteKeys& keys, const std::filesystem::path& dir);
// Reads NAME.key; refuses a file whose mode grants group/other any access,
// and one whose public halves do not match its secret halves.
Result<SiteKeys> read_site_keys(const std::filesystem::path& key_file);
Result<PublicIdentity> read_public_identity(const std::filesystem::path& pub_file);
// Parsing from text, for files and for the fuzz target.
Result<PublicIdentity> parse_public_identity(std::string_view toml_text);
std::string format_public_identity(const PublicIdentity& identity);  // the .pub text

std::string to_hex(std::span<const uint8_t> bytes);
// Exactly 2*out.size() hex digits (either case), or kCorrupt naming `what`.
Status from_hex(std::string_view hex, std::span<uint8_t> out, std::string_view what);

Signature sign_detached(std::span<const uint8_t> message, const SecretBytes<kSignSecretBytes>& secret);
bool verify_detached(std::span<const uint8_t> message, const Signature& signature,
                     const SignPublicKey& public_key);

}  // namespace fedmesh::crypto
