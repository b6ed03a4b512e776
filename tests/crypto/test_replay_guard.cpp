#include "crypto/replay_guard.h"

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

class ReplayGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "fedmesh-replay-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    file_ = dir_ / "replay.txt";
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write_file(const std::string& text) { std::ofstream(file_, std::ios::trunc | std::ios::binary) << text; }
  std::string read_file() {
    std::ifstream in(file_, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  fs::path dir_;
  fs::path file_;
};

TEST_F(ReplayGuardTest, InMemoryIsMonotonic) {
  ReplayGuard guard = ReplayGuard::in_memory();
  EXPECT_EQ(guard.last_accepted("site-a"), 0u);
  EXPECT_FALSE(guard.check("site-a", 0).is_ok());
  EXPECT_TRUE(guard.check("site-a", 1).is_ok());
  ASSERT_TRUE(guard.commit("site-a", 5).is_ok());
  EXPECT_EQ(guard.last_accepted("site-a"), 5u);
  const Status replay = guard.check("site-a", 5);
  EXPECT_EQ(replay.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(replay.message().find("'site-a'"), std::string::npos) << replay.message();
  EXPECT_NE(replay.message().find("sequence 5"), std::string::npos) << replay.message();
  EXPECT_NE(replay.message().find("last accepted 5"), std::string::npos) << replay.message();
  EXPECT_FALSE(guard.commit("site-a", 3).is_ok());
  EXPECT_EQ(guard.last_accepted("site-a"), 5u);
  EXPECT_TRUE(guard.commit("site-a", 6).is_ok());
  EXPECT_TRUE(guard.commit("site-a", 1000).is_ok());  // gaps are fine
  EXPECT_TRUE(guard.commit("site-b", 1).is_ok());     // per sender
  EXPECT_EQ(guard.last_accepted("site-a"), 1000u);
  EXPECT_EQ(guard.last_accepted("site-b"), 1u);
  EXPECT_TRUE(guard.commit("site-b", UINT64_MAX).is_ok());
  EXPECT_FALSE(guard.check("site-b", UINT64_MAX).is_ok());
  EXPECT_FALSE(guard.commit("bad name", 1).is_ok());
  EXPECT_FALSE(fs::exists(file_));
}

TEST_F(ReplayGuardTest, PersistsAcrossReopen) {
  {
    Result<ReplayGuard> guard = ReplayGuard::open(file_);
    ASSERT_TRUE(guard.is_ok()) << guard.status().to_string();
    EXPECT_EQ(guard->last_accepted("site-a"), 0u);
    ASSERT_TRUE(guard->commit("site-b", 3).is_ok());
    ASSERT_TRUE(guard->commit("site-a", 10).is_ok());
    ASSERT_TRUE(guard->commit("site-a", 11).is_ok());
    ASSERT_TRUE(guard->commit("site-c", UINT64_MAX).is_ok());
  }
  EXPECT_EQ(read_file(), "fedmesh-replay-v1\nsite-a 11\nsite-b 3\nsite-c 18446744073709551615\n");
  struct stat info {};
  ASSERT_EQ(::stat(file_.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u);  // no temporary file left behind

  Result<ReplayGuard> reopened = ReplayGuard::open(file_);
  ASSERT_TRUE(reopened.is_ok()) << reopened.status().to_string();
  EXPECT_EQ(reopened->last_accepted("site-a"), 11u);
  EXPECT_EQ(reopened->last_accepted("site-b"), 3u);
  EXPECT_FALSE(reopened->check("site-a", 11).is_ok());
  EXPECT_FALSE(reopened->commit("site-a", 2).is_ok());
  EXPECT_FALSE(reopened->check("site-c", UINT64_MAX).is_ok());
  EXPECT_TRUE(reopened->commit("site-a", 12).is_ok());
  Result<ReplayGuard> third = ReplayGuard::open(file_);
  ASSERT_TRUE(third.is_ok());
  EXPECT_EQ(third->last_accepted("site-a"), 12u);
}

TEST_F(ReplayGuardTest, AFailedPersistIsNotAccepted) {
  Result<ReplayGuard> guard = ReplayGuard::open(dir_ / "gone" / "replay.txt");
  ASSERT_TRUE(guard.is_ok());
  const Status status = guard->commit("site-a", 1);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(guard->last_accepted("site-a"), 0u);
}

TEST_F(ReplayGuardTest, CorruptFilesAreRefusedNotReset) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"fedmesh-replay-v2\n", "header"},
      {"fedmesh-replay-v1", "no newline"},
      {"fedmesh-replay-v1\nsite-a 5", "no newline"},
      {"fedmesh-replay-v1\nsite-a\n", "<sender> <sequence>"},
      {"fedmesh-replay-v1\nsite-a five\n", "decimal"},
      {"fedmesh-replay-v1\nsite-a 5 \n", "decimal"},
      {"fedmesh-replay-v1\nsite-a -5\n", "decimal"},
      {"fedmesh-replay-v1\nsite-a 0\n", "sequence 0"},
      {"fedmesh-replay-v1\nsite-a 007\n", "bad sequence"},
      {"fedmesh-replay-v1\nsite-a 18446744073709551616\n", "overflows"},
      {"fedmesh-replay-v1\nSite-A 5\n", "sender"},
      {"fedmesh-replay-v1\nsite-b 5\nsite-a 6\n", "increasing order"},
      {"fedmesh-replay-v1\nsite-a 5\nsite-a 6\n", "increasing order"},
      {"fedmesh-replay-v1\n\n", "<sender> <sequence>"},
      {std::string("fedmesh-replay-v1\nsite-a 5\0\n", 28), "decimal"},
  };
  for (const auto& [text, why] : cases) {
    write_file(text);
    Result<ReplayGuard> guard = ReplayGuard::open(file_);
    ASSERT_FALSE(guard.is_ok()) << text;
    EXPECT_EQ(guard.status().code(), StatusCode::kCorrupt) << text;
    EXPECT_NE(guard.status().message().find(why), std::string::npos) << guard.status().message();
    EXPECT_NE(guard.status().message().find(file_.string()), std::string::npos) << guard.status().message();
    EXPECT_EQ(read_file(), text);  // left as it was, for a person to look at
  }
  write_file("fedmesh-replay-v1\n");
  EXPECT_TRUE(ReplayGuard::open(file_).is_ok());
}

TEST_F(ReplayGuardTest, OversizedFileIsRefusedBeforeReading) {
  write_file("fedmesh-replay-v1\n");
  fs::resize_file(file_, 64u << 20);
  Result<ReplayGuard> guard = ReplayGuard::open(file_);
  ASSERT_FALSE(guard.is_ok());
  EXPECT_NE(guard.status().message().find("limit"), std::string::npos) << guard.status().message();
}

}  // namespace
}  // namespace fedmesh::crypto
