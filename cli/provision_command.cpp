#include "cli/provision_command.h"

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/file_io.h"
#include "cli/output.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "base/toml_input.h"

namespace fedmesh::cli {

namespace {

namespace fs = std::filesystem;

struct ProvisionFlags {
  std::string federation_file;
  std::string out;
  std::string from_public;  // a directory of NAME.pub files the institutions sent
  bool json = false;
};

// Metrics ports: the aggregator's, then one per site in the order listed,
// so that kits started on one host do not collide.
constexpr int kFirstMetricsPort = 9400;

// federation.toml: what the operator describes.
struct FederationPlan {
  std::string name;                         // the federation id
  std::string aggregator = "tcp://127.0.0.1:7400";  // where sites dial
  std::string listen;                       // the aggregator binds (default: every interface, the address's port)
  std::string mode = "trusted";             // privacy.mode
  std::string model = "mlp";
  std::string strategy = "fedavg";
  int64_t rounds = 10;
  int64_t local_steps = 50;
  std::vector<std::string> sites;
  std::string init;                         // weights every kit starts from (copied into each kit)
  std::string init_format = "fedmesh";
};

Result<FederationPlan> read_plan(const std::string& path) {
  Result<toml::table> table = read_toml_file(path);
  if (!table.is_ok()) return table.status();
  FederationPlan plan;
  ConfigReader r(*table, path);
  r.require("name", plan.name);
  r.read("aggregator", plan.aggregator);
  r.read("listen", plan.listen);
  r.read("mode", plan.mode);
  r.read("model", plan.model);
  r.read("strategy", plan.strategy);
  r.read("rounds", plan.rounds);
  r.read("local_steps", plan.local_steps);
  r.require("sites", plan.sites);
  r.read("init", plan.init);
  r.read("init_format", plan.init_format);
  FEDMESH_RETURN_IF_ERROR(r.finish());
  const auto bad = [&](const std::string& what) { return invalid_argument(path + ": " + what); };
  if (Status s = crypto::check_site_name(plan.name); !s.is_ok()) return bad("name: " + s.message());
  if (plan.mode != "trusted" && plan.mode != "private") return bad("mode must be trusted or private, not '" + plan.mode + "'");
  if (plan.aggregator.rfind("tcp://", 0) != 0 || plan.aggregator.rfind(':') <= 6) {
    return bad("aggregator must be tcp://HOST:PORT, not '" + plan.aggregator + "'");
  }
  if (plan.listen.empty()) plan.listen = "tcp://0.0.0.0" + plan.aggregator.substr(plan.aggregator.rfind(':'));
  if (plan.sites.empty()) return bad("sites lists no site");
  if (plan.rounds < 0 || plan.local_steps < 1) return bad("rounds must be >= 0 and local_steps >= 1");
  if (plan.init_format != "fedmesh" && plan.init_format != "hf-gpt2") {
    return bad("init_format must be fedmesh or hf-gpt2, not '" + plan.init_format + "'");
  }
  if (!plan.init.empty() && !fs::is_regular_file(plan.init)) {
    return bad("init: " + plan.init + " is not a file (the weights every kit starts from)");
  }
  std::set<std::string> seen;
  for (const std::string& site : plan.sites) {
    if (Status s = crypto::check_site_name(site); !s.is_ok()) return bad("sites: " + s.message());
    if (site == "aggregator" || site == "admin" || site == "roster.toml") return bad("sites: '" + site + "' is a reserved name");
    if (!seen.insert(site).second) return bad("sites: '" + site + "' is listed twice");
  }
  return plan;
}

// The key pair of `name` in DIR: kept when there, made otherwise.
Result<crypto::SiteKeys> keys_in(const fs::path& dir, const std::string& name, bool& made) {
  const fs::path file = dir / (name + ".key");
  made = false;
  if (fs::exists(file)) return crypto::read_site_keys(file);
  Result<crypto::SiteKeys> keys = crypto::generate_site_keys(name);
  if (!keys.is_ok()) return keys.status();
  FEDMESH_RETURN_IF_ERROR(crypto::write_site_keys(*keys, dir));
  made = true;
  return keys;
}

// Where a kit's identity came from.
enum class KeySource { kMade, kKept, kPublic };

// A kit's public identity: the NAME.pub its institution sent (in
// `from_public`), else the one its kit already holds (a .pub alone: a site
// that keeps its own secret), else the kit's key pair, kept or made here.
// A sent key that differs from a secret key already in the kit is refused:
// that kit would start with a key the roster does not list.
Result<crypto::PublicIdentity> identity_in(const fs::path& dir, const std::string& name, const fs::path& from_public,
                                           KeySource& source) {
  const fs::path key = dir / (name + ".key"), pub = dir / (name + ".pub");
  const fs::path sent = from_public.empty() ? fs::path() : from_public / (name + ".pub");
  if (!sent.empty() && fs::exists(sent)) {
    Result<crypto::PublicIdentity> identity = crypto::read_public_identity(sent);
    if (!identity.is_ok()) return identity.status();
    if (identity->name != name) {
      return invalid_argument(sent.string() + " is the public key of '" + identity->name + "', not of '" + name + "'");
    }
    if (fs::exists(key)) {
      Result<crypto::SiteKeys> held = crypto::read_site_keys(key);
      if (!held.is_ok()) return held.status();
      if (held->identity != *identity) {
        return invalid_argument(sent.string() + " differs from the key in " + key.string() +
                                ": remove that key file (a key made here earlier) to take the one " + name + " sent");
      }
    } else {
      FEDMESH_RETURN_IF_ERROR(write_file_atomically(pub, crypto::format_public_identity(*identity), 0644));
    }
    source = KeySource::kPublic;
    return identity;
  }
  if (!fs::exists(key) && fs::exists(pub)) {
    source = KeySource::kPublic;
    return crypto::read_public_identity(pub);
  }
  bool made = false;
  Result<crypto::SiteKeys> keys = keys_in(dir, name, made);
  if (!keys.is_ok()) return keys.status();
  source = made ? KeySource::kMade : KeySource::kKept;
  return keys->identity;
}

Status write_text(const fs::path& file, const std::string& text, mode_t mode = 0644) {
  return write_file_atomically(file, text, mode);
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// The kit's copy of the weights version 0 starts from, under its own name.
std::string init_file_name(const FederationPlan& plan) { return fs::path(plan.init).filename().string(); }

std::string init_lines(const FederationPlan& plan) {
  if (plan.init.empty()) return "";
  return "# Version 0 of the global model: these weights (the same file in every kit).\n"
         "init = " + quoted(init_file_name(plan)) + "\ninit_format = " + quoted(plan.init_format) + "\n";
}

std::string aggregator_config(const FederationPlan& plan, const std::string& admin_hex) {
  std::string t;
  t += "# The aggregator of federation " + plan.name + " (made by `fedmesh provision`).\n";
  t += "# Paths are relative to this directory: start.sh runs from here.\n";
  t += "federation = " + quoted(plan.name) + "\n";
  t += "name = \"aggregator\"\n";
  t += "listen = " + quoted(plan.listen) + "\n";
  t += "keys = \"aggregator.key\"\n";
  t += "roster = \"roster.toml\"\n";
  t += "admin_public = " + quoted(admin_hex) + "\n";
  t += "store = \"aggregator.db\"\n";
  t += "# The dashboard (/dashboard), /status and /metrics; any address but loopback needs metrics_token too.\n";
  t += "metrics = \"127.0.0.1:" + std::to_string(kFirstMetricsPort) + "\"\n";
  t += "model = " + quoted(plan.model) + "\n";
  t += "seed = 1\n";
  t += init_lines(plan);
  t += "rounds = " + std::to_string(plan.rounds) + "\n";
  t += "local_steps = " + std::to_string(plan.local_steps) + "\n";
  t += "min_sites = " + std::to_string(plan.sites.size()) + "\n";
  t += "strategy = " + quoted(plan.strategy) + "\n";
  t += "privacy.mode = " + quoted(plan.mode) + "\n";
  return t;
}

std::string site_config(const FederationPlan& plan, const std::string& site, size_t index, const std::string& admin_hex) {
  std::string t;
  t += "# Site " + site + " of federation " + plan.name + " (made by `fedmesh provision`).\n";
  t += "# Paths are relative to this directory: start.sh runs from here.\n";
  t += "federation = " + quoted(plan.name) + "\n";
  t += "name = " + quoted(site) + "\n";
  t += "aggregator = " + quoted(plan.aggregator) + "\n";
  t += "keys = " + quoted(site + ".key") + "\n";
  t += "roster = \"roster.toml\"\n";
  t += "admin_public = " + quoted(admin_hex) + "\n";
  t += "store = " + quoted(site + ".db") + "\n";
  t += "# /metrics and /status of this site; a port of its own, so that kits on one host do not collide.\n";
  t += "metrics = \"127.0.0.1:" + std::to_string(kFirstMetricsPort + 1 + static_cast<int>(index)) + "\"\n";
  t += "model = " + quoted(plan.model) + "\n";
  t += "seed = 1\n";
  t += init_lines(plan);
  t += "# This site's data. Your own, used whole (docs/data.md), e.g.:\n";
  t += "#   data.source = \"csv:/srv/fedmesh-data/patients.csv\"   with   data.label = \"outcome\"\n";
  t += "#   data.source = \"images:/srv/fedmesh-data/scans\"       with   data.image_size = 64, data.channels = 1\n";
  t += "# (the aggregator's validation and data.* keys must describe data of the same schema).\n";
  t += "# Until then, a demo: shard " + std::to_string(index) + " of " + std::to_string(plan.sites.size()) +
       " of Fashion-MNIST. Remove data.sites and data.index when data.source names your data.\n";
  t += "data.sites = " + std::to_string(plan.sites.size()) + "\n";
  t += "data.index = " + std::to_string(index) + "\n";
  t += "privacy.mode = " + quoted(plan.mode) + "\n";
  return t;
}

std::string start_script(const std::string& command, const std::string& config) {
  return "#!/bin/sh\n"
         "# Starts this kit's process from this directory (fedmesh on PATH, or FEDMESH=/path/to/fedmesh).\n"
         "set -e\n"
         "cd \"$(dirname \"$0\")\"\n"
         "exec \"${FEDMESH:-fedmesh}\" " + command + " --config " + config + " \"$@\"\n";
}

std::string kit_readme(const FederationPlan& plan, const std::string& who, bool aggregator, bool own_secret) {
  std::string t;
  t += "# " + (aggregator ? std::string("The aggregator") : "Site " + who) + " of federation `" + plan.name + "`\n\n";
  if (own_secret) {
    t += "Made by `fedmesh provision` from the public key you sent. Copy your secret key file `" + who +
         ".key` (made with `fedmesh keygen --name " + who + "`) into this directory before starting; "
         "it never left your institution. With it, this directory is everything this process needs:\n\n";
  } else {
    t += "Made by `fedmesh provision`. This directory is everything this process needs:\n\n";
  }
  t += "| file | what | keep |\n| --- | --- | --- |\n";
  t += "| `" + who + ".key` | this " + (aggregator ? "aggregator" : "site") +
       "'s secret keys (signing and transport)" + (own_secret ? ", yours: not in the kit as sent" : "") +
       " | **secret**: readable by the service user only (mode 0600); never send it anywhere |\n";
  t += "| `" + who + ".pub` | its public keys, already on the roster | public |\n";
  t += "| `roster.toml` | the federation's members, signed by the admin | public; replace it when the admin sends a new one |\n";
  t += "| `" + std::string(aggregator ? "agg.toml" : "site.toml") + "` | the configuration | edit `metrics`" +
       (aggregator ? ", `rounds`" : ", the `data.*` keys") + " as needed |\n";
  t += "| `start.sh` | starts the process from this directory | |\n\n";
  if (aggregator) {
    t += "Start: `./start.sh` (or `FEDMESH=/opt/fedmesh/bin/fedmesh ./start.sh`). Sites dial `" + plan.aggregator +
         "`: that port must be reachable from them; the process binds `" + plan.listen + "`. ";
    t += "It checkpoints every round into `aggregator.db` and resumes from it after a restart. Watch it with "
         "`fedmesh status --aggregator 127.0.0.1:9400`.\n";
  } else {
    t += "Start: `./start.sh` (or `FEDMESH=/opt/fedmesh/bin/fedmesh ./start.sh`). The site only dials out, to `" +
         plan.aggregator + "`: no inbound port needs to be opened. It trains on this institution's data and sends "
         "only signed, encrypted model updates" +
         (plan.mode == "private" ? " (in private mode, masked: the aggregator sees only the sum of the sites')" : "") +
         "; the raw data never leaves. It checkpoints into `" + who + ".db` and resumes after a restart.\n";
  }
  t += "\nMode: `" + plan.mode + "`. Model: `" + plan.model + "`.\n";
  return t;
}

int fail(const ProvisionFlags& flags, const Status& status) {
  return report_failure("provision", flags.json, status, 2);
}

int run_provision(const ProvisionFlags& flags) {
  Result<FederationPlan> plan = read_plan(flags.federation_file);
  if (!plan.is_ok()) return fail(flags, plan.status());
  const fs::path out = flags.out;
  std::error_code error;
  fs::create_directories(out, error);
  if (error) return fail(flags, io_error("cannot create " + out.string() + ": " + error.message()));

  // The admin key: made once, kept by the operator, never part of a kit.
  bool made = false;
  Result<crypto::SiteKeys> admin = keys_in(out / "admin", "admin", made);
  if (!admin.is_ok()) return fail(flags, admin.status());
  std::vector<std::string> created, kept;
  (made ? created : kept).push_back("admin");

  crypto::Roster roster;
  roster.federation = plan->name;
  roster.admin_public = admin->identity.sign_public;
  struct Kit {
    std::string name;
    fs::path dir;
    bool aggregator;
    bool own_secret = false;  // made from a public key: the institution keeps the secret
  };
  std::vector<Kit> kits = {{"aggregator", out / "aggregator", true}};
  for (const std::string& site : plan->sites) kits.push_back({site, out / site, false});
  std::vector<std::string> from_public, missing;
  if (!flags.from_public.empty()) {
    if (!fs::is_directory(flags.from_public)) {
      return fail(flags, invalid_argument("--from-public " + flags.from_public + " is not a directory"));
    }
    for (const std::string& site : plan->sites) {
      if (!fs::exists(fs::path(flags.from_public) / (site + ".pub")) && !fs::exists(out / site / (site + ".key")) &&
          !fs::exists(out / site / (site + ".pub"))) {
        missing.push_back(site + ".pub");
      }
    }
    if (!missing.empty()) {
      std::string list;
      for (const std::string& m : missing) list += (list.empty() ? "" : ", ") + m;
      return fail(flags, invalid_argument("--from-public " + flags.from_public + " lacks " + list +
                                          ": each institution runs `fedmesh keygen --name SITE` and sends only SITE.pub"));
    }
  }
  for (Kit& kit : kits) {
    std::error_code made_dir;
    fs::create_directories(kit.dir, made_dir);
    KeySource source = KeySource::kKept;
    Result<crypto::PublicIdentity> identity = identity_in(kit.dir, kit.name, flags.from_public, source);
    if (!identity.is_ok()) return fail(flags, identity.status());
    kit.own_secret = source == KeySource::kPublic;
    (source == KeySource::kMade ? created : source == KeySource::kKept ? kept : from_public).push_back(kit.name);
    roster.sites.push_back({*identity, kit.aggregator ? crypto::Role::kAggregator : crypto::Role::kSite,
                            kit.aggregator ? plan->aggregator : ""});
  }
  if (Status s = crypto::sign_roster(roster, *admin); !s.is_ok()) return fail(flags, s);
  const std::string admin_hex = crypto::to_hex(admin->identity.sign_public);
  FEDMESH_CHECK(crypto::verify_roster(roster, admin->identity.sign_public).is_ok(), "a roster signed just now verifies");
  if (Status s = crypto::write_roster(roster, out / "roster.toml"); !s.is_ok()) return fail(flags, s);
  for (size_t i = 0; i < kits.size(); ++i) {
    const Kit& kit = kits[i];
    Status s = crypto::write_roster(roster, kit.dir / "roster.toml");
    const std::string config = kit.aggregator ? "agg.toml" : "site.toml";
    if (s.is_ok()) {
      s = write_text(kit.dir / config, kit.aggregator ? aggregator_config(*plan, admin_hex)
                                                      : site_config(*plan, kit.name, i - 1, admin_hex));
    }
    if (s.is_ok() && !plan->init.empty()) {
      std::error_code copied;
      fs::copy_file(plan->init, kit.dir / init_file_name(*plan), fs::copy_options::overwrite_existing, copied);
      if (copied) s = io_error("cannot copy " + plan->init + " into " + kit.dir.string() + ": " + copied.message());
    }
    if (s.is_ok()) s = write_text(kit.dir / "README.md", kit_readme(*plan, kit.name, kit.aggregator, kit.own_secret));
    if (s.is_ok()) s = write_text(kit.dir / "start.sh", start_script(kit.aggregator ? "aggregator" : "node", config), 0755);
    if (!s.is_ok()) return fail(flags, s);
  }
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "provision"}, {"federation", plan->name}, {"out", out.string()},
               {"sites", plan->sites}, {"keys_created", created}, {"keys_kept", kept}, {"keys_from_public", from_public},
               {"admin_public", admin_hex}, {"roster", (out / "roster.toml").string()}});
  } else {
    std::printf("federation %s: %zu site kits and the aggregator's in %s (keys made: %zu, kept: %zu)\n",
                plan->name.c_str(), plan->sites.size(), out.string().c_str(), created.size(), kept.size());
    std::printf("send each institution its own directory %s/SITE/ only; %s/admin/ stays with you\n",
                out.string().c_str(), out.string().c_str());
    for (const std::string& name : from_public) {
      std::printf("%s: made from its public key; it copies its own %s.key into the kit before starting\n",
                  name.c_str(), name.c_str());
    }
  }
  return 0;
}

}  // namespace

void add_provision_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<ProvisionFlags>();
  CLI::App* cmd = app.add_subcommand(
      "provision",
      "Make a federation's startup kits from one description: the admin key (made once), the signed roster, and "
      "per site and for the aggregator a directory with its own keys only, the roster, a ready config, a README "
      "and start.sh. Run again with sites added: only the new sites get keys, the roster is re-signed.");
  cmd->add_option("--federation", flags->federation_file,
                  "federation.toml: name, aggregator (tcp://HOST:PORT the sites dial), sites = [names], and "
                  "optionally listen, mode (trusted|private), model, strategy, rounds, local_steps, init (weights "
                  "file every kit gets a copy of and starts from) and init_format (fedmesh|hf-gpt2)")
      ->required();
  cmd->add_option("--out", flags->out, "Directory of the kits (created; existing keys in it are kept)")->required();
  cmd->add_option("--from-public", flags->from_public,
                  "Directory of the public keys the institutions sent (SITE.pub, made by `fedmesh keygen --name "
                  "SITE`; aggregator.pub optional): their kits hold no secret, each site keeps its own SITE.key");
  cmd->add_flag("--json", flags->json, "Print one JSON summary line");
  cmd->callback([flags, &exit_code] { exit_code = run_provision(*flags); });
}

}  // namespace fedmesh::cli
