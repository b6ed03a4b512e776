#include "crypto/keys.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fedmesh::crypto {
namespace {

namespace fs = std::filesystem;

class KeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "fedmesh-keys-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read_text(const fs::path& file) {
    std::ifstream in(file);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void write_text(const fs::path& file, const std::string& text, mode_t mode) {
    { std::ofstream(file, std::ios::trunc) << text; }
    ASSERT_EQ(::chmod(file.c_str(), mode), 0);
  }
  static mode_t mode_of(const fs::path& file) {
    struct stat info {};
    EXPECT_EQ(::stat(file.c_str(), &info), 0);
    return info.st_mode & 07777;
  }

  fs::path dir_;
};

TEST_F(KeysTest, SiteNames) {
  EXPECT_TRUE(check_site_name("site-a").is_ok());
  EXPECT_TRUE(check_site_name("0.hospital_b-2").is_ok());
  EXPECT_TRUE(check_site_name(std::string(kMaxSiteNameBytes, 'a')).is_ok());
  EXPECT_FALSE(check_site_name("").is_ok());
  EXPECT_FALSE(check_site_name(std::string(kMaxSiteNameBytes + 1, 'a')).is_ok());
  EXPECT_FALSE(check_site_name("-site").is_ok());
  EXPECT_FALSE(check_site_name("Site").is_ok());
  EXPECT_FALSE(check_site_name("a b").is_ok());
  EXPECT_FALSE(check_site_name("a/b").is_ok());
  const Status bad = check_site_name("a\"b");
  EXPECT_NE(bad.message().find("position 1"), std::string::npos) << bad.message();
}

TEST_F(KeysTest, HexIsStrict) {
  const uint8_t bytes[] = {0x00, 0x7f, 0xab, 0xff};
  EXPECT_EQ(to_hex(bytes), "007fabff");
  std::array<uint8_t, 4> out{};
  ASSERT_TRUE(from_hex("007FaBff", out, "x").is_ok());
  EXPECT_EQ(0, std::memcmp(out.data(), bytes, 4));
  const Status short_hex = from_hex("007fab", out, "field 'k'");
  EXPECT_EQ(short_hex.code(), StatusCode::kCorrupt);
  EXPECT_NE(short_hex.message().find("field 'k'"), std::string::npos);
  EXPECT_NE(short_hex.message().find("expected 8 hex digits"), std::string::npos) << short_hex.message();
  EXPECT_FALSE(from_hex("007fabfg", out, "x").is_ok());
  EXPECT_FALSE(from_hex("007fab f", out, "x").is_ok());
  EXPECT_FALSE(from_hex("0x7fabff", out, "x").is_ok());
}

TEST_F(KeysTest, WriteCreatesAPrivateKeyFileAndAPublicFile) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  ASSERT_TRUE(write_site_keys(*keys, dir_).is_ok());
  EXPECT_EQ(mode_of(dir_ / "site-a.key"), 0600u);
  EXPECT_EQ(mode_of(dir_ / "site-a.pub"), 0644u);
  // The public file holds no secret.
  const std::string pub = read_text(dir_ / "site-a.pub");
  EXPECT_EQ(pub.find("secret"), std::string::npos);
  EXPECT_EQ(pub, format_public_identity(keys->identity));
}

TEST_F(KeysTest, CreatesAMissingDirectoryPrivately) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  ASSERT_TRUE(keys.is_ok());
  const fs::path nested = dir_ / "keys";
  ASSERT_TRUE(write_site_keys(*keys, nested).is_ok());
  EXPECT_EQ(mode_of(nested), 0700u);
}

TEST_F(KeysTest, RoundTrip) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  ASSERT_TRUE(keys.is_ok());
  ASSERT_TRUE(write_site_keys(*keys, dir_).is_ok());
  Result<SiteKeys> back = read_site_keys(dir_ / "site-a.key");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->identity, keys->identity);
  EXPECT_EQ(0, std::memcmp(back->sign_secret.data(), keys->sign_secret.data(), kSignSecretBytes));
  EXPECT_EQ(0, std::memcmp(back->box_secret.data(), keys->box_secret.data(), kBoxSecretBytes));
  Result<PublicIdentity> pub = read_public_identity(dir_ / "site-a.pub");
  ASSERT_TRUE(pub.is_ok()) << pub.status().to_string();
  EXPECT_EQ(*pub, keys->identity);

  // The read key signs what the public half verifies.
  const uint8_t message[] = {1, 2, 3};
  const Signature signature = sign_detached(message, back->sign_secret);
  EXPECT_TRUE(verify_detached(message, signature, pub->sign_public));
  const uint8_t other[] = {1, 2, 4};
  EXPECT_FALSE(verify_detached(other, signature, pub->sign_public));
}

TEST_F(KeysTest, TwoKeysDiffer) {
  Result<SiteKeys> a = generate_site_keys("a");
  Result<SiteKeys> b = generate_site_keys("a");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_NE(a->identity.sign_public, b->identity.sign_public);
  EXPECT_NE(a->identity.box_public, b->identity.box_public);
}

TEST_F(KeysTest, RefusesToOverwrite) {
  Result<SiteKeys> first = generate_site_keys("site-a");
  Result<SiteKeys> second = generate_site_keys("site-a");
  ASSERT_TRUE(first.is_ok() && second.is_ok());
  ASSERT_TRUE(write_site_keys(*first, dir_).is_ok());
  const std::string before = read_text(dir_ / "site-a.key");
  const Status again = write_site_keys(*second, dir_);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.message().find("already exists"), std::string::npos) << again.message();
  EXPECT_EQ(read_text(dir_ / "site-a.key"), before);
  Result<PublicIdentity> pub = read_public_identity(dir_ / "site-a.pub");
  ASSERT_TRUE(pub.is_ok());
  EXPECT_EQ(*pub, first->identity);
}

TEST_F(KeysTest, RefusesASecretFileOthersCanRead) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  ASSERT_TRUE(keys.is_ok());
  ASSERT_TRUE(write_site_keys(*keys, dir_).is_ok());
  const fs::path key_file = dir_ / "site-a.key";
  for (const mode_t mode : {0644, 0640, 0604, 0601}) {
    ASSERT_EQ(::chmod(key_file.c_str(), mode), 0);
    Result<SiteKeys> read = read_site_keys(key_file);
    ASSERT_FALSE(read.is_ok()) << std::oct << mode;
    EXPECT_NE(read.status().message().find("chmod 600"), std::string::npos) << read.status().message();
    EXPECT_NE(read.status().message().find(key_file.string()), std::string::npos);
  }
  ASSERT_EQ(::chmod(key_file.c_str(), 0400), 0);
  EXPECT_TRUE(read_site_keys(key_file).is_ok());
}

TEST_F(KeysTest, RefusesAKeyFileWhosePublicHalvesWereEdited) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  Result<SiteKeys> other = generate_site_keys("site-b");
  ASSERT_TRUE(keys.is_ok() && other.is_ok());
  ASSERT_TRUE(write_site_keys(*keys, dir_).is_ok());
  const fs::path key_file = dir_ / "site-a.key";
  const std::string original = read_text(key_file);

  for (const char* field : {"sign_public", "box_public"}) {
    std::string text = original;
    const std::string mine = field == std::string("sign_public") ? to_hex(keys->identity.sign_public)
                                                                 : to_hex(keys->identity.box_public);
    const std::string theirs = field == std::string("sign_public") ? to_hex(other->identity.sign_public)
                                                                   : to_hex(other->identity.box_public);
    text.replace(text.find(mine), mine.size(), theirs);
    write_text(key_file, text, 0600);
    Result<SiteKeys> read = read_site_keys(key_file);
    ASSERT_FALSE(read.is_ok()) << field;
    EXPECT_EQ(read.status().code(), StatusCode::kCorrupt);
    EXPECT_NE(read.status().message().find(std::string(field) + " does not match"), std::string::npos)
        << read.status().message();
  }
}

TEST_F(KeysTest, MalformedKeyFilesAreRejectedByField) {
  const fs::path key_file = dir_ / "bad.key";
  write_text(key_file, "name = \"bad\"\nsign_public = \"00\"\n", 0600);
  Result<SiteKeys> short_key = read_site_keys(key_file);
  ASSERT_FALSE(short_key.is_ok());
  EXPECT_NE(short_key.status().message().find("sign_public"), std::string::npos) << short_key.status().message();

  write_text(key_file, "this is = = not toml", 0600);
  Result<SiteKeys> garbage = read_site_keys(key_file);
  ASSERT_FALSE(garbage.is_ok());
  EXPECT_EQ(garbage.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(garbage.status().message().find("line 1"), std::string::npos) << garbage.status().message();

  EXPECT_EQ(read_site_keys(dir_ / "missing.key").status().code(), StatusCode::kNotFound);

  // A symbolic link is not followed to a key.
  Result<SiteKeys> keys = generate_site_keys("real");
  ASSERT_TRUE(keys.is_ok());
  ASSERT_TRUE(write_site_keys(*keys, dir_).is_ok());
  fs::create_symlink(dir_ / "real.key", dir_ / "link.key");
  EXPECT_FALSE(read_site_keys(dir_ / "link.key").is_ok());
}

TEST_F(KeysTest, PublicIdentityParsing) {
  Result<SiteKeys> keys = generate_site_keys("site-a");
  ASSERT_TRUE(keys.is_ok());
  const std::string text = format_public_identity(keys->identity);
  Result<PublicIdentity> parsed = parse_public_identity(text);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(*parsed, keys->identity);

  // Key order and comments do not matter.
  const std::string reordered = "# a comment\nbox_public = \"" + to_hex(keys->identity.box_public) +
                                "\"\nsign_public = \"" + to_hex(keys->identity.sign_public) + "\"\nname = \"site-a\"\n";
  Result<PublicIdentity> again = parse_public_identity(reordered);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(*again, keys->identity);

  const auto rejects = [](const std::string& bad, const std::string& expected) {
    Result<PublicIdentity> r = parse_public_identity(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_NE(r.status().message().find(expected), std::string::npos) << r.status().message();
  };
  rejects("name = \"site-a\"\n", "missing field 'sign_public'");
  rejects(text + "extra = 1\n", "unknown field 'extra'");
  rejects("name = 7\n", "'name' must be a string");
  rejects("name = \"Site A\"\nsign_public = \"\"\nbox_public = \"\"\n", "name 'Site A'");
  rejects(text + "sign_secret = \"00\"\n", "pass the .pub file");
  rejects("\x01\x02garbage[[", "not valid TOML");
  // Control characters from the file never reach a terminal through a message.
  rejects(text + "\"\\u001b[2J\" = 1\n", "unknown field '?[2J'");
  rejects("name = \"a\\u001b[2J\"\nsign_public = \"\"\nbox_public = \"\"\n", "name 'a?[2J'");
}

}  // namespace
}  // namespace fedmesh::crypto
