#include "base/file_io.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fedmesh {
namespace {

namespace fs = std::filesystem;

class FileIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "fedmesh-file-io-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    // A umask that would narrow the requested modes, so the tests see that
    // the helpers set the mode exactly.
    old_umask_ = ::umask(077);
  }
  void TearDown() override {
    ::umask(old_umask_);
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, ignored);  // in case a test made it read-only
    fs::remove_all(dir_);
  }

  static std::string contents(const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void put(const fs::path& file, const std::string& text) {
    std::ofstream(file, std::ios::trunc | std::ios::binary) << text;
  }
  static mode_t mode_of(const fs::path& file) {
    struct stat info {};
    EXPECT_EQ(::stat(file.c_str(), &info), 0) << file;
    return info.st_mode & 07777;
  }
  std::vector<std::string> names_in_dir() const {
    std::vector<std::string> names;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename());
    return names;
  }

  fs::path dir_;
  mode_t old_umask_ = 0;
};

TEST_F(FileIoTest, ErrnoTextIsTheSystemMessage) {
  EXPECT_EQ(errno_text(ENOENT), "No such file or directory");
}

TEST_F(FileIoTest, AtomicWriteCreatesTheFileWithExactlyTheModeAndContent) {
  const fs::path file = dir_ / "table.txt";
  ASSERT_TRUE(write_file_atomically(file, "hello\n", 0644).is_ok());
  EXPECT_EQ(contents(file), "hello\n");
  EXPECT_EQ(mode_of(file), 0644u);  // not narrowed by the umask of 077

  const fs::path secret = dir_ / "secret.txt";
  ASSERT_TRUE(write_file_atomically(secret, std::string("a\0b", 3), 0600).is_ok());
  EXPECT_EQ(contents(secret), std::string("a\0b", 3));
  EXPECT_EQ(mode_of(secret), 0600u);
}

TEST_F(FileIoTest, AtomicWriteReplacesAnExistingFileWholly) {
  const fs::path file = dir_ / "table.txt";
  put(file, std::string(4096, 'x'));
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  ASSERT_TRUE(write_file_atomically(file, "short", 0644).is_ok());
  EXPECT_EQ(contents(file), "short");  // no tail of the longer old contents
  EXPECT_EQ(mode_of(file), 0644u);
  ASSERT_TRUE(write_file_atomically(file, "", 0644).is_ok());
  EXPECT_EQ(contents(file), "");
}

TEST_F(FileIoTest, AtomicWriteLeavesNoTemporaryFileBehind) {
  const fs::path file = dir_ / "table.txt";
  ASSERT_TRUE(write_file_atomically(file, "one", 0644).is_ok());
  ASSERT_TRUE(write_file_atomically(file, "two", 0644).is_ok());
  EXPECT_EQ(names_in_dir(), std::vector<std::string>{"table.txt"});
}

TEST_F(FileIoTest, AtomicWriteRemovesItsTemporaryFileWhenTheRenameFails) {
  // A non-empty directory at the name: the temporary is written, then the
  // rename over it fails.
  const fs::path file = dir_ / "occupied";
  fs::create_directory(file);
  put(file / "inside", "x");
  const Status status = write_file_atomically(file, "bytes", 0644);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(file.string() + ": rename failed"), std::string::npos) << status.message();
  EXPECT_EQ(names_in_dir(), std::vector<std::string>{"occupied"});
  EXPECT_EQ(contents(file / "inside"), "x");
}

TEST_F(FileIoTest, AtomicWriteIntoAMissingDirectoryFailsNamingTheFile) {
  const fs::path file = dir_ / "no-such-dir" / "table.txt";
  const Status status = write_file_atomically(file, "bytes", 0644);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(file.string() + ": cannot create a temporary file"), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("No such file or directory"), std::string::npos) << status.message();
}

TEST_F(FileIoTest, AtomicWriteIntoAReadOnlyDirectoryFailsNamingTheFile) {
  if (::geteuid() == 0) {
    GTEST_SKIP() << "running as root, which bypasses directory permissions: a read-only directory "
                    "cannot make the write fail";
  }
  const fs::path file = dir_ / "table.txt";
  put(file, "old");
  ASSERT_EQ(::chmod(dir_.c_str(), 0500), 0);
  const Status status = write_file_atomically(file, "new", 0644);
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(file.string() + ": cannot create a temporary file"), std::string::npos)
      << status.message();
  EXPECT_EQ(contents(file), "old");
  EXPECT_EQ(names_in_dir(), std::vector<std::string>{"table.txt"});
}

TEST_F(FileIoTest, FsyncDirectoryOfAMissingDirectoryNamesIt) {
  EXPECT_TRUE(fsync_directory(dir_).is_ok());
  const fs::path missing = dir_ / "gone";
  const Status status = fsync_directory(missing);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(missing.string() + ": cannot open directory"), std::string::npos)
      << status.message();
}

TEST_F(FileIoTest, ExclusiveCreateWritesWithExactlyTheMode) {
  const fs::path file = dir_ / "site.pub";
  ASSERT_TRUE(create_file_exclusively(file, "public\n", 0644).is_ok());
  EXPECT_EQ(contents(file), "public\n");
  EXPECT_EQ(mode_of(file), 0644u);
}

TEST_F(FileIoTest, ExclusiveCreateRefusesAnExistingFileAndLeavesItAlone) {
  const fs::path file = dir_ / "site.key";
  put(file, "precious");
  const Status status = create_file_exclusively(file, "other", 0600);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(file.string() + " already exists"), std::string::npos) << status.message();
  EXPECT_EQ(contents(file), "precious");
}

TEST_F(FileIoTest, ExclusiveCreateRefusesALinkAtTheName) {
  const fs::path target = dir_ / "elsewhere";
  const fs::path link = dir_ / "site.key";
  fs::create_symlink(target, link);  // dangling: following it would create `target`
  const Status status = create_file_exclusively(link, "secret", 0600);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(target));
}

TEST_F(FileIoTest, ExclusiveCreateIntoAMissingDirectoryNamesTheFile) {
  const fs::path file = dir_ / "no-such-dir" / "site.key";
  const Status status = create_file_exclusively(file, "secret", 0600);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find(file.string() + ": cannot create"), std::string::npos) << status.message();
}

TEST_F(FileIoTest, BoundedReadReadsFilesUpToTheLimit) {
  const fs::path file = dir_ / "roster.toml";
  put(file, "0123456789");
  Result<std::string> text = read_file_bounded(file, 10);
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  EXPECT_EQ(*text, "0123456789");

  put(file, "");
  Result<std::string> empty = read_file_bounded(file, 10);
  ASSERT_TRUE(empty.is_ok()) << empty.status().to_string();
  EXPECT_EQ(*empty, "");
}

TEST_F(FileIoTest, BoundedReadRefusesAnOversizeFileNamingIt) {
  const fs::path file = dir_ / "roster.toml";
  put(file, "0123456789X");
  Result<std::string> text = read_file_bounded(file, 10);
  ASSERT_FALSE(text.is_ok());
  EXPECT_EQ(text.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(text.status().message().find(file.string() + ": 11 bytes, more than the limit of 10"),
            std::string::npos)
      << text.status().message();

  // Refused from its size alone: a sparse 1 GiB file is never read.
  fs::resize_file(file, 1u << 30);
  EXPECT_EQ(read_file_bounded(file, 10).status().code(), StatusCode::kCorrupt);
}

TEST_F(FileIoTest, BoundedReadReportsMissingFilesAndNonRegularFiles) {
  const fs::path missing = dir_ / "gone";
  Result<std::string> gone = read_file_bounded(missing, 10);
  ASSERT_FALSE(gone.is_ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find(missing.string()), std::string::npos) << gone.status().message();

  Result<std::string> directory = read_file_bounded(dir_, 10);
  ASSERT_FALSE(directory.is_ok());
  EXPECT_EQ(directory.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(directory.status().message().find("not a regular file"), std::string::npos)
      << directory.status().message();
}

TEST_F(FileIoTest, BoundedReadRefusesSymlinksOnlyWhenAsked) {
  const fs::path file = dir_ / "real.pub";
  const fs::path link = dir_ / "link.pub";
  put(file, "contents");
  fs::create_symlink(file, link);

  Result<std::string> followed = read_file_bounded(link, 100);
  ASSERT_TRUE(followed.is_ok()) << followed.status().to_string();
  EXPECT_EQ(*followed, "contents");

  Result<std::string> refused = read_file_bounded(link, 100, {.refuse_symlinks = true});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(link.string() + ": is a symbolic link"), std::string::npos)
      << refused.status().message();
}

TEST_F(FileIoTest, BoundedSecretReadRefusesAFileOthersMayAccess) {
  const fs::path file = dir_ / "site.key";
  put(file, "secret");
  for (const mode_t mode : {0644, 0640, 0604, 0601}) {
    ASSERT_EQ(::chmod(file.c_str(), mode), 0);
    Result<std::string> text = read_file_bounded(file, 100, {.secret = true});
    ASSERT_FALSE(text.is_ok()) << std::oct << mode;
    EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(text.status().message().find("chmod 600 " + file.string()), std::string::npos)
        << text.status().message();
    // Without `secret` the mode does not matter.
    EXPECT_TRUE(read_file_bounded(file, 100).is_ok());
  }
  ASSERT_EQ(::chmod(file.c_str(), 0400), 0);
  Result<std::string> text = read_file_bounded(file, 100, {.secret = true});
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  EXPECT_EQ(*text, "secret");
}

}  // namespace
}  // namespace fedmesh
