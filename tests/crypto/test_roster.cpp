#include "crypto/roster.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fedmesh::crypto {
namespace {

namespace fs = std::filesystem;

SiteKeys make_keys(const std::string& name) {
  Result<SiteKeys> keys = generate_site_keys(name);
  FEDMESH_CHECK(keys.is_ok(), keys.status().to_string());
  return std::move(keys).value();
}

class RosterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    admin_ = make_keys("admin");
    roster_.federation = "fed-demo";
    roster_.admin_public = admin_.identity.sign_public;
    roster_.sites.push_back({make_keys("site-a").identity, Role::kSite, "tcp://10.0.0.5:7400"});
    roster_.sites.push_back({make_keys("site-b").identity, Role::kPeer, ""});
    roster_.sites.push_back({make_keys("agg").identity, Role::kAggregator, "tcp://[::1]:7500"});
  }

  // A signed copy of the fixture.
  Roster signed_roster() {
    Roster roster = roster_;
    EXPECT_TRUE(sign_roster(roster, admin_).is_ok());
    return roster;
  }

  static void expect_rejected(const Roster& roster, const SignPublicKey& pinned, const std::string& why) {
    const Status status = verify_roster(roster, pinned);
    ASSERT_FALSE(status.is_ok()) << why;
    EXPECT_NE(status.message().find(why), std::string::npos) << status.message();
  }

  static void expect_parse_error(const std::string& text, const std::string& why) {
    Result<Roster> r = parse_roster(text);
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_TRUE(r.status().code() == StatusCode::kCorrupt || r.status().code() == StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  }

  std::string site_text(const std::string& name, const std::string& role, const SiteKeys& keys,
                        const std::string& address = "") {
    return "\n[[site]]\nname = \"" + name + "\"\nrole = \"" + role + "\"\nsign_public = \"" +
           to_hex(keys.identity.sign_public) + "\"\nbox_public = \"" + to_hex(keys.identity.box_public) +
           "\"\naddress = \"" + address + "\"\n";
  }
  std::string header_text() { return "federation = \"fed\"\nadmin_public = \"" + to_hex(roster_.admin_public) + "\"\n"; }

  SiteKeys admin_;
  Roster roster_;
};

bool same(const Roster& a, const Roster& b) {
  return a.federation == b.federation && a.admin_public == b.admin_public && a.sites == b.sites &&
         a.signature == b.signature;
}

TEST_F(RosterTest, RolesByName) {
  for (Role role : {Role::kSite, Role::kAggregator, Role::kPeer}) {
    Result<Role> back = parse_role(role_name(role));
    ASSERT_TRUE(back.is_ok());
    EXPECT_EQ(*back, role);
  }
  Result<Role> bad = parse_role("observer");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("unknown role 'observer'"), std::string::npos);
}

TEST_F(RosterTest, FormatParsesBackEqual) {
  for (const Roster& roster : {roster_, signed_roster(), Roster{"empty", admin_.identity.sign_public, {}, {}}}) {
    const std::string text = format_roster(roster);
    Result<Roster> parsed = parse_roster(text);
    ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string() << "\n" << text;
    EXPECT_TRUE(same(*parsed, roster)) << text;
    EXPECT_EQ(format_roster(*parsed), text);
  }
}

TEST_F(RosterTest, Lookups) {
  EXPECT_EQ(roster_.find("site-b"), &roster_.sites[1]);
  EXPECT_EQ(roster_.find("nobody"), nullptr);
  EXPECT_EQ(roster_.find_by_box_key(roster_.sites[2].identity.box_public), &roster_.sites[2]);
  EXPECT_EQ(roster_.find_by_box_key(BoxPublicKey{}), nullptr);
}

TEST_F(RosterTest, SignAndVerify) {
  const Roster roster = signed_roster();
  ASSERT_TRUE(roster.signature.has_value());
  EXPECT_TRUE(verify_roster(roster, admin_.identity.sign_public).is_ok());
  // Survives a trip through the file format.
  Result<Roster> parsed = parse_roster(format_roster(roster));
  ASSERT_TRUE(parsed.is_ok());
  EXPECT_TRUE(verify_roster(*parsed, admin_.identity.sign_public).is_ok());
}

TEST_F(RosterTest, OnlyTheAdminSigns) {
  Roster roster = roster_;
  const Status status = sign_roster(roster, make_keys("mallory"));
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("not this roster's admin"), std::string::npos) << status.message();
  EXPECT_FALSE(roster.signature.has_value());
}

TEST_F(RosterTest, EveryTamperFailsVerification) {
  const SignPublicKey& pinned = admin_.identity.sign_public;
  constexpr const char* kTampered = "does not verify";
  {
    Roster r = signed_roster();
    r.sites[0].address = "tcp://10.0.0.66:7400";
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites[1].identity.sign_public[0] ^= 1;
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites[1].identity.box_public = make_keys("x").identity.box_public;
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites[0].role = Role::kAggregator;
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites[0].identity.name = "site-z";
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.federation = "fed-other";
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    std::swap(r.sites[0], r.sites[1]);
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites.pop_back();
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.sites.push_back({make_keys("intruder").identity, Role::kSite, ""});
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    (*r.signature)[17] ^= 0x04;
    expect_rejected(r, pinned, kTampered);
  }
  {
    Roster r = signed_roster();
    r.signature.reset();
    expect_rejected(r, pinned, "unsigned");
  }
  {
    // An attacker swaps in their own admin key and signs with it: the pinned
    // key no longer matches.
    const SiteKeys mallory = make_keys("mallory");
    Roster r = roster_;
    r.admin_public = mallory.identity.sign_public;
    ASSERT_TRUE(sign_roster(r, mallory).is_ok());
    expect_rejected(r, pinned, "different admin");
    EXPECT_TRUE(verify_roster(r, mallory.identity.sign_public).is_ok());  // only under their own pin
  }
  {
    // The admin key swapped without re-signing, and a verifier that pins it.
    const SiteKeys mallory = make_keys("mallory");
    Roster r = signed_roster();
    r.admin_public = mallory.identity.sign_public;
    expect_rejected(r, mallory.identity.sign_public, kTampered);
  }
}

TEST_F(RosterTest, CanonicalBytesIgnoreLayoutButNotValues) {
  const Roster roster = signed_roster();
  // Comments, blank lines and key order within a table do not matter.
  std::string text = "# hello\n\n" + header_text();
  text.replace(text.find("\"fed\""), 5, "\"fed-demo\"");
  text += "signature = \"" + to_hex(*roster.signature) + "\"\n";
  for (const RosterEntry& site : roster.sites) {
    text += "\n[[site]]\naddress = \"" + site.address + "\"\nbox_public = \"" + to_hex(site.identity.box_public) +
            "\"  # transport\nsign_public = \"" + to_hex(site.identity.sign_public) + "\"\nrole = \"" +
            role_name(site.role) + "\"\nname = \"" + site.identity.name + "\"\n";
  }
  Result<Roster> parsed = parse_roster(text);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(canonical_bytes(*parsed), canonical_bytes(roster));
  EXPECT_TRUE(verify_roster(*parsed, admin_.identity.sign_public).is_ok());
  // The signature itself is not covered.
  Roster unsigned_copy = roster;
  unsigned_copy.signature.reset();
  EXPECT_EQ(canonical_bytes(unsigned_copy), canonical_bytes(roster));
  // Moving a byte between adjacent fields changes the encoding (length prefixes).
  Roster a = roster_, b = roster_;
  a.sites[1].identity.name = "ab";
  a.sites[1].address = "";
  b.sites[1].identity.name = "a";
  b.sites[1].address = "";
  EXPECT_NE(canonical_bytes(a), canonical_bytes(b));
  const std::vector<uint8_t> bytes = canonical_bytes(roster_);
  const std::string domain = "fedmesh-roster-v1";
  ASSERT_GT(bytes.size(), 4 + domain.size());
  EXPECT_EQ(bytes[0], domain.size());
  EXPECT_EQ(std::string(bytes.begin() + 4, bytes.begin() + 4 + domain.size()), domain);
}

TEST_F(RosterTest, MalformedRostersAreRejectedWithAReason) {
  const SiteKeys a = make_keys("a"), b = make_keys("b");
  const std::string header = header_text();
  ASSERT_TRUE(parse_roster(header + site_text("a", "site", a) + site_text("b", "peer", b)).is_ok());

  std::string short_key = header + site_text("a", "site", a);
  short_key.replace(short_key.find(to_hex(a.identity.sign_public)), 64, "abcd");
  expect_parse_error(short_key, "site 1 ('a'): field 'sign_public': expected 64 hex digits, got 4");
  std::string bad_digit = header + site_text("a", "site", a);
  bad_digit.replace(bad_digit.find(to_hex(a.identity.box_public)), 1, "z");
  expect_parse_error(bad_digit, "field 'box_public': not a hex digit");
  expect_parse_error("federation = \"fed\"\nadmin_public = \"00\"\n", "admin_public");
  expect_parse_error(header + "signature = \"1234\"\n", "signature");

  expect_parse_error(header + site_text("a", "site", a) + site_text("a", "site", b), "duplicate name");
  expect_parse_error(header + site_text("a", "site", a) + site_text("b", "site", a), "duplicate sign_public");
  std::string same_box = header + site_text("a", "site", a) + site_text("b", "site", b);
  same_box.replace(same_box.rfind(to_hex(b.identity.box_public)), 64, to_hex(a.identity.box_public));
  expect_parse_error(same_box, "duplicate box_public");

  expect_parse_error(header + site_text("a", "observer", a), "unknown role 'observer'");
  expect_parse_error(header + site_text("Site A", "site", a), "name 'Site A'");
  expect_parse_error(header + site_text("a/../b", "site", a), "not allowed");
  expect_parse_error(header + site_text("a", "site", a, "http://x:1"), "tcp://HOST:PORT");
  expect_parse_error(header + site_text("a", "site", a, "tcp://host:99999"), "port");
  expect_parse_error(header + site_text("a", "site", a, "tcp://host"), "tcp://HOST:PORT");
  expect_parse_error(header + site_text("a", "site", a, "tcp://a b:1"), "address");
  expect_parse_error(header + site_text("a", "site", a, "tcp://h:1" + std::string(300, '1')), "limit");
  EXPECT_TRUE(parse_roster(header + site_text("a", "site", a, "ipc:///tmp/a.sock")).is_ok());
  EXPECT_TRUE(parse_roster(header + site_text("a", "site", a, "tcp://*:7400")).is_ok());

  expect_parse_error("federation = \"Fed Demo\"\nadmin_public = \"" + to_hex(roster_.admin_public) + "\"\n",
                     "federation id");
  expect_parse_error("admin_public = \"" + to_hex(roster_.admin_public) + "\"\n", "missing field 'federation'");
  expect_parse_error(header + "extra = true\n", "unknown field 'extra'");
  expect_parse_error(header + "\"\\u0007\\u001b[2J\" = true\n", "unknown field '??[2J'");
  expect_parse_error(header + "[[site]]\nname = \"a\"\n", "missing field 'role'");
  expect_parse_error(header + site_text("a", "site", a) + "comment = \"x\"\n", "unknown field 'comment'");
  expect_parse_error(header + "site = 3\n", "array of tables");
  expect_parse_error(header + "site = [1, 2]\n", "array of tables");
  expect_parse_error("this is not toml at all {{{", "not valid TOML at line 1");
  expect_parse_error("federation = \"fed\"\n\nadmin_public = \"unterminated\n", "line 3");
  expect_parse_error(std::string("\0\xff\xfe", 3), "not valid TOML");
  expect_parse_error(std::string(kMaxRosterFileBytes + 1, ' '), "limit");
}

TEST_F(RosterTest, TooManySites) {
  std::string text = header_text();
  text.reserve(text.size() + (kMaxRosterSites + 1) * 40);
  for (size_t i = 0; i <= kMaxRosterSites; ++i) text += "[[site]]\n";
  Result<Roster> r = parse_roster(text);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("more than the limit of " + std::to_string(kMaxRosterSites)), std::string::npos)
      << r.status().message();
}

// toml++ recurses once per dotted-key component with no depth limit; about
// 60,000 components overflowed the stack before the parser bounded them.
TEST_F(RosterTest, DeepDottedKeysAreRefusedBeforeTheyReachToml) {
  for (const std::string& prefix : {std::string("a"), std::string("[a"), std::string("[[site")}) {
    std::string text = header_text() + prefix;
    for (int i = 0; i < 100000; ++i) text += ".a";
    text += prefix[0] == '[' ? "]\n" : " = 1\n";
    Result<Roster> r = parse_roster(text);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("line 3 has more than"), std::string::npos) << r.status().message();
  }
  Result<PublicIdentity> pub = parse_public_identity("a" + std::string(8000, '.') + " = 1\n");
  ASSERT_FALSE(pub.is_ok());
  EXPECT_NE(pub.status().message().find("line 1 has more than"), std::string::npos) << pub.status().message();
}

TEST_F(RosterTest, FileRoundTripIsAtomicAndBounded) {
  std::string pattern = (fs::temp_directory_path() / "fedmesh-roster-XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path dir = pattern;
  const fs::path file = dir / "roster.toml";
  const Roster roster = signed_roster();
  ASSERT_TRUE(write_roster(roster, file).is_ok());
  ASSERT_TRUE(write_roster(roster, file).is_ok());  // replaces
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 1u);  // no temporary file left behind
  struct stat info {};
  ASSERT_EQ(::stat(file.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0644u);
  Result<Roster> back = read_roster(file);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_TRUE(same(*back, roster));
  EXPECT_TRUE(verify_roster(*back, admin_.identity.sign_public).is_ok());

  EXPECT_EQ(read_roster(dir / "missing.toml").status().code(), StatusCode::kNotFound);
  { std::ofstream(dir / "bad.toml") << "federation = 3\n"; }
  Result<Roster> bad = read_roster(dir / "bad.toml");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find((dir / "bad.toml").string()), std::string::npos);
  fs::resize_file(dir / "bad.toml", kMaxRosterFileBytes + 1);
  Result<Roster> huge = read_roster(dir / "bad.toml");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("limit"), std::string::npos) << huge.status().message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fedmesh::crypto
