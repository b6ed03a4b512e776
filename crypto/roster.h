// The federation roster: who may take part, with what keys, reachable where.
// A TOML file signed by the federation admin's Ed25519 key:
//
//   federation = "fed-demo"
//   admin_public = "<64 hex>"          # the admin's sign_public
//   signature = "<128 hex>"            # absent until `roster sign`
//
//   [[site]]
//   name = "site-a"
//   role = "site"                      # site | aggregator | peer
//   sign_public = "<64 hex>"
//   box_public = "<64 hex>"
//   address = "tcp://10.0.0.5:7400"    # where it listens ("" if it only dials out)
//
// The signature covers canonical_bytes(roster): a length-prefixed encoding of
// every field except the signature, in file order, under a domain string, so
// whitespace, comments and key order in the TOML do not matter but any change
// of a value, of the order of sites, or of the admin key does.
// A process pins the admin public key from its own config (never only from
// the roster itself) and refuses to start on an unsigned or tampered roster.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

inline constexpr size_t kMaxRosterSites = 4096;
inline constexpr size_t kMaxRosterFileBytes = 4u << 20;
inline constexpr size_t kMaxAddressBytes = 256;
inline constexpr size_t kMaxFederationIdBytes = 64;  // same alphabet as site names

enum class Role : uint8_t { kSite = 0, kAggregator = 1, kPeer = 2 };
const char* role_name(Role role);
Result<Role> parse_role(std::string_view text);

struct RosterEntry {
  PublicIdentity identity;
  Role role = Role::kSite;
  std::string address;
  bool operator==(const RosterEntry&) const = default;
};

struct Roster {
  std::string federation;
  SignPublicKey admin_public{};
  std::vector<RosterEntry> sites;
  std::optional<Signature> signature;

  const RosterEntry* find(std::string_view name) const;
  const RosterEntry* find_by_box_key(const BoxPublicKey& key) const;
};

// Parses untrusted text: every field checked (names, hex lengths, roles,
// duplicate names or keys, sizes against the limits above). Does not verify
// the signature.
Result<Roster> parse_roster(std::string_view toml_text);
Result<Roster> read_roster(const std::filesystem::path& file);
std::string format_roster(const Roster& roster);  // TOML text that parses back equal
// Atomic: written to a temporary file in the same directory, fsynced, renamed.
Status write_roster(const Roster& roster, const std::filesystem::path& file);

std::vector<uint8_t> canonical_bytes(const Roster& roster);
// Signs with the admin's secret; kInvalidArgument if its public half is not
// roster.admin_public.
Status sign_roster(Roster& roster, const SiteKeys& admin);
// ok only if signed, roster.admin_public == pinned_admin, and the signature
// verifies; otherwise a message saying which of the three failed.
Status verify_roster(const Roster& roster, const SignPublicKey& pinned_admin);

// What a federation process starts from: its own keys and the roster, checked
// together. The key file must be `name`'s, the roster signed by the pinned
// admin key (hex), for `federation`, and list `name` with these keys.
struct Membership {
  SiteKeys keys;
  Roster roster;
};
Result<Membership> load_membership(const std::string& key_file, const std::string& name,
                                   const std::string& roster_file, const std::string& admin_public_hex,
                                   const std::string& federation);

}  // namespace fedmesh::crypto
