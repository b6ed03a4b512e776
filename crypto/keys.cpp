#include "crypto/keys.h"

#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "base/file_io.h"
#include "base/toml_input.h"

namespace fedmesh::crypto {

static_assert(kSignPublicBytes == crypto_sign_PUBLICKEYBYTES);
static_assert(kSignSecretBytes == crypto_sign_SECRETKEYBYTES);
static_assert(kSignatureBytes == crypto_sign_BYTES);
static_assert(kBoxPublicBytes == crypto_box_PUBLICKEYBYTES);
static_assert(kBoxSecretBytes == crypto_box_SECRETKEYBYTES);
// CurveZMQ derives the public key from the secret with X25519 base-point
// multiplication; read_site_keys relies on that to check a key file.
static_assert(crypto_box_SECRETKEYBYTES == crypto_scalarmult_SCALARBYTES);

namespace {

// A key file is five short lines; anything much larger is not one, and the
// bound keeps a hostile file (or /dev/zero) from being read into memory.
constexpr size_t kMaxKeyFileBytes = 16 << 10;
// The .pub text reaches parse_public_identity from files and from the fuzz
// target; same bound.
constexpr size_t kMaxPublicFileBytes = kMaxKeyFileBytes;
constexpr mode_t kSecretFileMode = 0600;
constexpr mode_t kPublicFileMode = 0644;
constexpr mode_t kKeyDirectoryMode = 0700;

// Untrusted text shown in a message: control bytes could rewrite a terminal.
std::string printable(std::string_view text, size_t max_bytes) {
  std::string shown(text.substr(0, max_bytes));
  for (char& c : shown) {
    if (static_cast<uint8_t>(c) < 0x20 || static_cast<uint8_t>(c) >= 0x7f) c = '?';
  }
  if (text.size() > max_bytes) shown += "...";
  return shown;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Overwrites every string value of a parsed key file before toml++ frees it.
// toml++'s parser may still have left copies in memory it has freed; those
// are out of our reach.
void wipe_strings(toml::table& table) {
  for (auto&& [key, node] : table) {
    if (toml::value<std::string>* text = node.as_string()) {
      std::string& s = text->get();
      sodium_memzero(s.data(), s.size());
    }
  }
}

Status get_string(const toml::table& table, std::string_view key, std::string_view what, std::string& out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) return corrupt(std::string(what) + ": missing field '" + std::string(key) + "'");
  const toml::value<std::string>* text = node->as_string();
  if (text == nullptr) return corrupt(std::string(what) + ": field '" + std::string(key) + "' must be a string");
  out = text->get();
  return Status::ok();
}

template <size_t N>
Status get_hex(const toml::table& table, std::string_view key, std::string_view what, std::span<uint8_t, N> out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) return corrupt(std::string(what) + ": missing field '" + std::string(key) + "'");
  const toml::value<std::string>* text = node->as_string();
  if (text == nullptr) return corrupt(std::string(what) + ": field '" + std::string(key) + "' must be a string");
  return from_hex(text->get(), out, std::string(what) + ": field '" + std::string(key) + "'");
}

Status check_only_keys(const toml::table& table, std::initializer_list<std::string_view> allowed,
                       std::string_view what) {
  for (auto&& [key, node] : table) {
    bool known = false;
    for (std::string_view a : allowed) known = known || key.str() == a;
    if (!known) {
      return corrupt(std::string(what) + ": unknown field '" + printable(key.str(), kMaxSiteNameBytes) + "'");
    }
  }
  return Status::ok();
}

void append_hex_line(std::string& out, std::string_view key, std::span<const uint8_t> bytes) {
  out += key;
  out += " = \"";
  const size_t at = out.size();
  out.resize(at + 2 * bytes.size() + 1);
  sodium_bin2hex(out.data() + at, 2 * bytes.size() + 1, bytes.data(), bytes.size());
  out.resize(at + 2 * bytes.size());
  out += "\"\n";
}

Result<PublicIdentity> identity_from_table(const toml::table& table, std::string_view what) {
  PublicIdentity identity;
  FEDMESH_RETURN_IF_ERROR(get_string(table, "name", what, identity.name));
  if (Status s = check_site_name(identity.name); !s.is_ok()) return corrupt(std::string(what) + ": " + s.message());
  FEDMESH_RETURN_IF_ERROR(get_hex<kSignPublicBytes>(table, "sign_public", what, identity.sign_public));
  FEDMESH_RETURN_IF_ERROR(get_hex<kBoxPublicBytes>(table, "box_public", what, identity.box_public));
  return identity;
}

}  // namespace

void ensure_sodium() {
  static const int result = sodium_init();  // thread-safe once; 1 means already initialized
  FEDMESH_CHECK(result >= 0, "sodium_init failed");
}

template <size_t N>
SecretBytes<N>::~SecretBytes() {
  sodium_memzero(bytes_.data(), N);
}

template <size_t N>
SecretBytes<N>::SecretBytes(const SecretBytes& other) : bytes_(other.bytes_) {}

template <size_t N>
SecretBytes<N>& SecretBytes<N>::operator=(const SecretBytes& other) {
  bytes_ = other.bytes_;
  return *this;
}

// The secret sizes this library uses; other sizes would need a definition here.
template class SecretBytes<kSignSecretBytes>;
template class SecretBytes<kBoxSecretBytes>;

Status check_site_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxSiteNameBytes) {
    return invalid_argument("name must have 1 to " + std::to_string(kMaxSiteNameBytes) + " characters, not " +
                            std::to_string(name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (alnum || (i > 0 && (c == '.' || c == '_' || c == '-'))) continue;
    char shown[8];
    if (c >= 0x21 && c <= 0x7e) {
      std::snprintf(shown, sizeof shown, "'%c'", c);
    } else {
      std::snprintf(shown, sizeof shown, "0x%02x", static_cast<unsigned>(static_cast<uint8_t>(c)));
    }
    return invalid_argument("name '" + printable(name, kMaxSiteNameBytes) + "': character " + shown +
                            " at position " + std::to_string(i) +
                            " not allowed (use a-z, 0-9, '.', '_', '-'; first a letter or digit)");
  }
  return Status::ok();
}

Result<SiteKeys> generate_site_keys(std::string_view name) {
  ensure_sodium();
  FEDMESH_RETURN_IF_ERROR(check_site_name(name));
  SiteKeys keys;
  keys.identity.name = std::string(name);
  FEDMESH_CHECK(crypto_sign_keypair(keys.identity.sign_public.data(), keys.sign_secret.data()) == 0);
  FEDMESH_CHECK(crypto_box_keypair(keys.identity.box_public.data(), keys.box_secret.data()) == 0);
  return keys;
}

Status write_site_keys(const SiteKeys& keys, const std::filesystem::path& dir) {
  FEDMESH_RETURN_IF_ERROR(check_site_name(keys.identity.name));
  std::error_code error;
  if (!std::filesystem::exists(dir, error)) {
    std::filesystem::create_directories(dir, error);
    if (error) return io_error(dir.string() + ": cannot create directory: " + error.message());
    std::filesystem::permissions(dir, static_cast<std::filesystem::perms>(kKeyDirectoryMode), error);
  } else if (!std::filesystem::is_directory(dir, error)) {
    return invalid_argument(dir.string() + ": exists and is not a directory");
  }
  const std::filesystem::path key_file = dir / (keys.identity.name + ".key");
  const std::filesystem::path pub_file = dir / (keys.identity.name + ".pub");
  // Both names are checked first, so a refusal leaves nothing half written.
  for (const std::filesystem::path& file : {key_file, pub_file}) {
    if (std::filesystem::symlink_status(file, error).type() != std::filesystem::file_type::not_found) {
      return invalid_argument(file.string() + " already exists; refusing to overwrite a key (move it away or "
                                              "choose another name)");
    }
  }

  // Big enough for every line below, so the string never reallocates and
  // leaves an unwiped copy of the secrets in freed memory.
  constexpr size_t kKeyTextCapacity = 1024;
  std::string text;
  text.reserve(kKeyTextCapacity);
  const char* const buffer = text.data();
  text += format_public_identity(keys.identity);
  append_hex_line(text, "sign_secret", keys.sign_secret.span());
  append_hex_line(text, "box_secret", keys.box_secret.span());
  FEDMESH_CHECK(text.data() == buffer, "key text reallocated");
  Status status = create_file_exclusively(key_file, text, kSecretFileMode);
  text.resize(text.capacity());  // within capacity: no reallocation, and the whole buffer is ours to wipe
  sodium_memzero(text.data(), text.size());
  FEDMESH_RETURN_IF_ERROR(status);

  status = create_file_exclusively(pub_file, format_public_identity(keys.identity), kPublicFileMode);
  if (!status.is_ok()) {
    ::unlink(key_file.c_str());  // a .key without its .pub would only confuse
    return status;
  }
  return fsync_directory(dir);
}

Result<SiteKeys> read_site_keys(const std::filesystem::path& key_file) {
  ensure_sodium();
  Result<std::string> text = read_file_bounded(key_file, kMaxKeyFileBytes, {.refuse_symlinks = true, .secret = true});
  if (!text.is_ok()) return text.status();
  const std::string what = key_file.string();
  Result<toml::table> parsed = parse_toml(*text, what);
  sodium_memzero(text->data(), text->size());
  if (!parsed.is_ok()) return parsed.status();
  toml::table& table = *parsed;

  SiteKeys keys;
  Status status = check_only_keys(table, {"name", "sign_public", "box_public", "sign_secret", "box_secret"}, what);
  Result<PublicIdentity> identity = status.is_ok() ? identity_from_table(table, what) : Result<PublicIdentity>(status);
  if (identity.is_ok()) {
    keys.identity = *identity;
    status = get_hex<kSignSecretBytes>(table, "sign_secret", what, std::span<uint8_t, kSignSecretBytes>(
                                                                       keys.sign_secret.data(), kSignSecretBytes));
    if (status.is_ok()) {
      status = get_hex<kBoxSecretBytes>(table, "box_secret", what,
                                        std::span<uint8_t, kBoxSecretBytes>(keys.box_secret.data(), kBoxSecretBytes));
    }
  } else {
    status = identity.status();
  }
  wipe_strings(table);
  FEDMESH_RETURN_IF_ERROR(status);

  // The public halves are what others pin; they must belong to the secrets.
  SignPublicKey derived_sign{};
  FEDMESH_CHECK(crypto_sign_ed25519_sk_to_pk(derived_sign.data(), keys.sign_secret.data()) == 0);
  if (derived_sign != keys.identity.sign_public) {
    return corrupt(what + ": sign_public does not match sign_secret (the file was edited or mixed from two keys)");
  }
  BoxPublicKey derived_box{};
  if (crypto_scalarmult_base(derived_box.data(), keys.box_secret.data()) != 0 ||
      derived_box != keys.identity.box_public) {
    return corrupt(what + ": box_public does not match box_secret (the file was edited or mixed from two keys)");
  }
  return keys;
}

Result<PublicIdentity> read_public_identity(const std::filesystem::path& pub_file) {
  Result<std::string> text = read_file_bounded(pub_file, kMaxPublicFileBytes);
  if (!text.is_ok()) return text.status();
  Result<PublicIdentity> identity = parse_public_identity(*text);
  if (!identity.is_ok()) {
    return Status(identity.status().code(), pub_file.string() + ": " + identity.status().message());
  }
  return identity;
}

Result<PublicIdentity> parse_public_identity(std::string_view toml_text) {
  constexpr std::string_view kWhat = "public identity";
  if (toml_text.size() > kMaxPublicFileBytes) {
    return corrupt(std::string(kWhat) + ": " + std::to_string(toml_text.size()) + " bytes, more than the " +
                   std::to_string(kMaxPublicFileBytes) + " a .pub file may have");
  }
  Result<toml::table> parsed = parse_toml(toml_text, kWhat);
  if (!parsed.is_ok()) return parsed.status();
  toml::table& table = *parsed;
  if (table.contains("sign_secret") || table.contains("box_secret")) {
    wipe_strings(table);
    return invalid_argument(std::string(kWhat) +
                            ": holds secret keys; this is a .key file: pass the .pub file, and never share the .key");
  }
  FEDMESH_RETURN_IF_ERROR(check_only_keys(table, {"name", "sign_public", "box_public"}, kWhat));
  return identity_from_table(table, kWhat);
}

std::string format_public_identity(const PublicIdentity& identity) {
  std::string text = "name = \"" + identity.name + "\"\n";
  append_hex_line(text, "sign_public", identity.sign_public);
  append_hex_line(text, "box_public", identity.box_public);
  return text;
}

std::string to_hex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(2 * bytes.size(), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    hex[2 * i] = kDigits[bytes[i] >> 4];
    hex[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return hex;
}

Status from_hex(std::string_view hex, std::span<uint8_t> out, std::string_view what) {
  if (hex.size() != 2 * out.size()) {
    return corrupt(std::string(what) + ": expected " + std::to_string(2 * out.size()) + " hex digits, got " +
                   std::to_string(hex.size()) + " characters");
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const int high = hex_digit(hex[2 * i]);
    const int low = hex_digit(hex[2 * i + 1]);
    if (high < 0 || low < 0) {
      const size_t at = high < 0 ? 2 * i : 2 * i + 1;
      // Position only, never the character: the hex may be a secret key.
      sodium_memzero(out.data(), out.size());
      return corrupt(std::string(what) + ": not a hex digit at position " + std::to_string(at));
    }
    out[i] = static_cast<uint8_t>((high << 4) | low);
  }
  return Status::ok();
}

Signature sign_detached(std::span<const uint8_t> message, const SecretBytes<kSignSecretBytes>& secret) {
  ensure_sodium();
  Signature signature{};
  FEDMESH_CHECK(crypto_sign_detached(signature.data(), nullptr, message.data(), message.size(), secret.data()) == 0);
  return signature;
}

bool verify_detached(std::span<const uint8_t> message, const Signature& signature, const SignPublicKey& public_key) {
  ensure_sodium();
  return crypto_sign_verify_detached(signature.data(), message.data(), message.size(), public_key.data()) == 0;
}

}  // namespace fedmesh::crypto
