// At most one log line per key per interval; the rest counted and named in
// the key's next line (protocol/refusal_log.h).
#include <gtest/gtest.h>

#include <string>

#include "protocol/refusal_log.h"

namespace fedmesh::protocol {
namespace {

using namespace std::chrono_literals;

TEST(RefusalLog, OneLinePerKeyPerIntervalAndTheRestCounted) {
  RefusalLog log(10s);
  const RefusalLog::Clock::time_point start{};
  int lines = 0;
  constexpr int kRefusals = 10'000;
  // A flood over 25 s, one refusal every 2.5 ms: three intervals' worth.
  for (int i = 0; i < kRefusals; ++i) {
    const auto now = start + std::chrono::microseconds(2500) * i;
    if (log.admit("flooder", now)) ++lines;
  }
  EXPECT_EQ(lines, 3);
  EXPECT_EQ(log.suppressed_total(), static_cast<uint64_t>(kRefusals - lines));
  // The next line after the interval says how many were left out.
  const auto after = log.admit("flooder", start + 40s);
  ASSERT_TRUE(after.has_value());
  EXPECT_GT(*after, 0u);
}

TEST(RefusalLog, KeysAreIndependent) {
  RefusalLog log(10s);
  const RefusalLog::Clock::time_point start{};
  for (int i = 0; i < 100; ++i) (void)log.admit("flooder", start + std::chrono::milliseconds(i));
  // Another key, under whatever name, still gets its line.
  const auto honest = log.admit("honest", start + 50ms);
  ASSERT_TRUE(honest.has_value());
  EXPECT_EQ(*honest, 0u);
  const auto flooder = log.admit("flooder", start + 11s);
  ASSERT_TRUE(flooder.has_value());
  EXPECT_EQ(*flooder, 99u);
}

TEST(RefusalLog, ManyKeysStayBounded) {
  RefusalLog log(10s);
  const RefusalLog::Clock::time_point start{};
  int lines = 0;
  for (size_t i = 0; i < 3 * kMaxRefusalLogKeys; ++i) {
    if (log.admit("key-" + std::to_string(i), start)) ++lines;
  }
  EXPECT_EQ(lines, static_cast<int>(3 * kMaxRefusalLogKeys));  // each new key gets its first line
}

}  // namespace
}  // namespace fedmesh::protocol
