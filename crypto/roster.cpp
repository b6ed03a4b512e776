#include "crypto/roster.h"

#include <cctype>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include <toml++/toml.h>

#include "base/file_io.h"
#include "base/toml_input.h"

namespace fedmesh::crypto {

namespace {

constexpr std::string_view kRosterDomain = "fedmesh-roster-v1";
constexpr mode_t kRosterFileMode = 0644;  // public: every site reads it
constexpr uint16_t kMaxPort = 65535;

void append_u32(std::vector<uint8_t>& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

void append_field(std::vector<uint8_t>& out, std::span<const uint8_t> bytes) {
  FEDMESH_CHECK(bytes.size() <= UINT32_MAX, "roster field too large to encode");
  append_u32(out, static_cast<uint32_t>(bytes.size()));
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void append_field(std::vector<uint8_t>& out, std::string_view text) {
  append_field(out, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

// A TOML basic string. Parsed rosters hold only printable ASCII; the escapes
// keep the output valid TOML for any Roster built in code too.
std::string toml_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<uint8_t>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7f) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(byte));
      out += escape;
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

// Empty (the site only dials out), or tcp://HOST:PORT, ipc://PATH,
// inproc://NAME: printable ASCII without spaces, quotes or backslashes.
Status check_address(std::string_view address) {
  if (address.empty()) return Status::ok();
  if (address.size() > kMaxAddressBytes) {
    return invalid_argument("address has " + std::to_string(address.size()) + " bytes, more than the limit of " +
                            std::to_string(kMaxAddressBytes));
  }
  for (size_t i = 0; i < address.size(); ++i) {
    const auto c = static_cast<uint8_t>(address[i]);
    if (c <= 0x20 || c >= 0x7f || c == '"' || c == '\\') {
      return invalid_argument("address: character at position " + std::to_string(i) +
                              " not allowed (printable ASCII without spaces, quotes or backslashes)");
    }
  }
  const std::string shown(address);
  for (const std::string_view scheme : {std::string_view("ipc://"), std::string_view("inproc://")}) {
    if (!address.starts_with(scheme)) continue;
    if (address.size() == scheme.size()) return invalid_argument("address '" + shown + "' names no endpoint");
    return Status::ok();
  }
  constexpr std::string_view kTcp = "tcp://";
  if (!address.starts_with(kTcp)) {
    return invalid_argument("address '" + shown + "' must be tcp://HOST:PORT (or ipc://PATH, inproc://NAME)");
  }
  const std::string_view rest = address.substr(kTcp.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == rest.size()) {
    return invalid_argument("address '" + shown + "' must be tcp://HOST:PORT");
  }
  const std::string_view host = rest.substr(0, colon);
  const std::string_view port = rest.substr(colon + 1);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') {
      return invalid_argument("address '" + shown + "': an IPv6 host is written [ADDRESS]");
    }
    for (const char c : host.substr(1, host.size() - 2)) {
      if (!(std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.')) {
        return invalid_argument("address '" + shown + "': bad IPv6 host");
      }
    }
  } else {
    for (const char c : host) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == '*')) {
        return invalid_argument("address '" + shown + "': host may hold letters, digits, '.', '-', '_' or be '*'");
      }
    }
  }
  if (port.size() > 5 || (port.size() > 1 && port[0] == '0')) {
    return invalid_argument("address '" + shown + "': port must be 1 to " + std::to_string(kMaxPort));
  }
  uint32_t value = 0;
  for (const char c : port) {
    if (c < '0' || c > '9') return invalid_argument("address '" + shown + "': port must be a number");
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value < 1 || value > kMaxPort) {
    return invalid_argument("address '" + shown + "': port must be 1 to " + std::to_string(kMaxPort));
  }
  return Status::ok();
}

Status check_federation_id(std::string_view id) {
  if (id.size() > kMaxFederationIdBytes) {
    return invalid_argument("federation id has " + std::to_string(id.size()) + " characters, more than " +
                            std::to_string(kMaxFederationIdBytes));
  }
  Status s = check_site_name(id);
  if (!s.is_ok()) return invalid_argument("federation id: " + s.message());
  return Status::ok();
}

Status field_error(std::string_view where, std::string_view message) {
  return corrupt("roster: " + std::string(where) + ": " + std::string(message));
}

Status get_string(const toml::table& table, std::string_view key, std::string_view where, bool required,
                  std::string& out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) {
    if (!required) return Status::ok();
    return field_error(where, "missing field '" + std::string(key) + "'");
  }
  const toml::value<std::string>* text = node->as_string();
  if (text == nullptr) return field_error(where, "field '" + std::string(key) + "' must be a string");
  out = text->get();
  return Status::ok();
}

template <size_t N>
Status get_hex(const toml::table& table, std::string_view key, std::string_view where, std::array<uint8_t, N>& out) {
  std::string text;
  FEDMESH_RETURN_IF_ERROR(get_string(table, key, where, /*required=*/true, text));
  return from_hex(text, out, "roster: " + std::string(where) + ": field '" + std::string(key) + "'");
}

Status check_only_keys(const toml::table& table, std::initializer_list<std::string_view> allowed,
                       std::string_view where) {
  for (auto&& [key, node] : table) {
    bool known = false;
    for (std::string_view a : allowed) known = known || key.str() == a;
    if (!known) {
      // Every field must be covered by the signature or be the signature:
      // an unknown one would be unsigned data a reader might trust.
      std::string name(key.str().substr(0, kMaxSiteNameBytes));
      for (char& c : name) {
        if (static_cast<uint8_t>(c) < 0x20 || static_cast<uint8_t>(c) >= 0x7f) c = '?';
      }
      return field_error(where, "unknown field '" + name + "'");
    }
  }
  return Status::ok();
}

Result<RosterEntry> parse_site(const toml::table& table, size_t index) {
  std::string where = "site " + std::to_string(index + 1);
  FEDMESH_RETURN_IF_ERROR(check_only_keys(table, {"name", "role", "sign_public", "box_public", "address"}, where));
  RosterEntry entry;
  FEDMESH_RETURN_IF_ERROR(get_string(table, "name", where, /*required=*/true, entry.identity.name));
  if (Status s = check_site_name(entry.identity.name); !s.is_ok()) return field_error(where, s.message());
  where += " ('" + entry.identity.name + "')";
  std::string role;
  FEDMESH_RETURN_IF_ERROR(get_string(table, "role", where, /*required=*/true, role));
  Result<Role> parsed_role = parse_role(role);
  if (!parsed_role.is_ok()) return field_error(where, parsed_role.status().message());
  entry.role = *parsed_role;
  FEDMESH_RETURN_IF_ERROR(get_hex(table, "sign_public", where, entry.identity.sign_public));
  FEDMESH_RETURN_IF_ERROR(get_hex(table, "box_public", where, entry.identity.box_public));
  FEDMESH_RETURN_IF_ERROR(get_string(table, "address", where, /*required=*/false, entry.address));
  if (Status s = check_address(entry.address); !s.is_ok()) return field_error(where, s.message());
  return entry;
}

// Two sites sharing a name or a key would make the allowlist ambiguous: a
// message could be attributed to the wrong site.
Status check_unique(const std::vector<RosterEntry>& sites) {
  std::map<std::string_view, size_t> names;
  std::map<SignPublicKey, size_t> sign_keys;
  std::map<BoxPublicKey, size_t> box_keys;
  for (size_t i = 0; i < sites.size(); ++i) {
    const RosterEntry& site = sites[i];
    const std::string where = "site " + std::to_string(i + 1) + " ('" + site.identity.name + "')";
    if (auto [it, added] = names.emplace(site.identity.name, i); !added) {
      return field_error(where, "duplicate name: site " + std::to_string(it->second + 1) + " has the same name");
    }
    if (auto [it, added] = sign_keys.emplace(site.identity.sign_public, i); !added) {
      return field_error(where, "duplicate sign_public: site " + std::to_string(it->second + 1) + " ('" +
                                    sites[it->second].identity.name + "') has the same key");
    }
    if (auto [it, added] = box_keys.emplace(site.identity.box_public, i); !added) {
      return field_error(where, "duplicate box_public: site " + std::to_string(it->second + 1) + " ('" +
                                    sites[it->second].identity.name + "') has the same key");
    }
  }
  return Status::ok();
}

}  // namespace

const char* role_name(Role role) {
  switch (role) {
    case Role::kSite: return "site";
    case Role::kAggregator: return "aggregator";
    case Role::kPeer: return "peer";
  }
  return "unknown";
}

Result<Role> parse_role(std::string_view text) {
  if (text == "site") return Role::kSite;
  if (text == "aggregator") return Role::kAggregator;
  if (text == "peer") return Role::kPeer;
  std::string shown(text.substr(0, 32));
  for (char& c : shown) {
    if (static_cast<uint8_t>(c) < 0x20 || static_cast<uint8_t>(c) >= 0x7f) c = '?';
  }
  return invalid_argument("unknown role '" + shown + "' (expected site, aggregator or peer)");
}

const RosterEntry* Roster::find(std::string_view name) const {
  for (const RosterEntry& site : sites) {
    if (site.identity.name == name) return &site;
  }
  return nullptr;
}

const RosterEntry* Roster::find_by_box_key(const BoxPublicKey& key) const {
  for (const RosterEntry& site : sites) {
    if (site.identity.box_public == key) return &site;
  }
  return nullptr;
}

Result<Roster> parse_roster(std::string_view toml_text) {
  if (toml_text.size() > kMaxRosterFileBytes) {
    return corrupt("roster: " + std::to_string(toml_text.size()) + " bytes, more than the limit of " +
                   std::to_string(kMaxRosterFileBytes));
  }
  Result<toml::table> parsed = parse_toml(toml_text, "roster");
  if (!parsed.is_ok()) return parsed.status();
  const toml::table& table = *parsed;
  FEDMESH_RETURN_IF_ERROR(check_only_keys(table, {"federation", "admin_public", "signature", "site"}, "top level"));

  Roster roster;
  FEDMESH_RETURN_IF_ERROR(get_string(table, "federation", "top level", /*required=*/true, roster.federation));
  if (Status s = check_federation_id(roster.federation); !s.is_ok()) return field_error("top level", s.message());
  FEDMESH_RETURN_IF_ERROR(get_hex(table, "admin_public", "top level", roster.admin_public));
  if (table.contains("signature")) {
    Signature signature{};
    FEDMESH_RETURN_IF_ERROR(get_hex(table, "signature", "top level", signature));
    roster.signature = signature;
  }
  if (const toml::node* sites = table.get("site")) {
    const toml::array* array = sites->as_array();
    if (array == nullptr || !array->is_array_of_tables()) {
      // An empty inline array `site = []` is not an array of tables to toml++.
      if (array == nullptr || !array->empty()) {
        return field_error("top level", "'site' must be an array of tables ([[site]] sections)");
      }
    }
    if (array->size() > kMaxRosterSites) {
      return field_error("top level", std::to_string(array->size()) + " sites, more than the limit of " +
                                          std::to_string(kMaxRosterSites));
    }
    roster.sites.reserve(array->size());
    for (size_t i = 0; i < array->size(); ++i) {
      Result<RosterEntry> entry = parse_site(*array->get(i)->as_table(), i);
      if (!entry.is_ok()) return entry.status();
      roster.sites.push_back(std::move(*entry));
    }
  }
  FEDMESH_RETURN_IF_ERROR(check_unique(roster.sites));
  return roster;
}

Result<Roster> read_roster(const std::filesystem::path& file) {
  Result<std::string> text = read_file_bounded(file, kMaxRosterFileBytes);
  if (!text.is_ok()) return text.status();
  Result<Roster> roster = parse_roster(*text);
  if (!roster.is_ok()) return Status(roster.status().code(), file.string() + ": " + roster.status().message());
  return roster;
}

std::string format_roster(const Roster& roster) {
  std::string text;
  text += "# fedmesh federation roster. Edit with `fedmesh roster`; any change voids the signature.\n";
  text += "federation = " + toml_string(roster.federation) + "\n";
  text += "admin_public = \"" + to_hex(roster.admin_public) + "\"\n";
  if (roster.signature) text += "signature = \"" + to_hex(*roster.signature) + "\"\n";
  for (const RosterEntry& site : roster.sites) {
    text += "\n[[site]]\n";
    text += "name = " + toml_string(site.identity.name) + "\n";
    text += "role = \"" + std::string(role_name(site.role)) + "\"\n";
    text += "sign_public = \"" + to_hex(site.identity.sign_public) + "\"\n";
    text += "box_public = \"" + to_hex(site.identity.box_public) + "\"\n";
    text += "address = " + toml_string(site.address) + "\n";
  }
  return text;
}

Status write_roster(const Roster& roster, const std::filesystem::path& file) {
  return write_file_atomically(file, format_roster(roster), kRosterFileMode);
}

// Layout (every field a u32 little-endian length, then its bytes):
//   "fedmesh-roster-v1", federation, admin_public, u32 site count (bare),
//   then per site: name, role name, sign_public, box_public, address.
// Role is encoded by name so the enum's numbering never matters.
std::vector<uint8_t> canonical_bytes(const Roster& roster) {
  std::vector<uint8_t> out;
  append_field(out, kRosterDomain);
  append_field(out, roster.federation);
  append_field(out, roster.admin_public);
  FEDMESH_CHECK(roster.sites.size() <= UINT32_MAX);
  append_u32(out, static_cast<uint32_t>(roster.sites.size()));
  for (const RosterEntry& site : roster.sites) {
    append_field(out, site.identity.name);
    append_field(out, std::string_view(role_name(site.role)));
    append_field(out, site.identity.sign_public);
    append_field(out, site.identity.box_public);
    append_field(out, site.address);
  }
  return out;
}

Status sign_roster(Roster& roster, const SiteKeys& admin) {
  if (admin.identity.sign_public != roster.admin_public) {
    return invalid_argument("the key '" + admin.identity.name + "' (sign_public " +
                            to_hex(admin.identity.sign_public).substr(0, 16) +
                            "...) is not this roster's admin (admin_public " +
                            to_hex(roster.admin_public).substr(0, 16) + "...)");
  }
  roster.signature = sign_detached(canonical_bytes(roster), admin.sign_secret);
  return Status::ok();
}

Status verify_roster(const Roster& roster, const SignPublicKey& pinned_admin) {
  if (!roster.signature) {
    return invalid_argument("roster of federation '" + roster.federation +
                            "' is unsigned: the admin must run `fedmesh roster sign`");
  }
  if (roster.admin_public != pinned_admin) {
    return invalid_argument("roster is signed by a different admin: its admin_public is " +
                            to_hex(roster.admin_public).substr(0, 16) + "..., the pinned admin key is " +
                            to_hex(pinned_admin).substr(0, 16) + "...");
  }
  if (!verify_detached(canonical_bytes(roster), *roster.signature, pinned_admin)) {
    return corrupt("roster signature does not verify: the roster was changed after it was signed (tampered), "
                   "or the signature was not made by the admin key");
  }
  return Status::ok();
}

Result<Membership> load_membership(const std::string& key_file, const std::string& name,
                                   const std::string& roster_file, const std::string& admin_public_hex,
                                   const std::string& federation) {
  Membership m;
  Result<SiteKeys> keys = read_site_keys(key_file);
  if (!keys.is_ok()) return keys.status();
  m.keys = std::move(*keys);
  if (m.keys.identity.name != name) {
    return invalid_argument("key file " + key_file + " is for '" + m.keys.identity.name + "', the config names '" +
                            name + "'");
  }
  Result<Roster> roster = read_roster(roster_file);
  if (!roster.is_ok()) return roster.status();
  m.roster = std::move(*roster);
  SignPublicKey admin{};
  FEDMESH_RETURN_IF_ERROR(from_hex(admin_public_hex, admin, "admin_public"));
  FEDMESH_RETURN_IF_ERROR(verify_roster(m.roster, admin));
  if (m.roster.federation != federation) {
    return invalid_argument("the roster is for federation '" + m.roster.federation + "', the config names '" +
                            federation + "'");
  }
  const RosterEntry* self = m.roster.find(name);
  if (self == nullptr || self->identity != m.keys.identity) {
    return invalid_argument("'" + name + "' is not on the roster with the keys in " + key_file);
  }
  return m;
}

}  // namespace fedmesh::crypto
