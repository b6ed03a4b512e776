#include "cli/roster_command.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/output.h"
#include "crypto/keys.h"
#include "crypto/roster.h"

namespace fedmesh::cli {

namespace {

// Exit codes: 2 for input the user must fix (a flag, a missing or malformed
// file), 1 for a roster that parses but does not verify.
constexpr int kExitBadInput = 2;
constexpr int kExitNotVerified = 1;
constexpr size_t kShownKeyHexDigits = 16;

struct RosterFlags {
  std::string federation;
  std::string admin_public;
  std::string admin_key;
  std::string out;
  std::string roster;
  std::string site_public;
  std::string role;
  std::string address;
  std::string site;  // revoke
  bool json = false;
};

int fail(const RosterFlags& flags, const std::string& command, const Status& status, int exit_code = kExitBadInput,
         const std::string& reason = "") {
  nlohmann::json extra = nlohmann::json::object();
  if (!reason.empty()) extra["reason"] = reason;
  return report_failure("roster " + command, flags.json, status, exit_code, extra);
}

std::string short_key(const crypto::SignPublicKey& key) { return crypto::to_hex(key).substr(0, kShownKeyHexDigits); }

int run_init(const RosterFlags& flags) {
  crypto::Roster roster;
  roster.federation = flags.federation;
  // Validated by a round trip through the parser, so the file written is
  // exactly one the parser accepts.
  Result<crypto::PublicIdentity> admin = crypto::read_public_identity(flags.admin_public);
  if (!admin.is_ok()) return fail(flags, "init", admin.status());
  roster.admin_public = admin->sign_public;
  Result<crypto::Roster> checked = crypto::parse_roster(crypto::format_roster(roster));
  if (!checked.is_ok()) return fail(flags, "init", invalid_argument("--federation: " + checked.status().message()));
  std::error_code error;
  if (std::filesystem::symlink_status(flags.out, error).type() != std::filesystem::file_type::not_found) {
    return fail(flags, "init", invalid_argument(flags.out + " already exists; refusing to replace a roster (use "
                                                            "`fedmesh roster add` to change it, or remove it first)"));
  }
  if (Status s = crypto::write_roster(roster, flags.out); !s.is_ok()) return fail(flags, "init", s);
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "roster init"},
               {"roster", flags.out},
               {"federation", roster.federation},
               {"admin_public", crypto::to_hex(roster.admin_public)},
               {"sites", 0}});
  } else {
    std::printf("created %s: federation %s, admin %s (%s...), no sites, unsigned\n", flags.out.c_str(),
                roster.federation.c_str(), admin->name.c_str(), short_key(roster.admin_public).c_str());
  }
  return 0;
}

int run_add(const RosterFlags& flags) {
  Result<crypto::Roster> roster = crypto::read_roster(flags.roster);
  if (!roster.is_ok()) return fail(flags, "add", roster.status());
  Result<crypto::PublicIdentity> site = crypto::read_public_identity(flags.site_public);
  if (!site.is_ok()) return fail(flags, "add", site.status());
  Result<crypto::Role> role = crypto::parse_role(flags.role);
  if (!role.is_ok()) return fail(flags, "add", invalid_argument("--role: " + role.status().message()));
  for (const crypto::RosterEntry& entry : roster->sites) {
    if (entry.identity.name == site->name) {
      return fail(flags, "add", invalid_argument("site '" + site->name + "' is already on " + flags.roster));
    }
    if (entry.identity.sign_public == site->sign_public || entry.identity.box_public == site->box_public) {
      return fail(flags, "add", invalid_argument("the keys in " + flags.site_public + " already belong to site '" +
                                                 entry.identity.name + "' on " + flags.roster +
                                                 "; every site needs its own `fedmesh keygen`"));
    }
  }
  if (roster->sites.size() >= crypto::kMaxRosterSites) {
    return fail(flags, "add", invalid_argument(flags.roster + " already has the maximum of " +
                                               std::to_string(crypto::kMaxRosterSites) + " sites"));
  }
  roster->sites.push_back({*site, *role, flags.address});
  const bool was_signed = roster->signature.has_value();
  roster->signature.reset();
  // The parser is the one place that knows what a valid roster is (addresses
  // included): what it would refuse is never written.
  Result<crypto::Roster> checked = crypto::parse_roster(crypto::format_roster(*roster));
  if (!checked.is_ok()) return fail(flags, "add", invalid_argument(checked.status().message()));
  if (Status s = crypto::write_roster(*roster, flags.roster); !s.is_ok()) return fail(flags, "add", s);
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "roster add"},
               {"roster", flags.roster},
               {"name", site->name},
               {"role", crypto::role_name(*role)},
               {"address", flags.address},
               {"sites", roster->sites.size()},
               {"signature_removed", was_signed}});
  } else {
    std::printf("added %s '%s'%s%s to %s (%zu sites)\n", crypto::role_name(*role), site->name.c_str(),
                flags.address.empty() ? "" : " at ", flags.address.c_str(), flags.roster.c_str(),
                roster->sites.size());
    if (was_signed) {
      std::printf("removed the roster's signature (it covered the old site list): the admin must run "
                  "`fedmesh roster sign` again\n");
    } else {
      std::printf("the roster is unsigned: the admin signs it with `fedmesh roster sign` when the list is complete\n");
    }
  }
  return 0;
}

// Removes a member and signs the result in one step: a roster is never left
// on disk unsigned. The aggregator (and peers) take it without a restart.
int run_revoke(const RosterFlags& flags) {
  Result<crypto::Roster> roster = crypto::read_roster(flags.roster);
  if (!roster.is_ok()) return fail(flags, "revoke", roster.status());
  Result<crypto::SiteKeys> admin = crypto::read_site_keys(flags.admin_key);
  if (!admin.is_ok()) return fail(flags, "revoke", admin.status());
  const auto entry = std::find_if(roster->sites.begin(), roster->sites.end(),
                                  [&](const crypto::RosterEntry& e) { return e.identity.name == flags.site; });
  if (entry == roster->sites.end()) {
    return fail(flags, "revoke", not_found(flags.roster + " lists no member named '" + flags.site + "'"));
  }
  if (entry->role == crypto::Role::kAggregator) {
    return fail(flags, "revoke", invalid_argument("'" + flags.site + "' is the aggregator: a federation cannot revoke "
                                                  "its aggregator (provision a new one instead)"));
  }
  roster->sites.erase(entry);
  if (Status s = crypto::sign_roster(*roster, *admin); !s.is_ok()) {
    return fail(flags, "revoke", invalid_argument(flags.admin_key + ": " + s.message()));
  }
  if (Status s = crypto::write_roster(*roster, flags.roster); !s.is_ok()) return fail(flags, "revoke", s);
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "roster revoke"}, {"roster", flags.roster}, {"revoked", flags.site},
               {"sites", roster->sites.size()}});
  } else {
    std::printf("revoked %s: %s re-signed with %zu members; give it to the aggregator and peers (they take it "
                "without a restart)\n", flags.site.c_str(), flags.roster.c_str(), roster->sites.size());
  }
  return 0;
}

int run_sign(const RosterFlags& flags) {
  Result<crypto::Roster> roster = crypto::read_roster(flags.roster);
  if (!roster.is_ok()) return fail(flags, "sign", roster.status());
  Result<crypto::SiteKeys> admin = crypto::read_site_keys(flags.admin_key);
  if (!admin.is_ok()) return fail(flags, "sign", admin.status());
  if (Status s = crypto::sign_roster(*roster, *admin); !s.is_ok()) {
    return fail(flags, "sign", invalid_argument(flags.admin_key + ": " + s.message()));
  }
  if (Status s = crypto::write_roster(*roster, flags.roster); !s.is_ok()) return fail(flags, "sign", s);
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "roster sign"},
               {"roster", flags.roster},
               {"federation", roster->federation},
               {"sites", roster->sites.size()},
               {"admin_public", crypto::to_hex(roster->admin_public)}});
  } else {
    std::printf("signed %s: federation %s, %zu sites, by %s\n", flags.roster.c_str(), roster->federation.c_str(),
                roster->sites.size(), short_key(roster->admin_public).c_str());
  }
  return 0;
}

int run_verify(const RosterFlags& flags) {
  Result<crypto::PublicIdentity> admin = crypto::read_public_identity(flags.admin_public);
  if (!admin.is_ok()) return fail(flags, "verify", admin.status());
  Result<crypto::Roster> roster = crypto::read_roster(flags.roster);
  if (!roster.is_ok()) return fail(flags, "verify", roster.status());
  if (Status s = crypto::verify_roster(*roster, admin->sign_public); !s.is_ok()) {
    const char* reason = !roster->signature                         ? "unsigned"
                         : roster->admin_public != admin->sign_public ? "different_admin"
                                                                      : "tampered";
    return fail(flags, "verify", Status(s.code(), flags.roster + ": " + s.message()), kExitNotVerified, reason);
  }
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "roster verify"},
               {"ok", true},
               {"roster", flags.roster},
               {"federation", roster->federation},
               {"sites", roster->sites.size()},
               {"admin_public", crypto::to_hex(roster->admin_public)}});
  } else {
    std::printf("roster OK: federation %s, %zu sites, signed by %s\n", roster->federation.c_str(),
                roster->sites.size(), short_key(roster->admin_public).c_str());
  }
  return 0;
}

}  // namespace

void add_roster_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<RosterFlags>();
  CLI::App* roster = app.add_subcommand(
      "roster",
      "Manage the federation roster: the TOML list of sites (name, role, signing and transport keys, address) "
      "that may take part, signed by the federation admin.\n"
      "Trust model: every process pins the admin's public key from its own config (--admin-public), never "
      "from the roster itself, and refuses a roster that is unsigned, signed by another key, or changed after "
      "signing. Any change to the site list voids the signature until the admin signs again.\n"
      "Typical flow: each site runs `fedmesh keygen` and sends its .pub to the admin; the admin runs "
      "`roster init`, `roster add` per site, `roster sign`, and distributes roster.toml; every site checks it "
      "with `roster verify`.");
  roster->require_subcommand(1);

  CLI::App* init = roster->add_subcommand("init", "Create an empty, unsigned roster for a federation");
  init->add_option("--federation", flags->federation, "Federation id: 1-64 of a-z 0-9 . _ -")->required();
  init->add_option("--admin-public", flags->admin_public,
                   "The admin's ADMIN.pub (from `fedmesh keygen`); its sign_public goes into the roster")
      ->required();
  init->add_option("--out", flags->out, "Roster file to create (never replaces an existing one)")->required();
  init->add_flag("--json", flags->json, "Print one JSON object");
  init->callback([flags, &exit_code] { exit_code = run_init(*flags); });

  CLI::App* add = roster->add_subcommand(
      "add", "Add a site from its .pub file. Removes an existing signature: the admin signs again afterwards.");
  add->add_option("--roster", flags->roster, "Roster file to change (rewritten atomically)")->required();
  add->add_option("--public", flags->site_public, "The site's NAME.pub (from `fedmesh keygen`)")->required();
  add->add_option("--role", flags->role, "site (trains, talks to an aggregator), aggregator, or peer (gossip)")
      ->required();
  add->add_option("--address", flags->address,
                  "Where the site listens, tcp://HOST:PORT (leave out if it only dials out)");
  add->add_flag("--json", flags->json, "Print one JSON object");
  add->callback([flags, &exit_code] { exit_code = run_add(*flags); });

  CLI::App* sign = roster->add_subcommand("sign", "Sign the roster with the admin's secret key");
  sign->add_option("--roster", flags->roster, "Roster file to sign (rewritten atomically)")->required();
  sign->add_option("--admin-key", flags->admin_key,
                   "The admin's ADMIN.key (mode 0600); must match the roster's admin_public")
      ->required();
  sign->add_flag("--json", flags->json, "Print one JSON object");
  sign->callback([flags, &exit_code] { exit_code = run_sign(*flags); });

  CLI::App* revoke = roster->add_subcommand(
      "revoke", "Remove a site or peer from the roster and re-sign it; a running aggregator or peer reading this "
                "file takes it without a restart and refuses the revoked key from then on");
  revoke->add_option("--roster", flags->roster, "Roster file to change (rewritten atomically)")->required();
  revoke->add_option("--site", flags->site, "The member to remove")->required();
  revoke->add_option("--admin-key", flags->admin_key, "The admin's ADMIN.key; must match the roster's admin_public")
      ->required();
  revoke->add_flag("--json", flags->json, "Print one JSON object");
  revoke->callback([flags, &exit_code] { exit_code = run_revoke(*flags); });

  CLI::App* verify = roster->add_subcommand(
      "verify",
      "Check a roster against the admin key you trust. Exit 0 if it verifies; 1 if it is unsigned, signed by a "
      "different admin, or its signature does not verify (tampered); 2 if a file is missing or malformed.");
  verify->add_option("--roster", flags->roster, "Roster file to check")->required();
  verify->add_option("--admin-public", flags->admin_public,
                     "The admin's ADMIN.pub, obtained out of band: the key you pin, not the one the roster names")
      ->required();
  verify->add_flag("--json", flags->json, "Print one JSON object");
  verify->callback([flags, &exit_code] { exit_code = run_verify(*flags); });
}

}  // namespace fedmesh::cli
