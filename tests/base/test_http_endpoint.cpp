// The HTTP endpoint on loopback: pages by path, the access token (bearer
// header or query, 401 and counted otherwise, open pages exempt), what
// counts as loopback, and the token rules.

#include <gtest/gtest.h>

#include <string>

#include "base/http_endpoint.h"

namespace fedmesh {
namespace {

constexpr const char* kToken = "0123456789abcdef-token";

std::unique_ptr<HttpEndpoint> start(const std::string& token) {
  std::map<std::string, HttpPage> pages = metrics_and_status_pages([] { return std::string("metric 1\n"); },
                                                                   [] { return std::string("{\"ok\":true}"); });
  pages["/broken"] = {"text/plain", []() -> std::string { throw std::runtime_error("render failed"); }};
  Result<std::unique_ptr<HttpEndpoint>> endpoint = HttpEndpoint::start("127.0.0.1:0", std::move(pages), {token});
  EXPECT_TRUE(endpoint.is_ok()) << endpoint.status().to_string();
  return endpoint.is_ok() ? std::move(*endpoint) : nullptr;
}

int status_of(const HttpEndpoint& endpoint, const std::string& path, const std::string& bearer = "") {
  Result<HttpReply> reply = http_fetch(endpoint.address(), path, bearer);
  EXPECT_TRUE(reply.is_ok()) << reply.status().to_string();
  return reply.is_ok() ? reply->status : -1;
}

TEST(HttpEndpoint, WithoutATokenEveryPageIsOpen) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  Result<std::string> body = http_get(endpoint->address(), "/status");
  ASSERT_TRUE(body.is_ok()) << body.status().to_string();
  EXPECT_EQ(*body, "{\"ok\":true}");
  EXPECT_EQ(status_of(*endpoint, "/metrics"), 200);
  EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);
  EXPECT_EQ(status_of(*endpoint, "/nothing-here"), 404);
  EXPECT_EQ(endpoint->unauthorized_requests(), 0);
}

TEST(HttpEndpoint, ATokenGuardsEveryPageButTheOpenOnes) {
  std::unique_ptr<HttpEndpoint> endpoint = start(kToken);
  ASSERT_TRUE(endpoint);
  EXPECT_EQ(status_of(*endpoint, "/status"), 401);
  EXPECT_EQ(status_of(*endpoint, "/metrics"), 401);
  EXPECT_EQ(status_of(*endpoint, "/status", "0123456789abcdef-tokeN"), 401);  // one byte off
  EXPECT_EQ(status_of(*endpoint, "/status", "0123456789abcdef-token-and-more"), 401);
  EXPECT_EQ(status_of(*endpoint, "/status?token=0123456789abcdef"), 401);
  EXPECT_EQ(endpoint->unauthorized_requests(), 5);
  EXPECT_EQ(status_of(*endpoint, "/status", kToken), 200);
  EXPECT_EQ(status_of(*endpoint, std::string("/metrics?token=") + kToken), 200);
  EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);  // open: liveness probes carry no token
  EXPECT_EQ(endpoint->unauthorized_requests(), 5);
  // http_get names the 401.
  Result<std::string> refused = http_get(endpoint->address(), "/status");
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("401"), std::string::npos) << refused.status().message();
}

TEST(HttpEndpoint, APageThatFailsToRenderAnswers500AndTheEndpointServesOn) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  EXPECT_EQ(status_of(*endpoint, "/broken"), 500);
  EXPECT_EQ(status_of(*endpoint, "/status"), 200);
}

TEST(HttpEndpoint, RefusesABadTokenOrAddress) {
  EXPECT_FALSE(HttpEndpoint::start("127.0.0.1:0", {}, {"short"}).is_ok());
  EXPECT_FALSE(HttpEndpoint::start("127.0.0.1:0", {}, {"has a space in it, long enough"}).is_ok());
  EXPECT_FALSE(HttpEndpoint::start("nonsense", {}, {}).is_ok());
}

TEST(HttpEndpoint, TellsLoopbackFromExposedHosts) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) {
    EXPECT_TRUE(is_loopback_host(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.org", "", "127.0.0.1.example.org",
                           "128.0.0.1"}) {
    EXPECT_FALSE(is_loopback_host(host)) << host;
  }
}

TEST(HttpEndpoint, TokensCompareByContent) {
  EXPECT_TRUE(access_token_matches(kToken, kToken));
  EXPECT_FALSE(access_token_matches("", kToken));
  EXPECT_FALSE(access_token_matches(std::string(kToken) + "x", kToken));
  EXPECT_TRUE(check_access_token(kToken).is_ok());
  EXPECT_FALSE(check_access_token(std::string(kMinAccessTokenChars - 1, 'a')).is_ok());
  EXPECT_FALSE(check_access_token(std::string(kMaxAccessTokenChars + 1, 'a')).is_ok());
  EXPECT_FALSE(check_access_token(std::string(kMinAccessTokenChars, 'a') + "\n").is_ok());
}

}  // namespace
}  // namespace fedmesh
