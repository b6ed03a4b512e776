// The main of every test binary: GoogleTest's, except that a binary whose
// tests were all skipped (a CUDA test on a machine without a GPU) exits with
// 77 so that meson reports it as SKIP rather than OK.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  const ::testing::UnitTest& tests = *::testing::UnitTest::GetInstance();
  constexpr int kMesonSkipExitCode = 77;
  if (status == 0 && tests.skipped_test_count() > 0 && tests.successful_test_count() == 0) return kMesonSkipExitCode;
  return status;
}
