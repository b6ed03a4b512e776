// The HTTP endpoint on loopback: pages by path, the access token (bearer
// header or query, 401 and counted otherwise, open pages exempt), what
// counts as loopback, and the token rules; the request head's parser and
// the bounds on clients (head size, head deadline, connection cap), with
// raw sockets playing the slow or greedy client.

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

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

TEST(HttpEndpoint, APortAlreadyBoundIsRefusedNamingTheAddress) {
  std::unique_ptr<HttpEndpoint> first = start("");
  ASSERT_TRUE(first);
  Result<std::unique_ptr<HttpEndpoint>> second = HttpEndpoint::start(first->address(), {}, {});
  ASSERT_FALSE(second.is_ok()) << "two endpoints on " << first->address();
  EXPECT_NE(second.status().message().find(first->address()), std::string::npos) << second.status().message();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status().message();
  EXPECT_EQ(status_of(*first, "/healthz"), 200) << "the first one serves on";
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

// A raw TCP connection to the endpoint (closed with the object).
class RawClient {
 public:
  explicit RawClient(const std::string& address) {
    const int port = std::stoi(address.substr(address.rfind(':') + 1));
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return fd_ >= 0; }
  // False once the endpoint has closed the connection (the write fails).
  bool send(const std::string& bytes) {
    return fd_ >= 0 && ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // Everything the endpoint sends until it closes the connection, or nullopt
  // if it has not closed it within `timeout`.
  std::optional<std::string> read_until_closed(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string received;
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd polled{fd_, POLLIN, 0};
      if (::poll(&polled, 1, static_cast<int>(left)) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) return received;  // closed (or reset)
      received.append(chunk, static_cast<size_t>(n));
    }
  }
  // Whether the endpoint has closed the connection, looking without waiting.
  bool closed_by_peer() {
    pollfd polled{fd_, POLLIN, 0};
    if (::poll(&polled, 1, 0) <= 0) return false;
    char byte;
    return ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0;
  }

 private:
  int fd_ = -1;
};

std::string raw_request(const std::string& address, const std::string& request) {
  RawClient client(address);
  EXPECT_TRUE(client.connected());
  EXPECT_TRUE(client.send(request));
  return client.read_until_closed(std::chrono::seconds(10)).value_or("(not closed)");
}

TEST(HttpRequestHead, ParsesMethodPathAndToken) {
  Result<HttpRequestHead> plain = parse_http_request_head("GET /status HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  EXPECT_EQ(plain->method, "GET");
  EXPECT_EQ(plain->path, "/status");
  EXPECT_EQ(plain->token, "");

  Result<HttpRequestHead> query = parse_http_request_head("GET /a%2Fb?x=1&token=ab%2Dcd+e&token=second HTTP/1.0\n\n");
  ASSERT_TRUE(query.is_ok()) << query.status().to_string();
  EXPECT_EQ(query->path, "/a/b");
  EXPECT_EQ(query->token, "ab-cd e");  // URL-decoded, the first one

  // The bearer header wins over the query; its name in any case.
  Result<HttpRequestHead> bearer =
      parse_http_request_head("GET /m?token=query HTTP/1.1\r\nauthorization:   Bearer header-token \r\n\r\n");
  ASSERT_TRUE(bearer.is_ok()) << bearer.status().to_string();
  EXPECT_EQ(bearer->token, "header-token");
  // Not a bearer credential: the query's token stands.
  Result<HttpRequestHead> basic =
      parse_http_request_head("GET /m?token=query HTTP/1.1\r\nAuthorization: Basic abc\r\n\r\n");
  ASSERT_TRUE(basic.is_ok());
  EXPECT_EQ(basic->token, "query");
}

TEST(HttpRequestHead, RefusesWhatIsMalformed) {
  using namespace std::string_literals;
  for (const std::string& head : {
           std::string(""),
           std::string("\r\n\r\n"),
           std::string("GET /status\r\n\r\n"),                 // no version
           std::string("GET status HTTP/1.1\r\n\r\n"),         // not a path
           std::string("get /status HTTP/1.1\r\n\r\n"),        // not a method token
           std::string("GET /status HTTP/2.0\r\n\r\n"),        // not HTTP/1.x
           std::string("GET /status HTTP/1.1\r\n"),            // no blank line
           std::string("GET /st%zztus HTTP/1.1\r\n\r\n"),      // broken escape
           std::string("GET /st%0 HTTP/1.1\r\n\r\n"),          // cut escape
           std::string("GET /st%00 HTTP/1.1\r\n\r\n"),         // a NUL in the path
           std::string("GET /?token=%g1 HTTP/1.1\r\n\r\n"),    // broken escape in the token
           std::string("GET / HTTP/1.1\r\nno colon\r\n\r\n"),  // not a header
           std::string("GET / HTTP/1.1\r\n: empty name\r\n\r\n"),
           std::string("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n"),
           "GET / HTTP/1.1\r\nX: a\0b\r\n\r\n"s,  // a control character
           std::string("GET / HTTP/1.1\r\n\r\nextra"),
           "GET / HTTP/1.1\r\nX: " + std::string(kMaxHttpRequestHeadBytes, 'a') + "\r\n\r\n",
       }) {
    EXPECT_FALSE(parse_http_request_head(head).is_ok()) << head;
  }
}

TEST(HttpEndpoint, AnswersWithItsHeadersAndClosesTheConnection) {
  std::unique_ptr<HttpEndpoint> endpoint = start(kToken);
  ASSERT_TRUE(endpoint);
  const std::string answer = raw_request(endpoint->address(), "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(answer.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << answer;
  for (const char* header : {"Connection: close\r\n", "Content-Length: 3\r\n", "X-Frame-Options: DENY\r\n",
                             "X-Content-Type-Options: nosniff\r\n", "Cache-Control: no-store\r\n",
                             "Content-Security-Policy: default-src 'none'"}) {
    EXPECT_NE(answer.find(header), std::string::npos) << header << " missing from\n" << answer;
  }
  EXPECT_EQ(answer.substr(answer.size() - 3), "ok\n");
  // HEAD: the headers only.
  const std::string head = raw_request(endpoint->address(), "HEAD /healthz HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << head;
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n");
  // Other methods, malformed requests, and the token as a query in a raw request.
  EXPECT_EQ(raw_request(endpoint->address(), "POST /status HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0), 0u);
  EXPECT_EQ(raw_request(endpoint->address(), "BREW coffee\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(raw_request(endpoint->address(), "GET /status HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 401", 0), 0u);
  EXPECT_EQ(raw_request(endpoint->address(), std::string("GET /status?token=") + kToken + " HTTP/1.1\r\n\r\n")
                .rfind("HTTP/1.1 200", 0),
            0u);
  EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);
}

TEST(HttpEndpoint, AnOversizedRequestHeadIsRefusedWith431) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  // One header line past the bound, the blank line never sent.
  RawClient client(endpoint->address());
  ASSERT_TRUE(client.connected());
  ASSERT_TRUE(client.send("GET /healthz HTTP/1.1\r\nX-Padding: " + std::string(kMaxHttpRequestHeadBytes, 'a')));
  const std::optional<std::string> answer = client.read_until_closed(std::chrono::seconds(10));
  ASSERT_TRUE(answer.has_value()) << "the connection was left open";
  EXPECT_EQ(answer->rfind("HTTP/1.1 431", 0), 0u) << *answer;
  EXPECT_EQ(endpoint->refused_connections(), 1);
  // A complete head over the bound too.
  const std::string whole =
      raw_request(endpoint->address(), "GET /healthz HTTP/1.1\r\nX: " + std::string(kMaxHttpRequestHeadBytes, 'b') +
                                           "\r\n\r\n");
  EXPECT_TRUE(whole.empty() || whole.rfind("HTTP/1.1 431", 0) == 0) << whole;
  EXPECT_EQ(endpoint->refused_connections(), 2);
  EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);
}

TEST(HttpEndpoint, AHeadNotCompleteByTheDeadlineIsClosedHoweverOftenBytesArrive) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  RawClient slow(endpoint->address());
  ASSERT_TRUE(slow.connected());
  ASSERT_TRUE(slow.send("GET /healthz HTTP/1.1\r\n"));
  // A header byte every 200 ms: no read ever waits long, yet the head is
  // never done. The endpoint closes it at its deadline (generous margin).
  const auto started = std::chrono::steady_clock::now();
  const auto give_up = started + std::chrono::milliseconds(kHttpRequestHeadDeadlineMs) + std::chrono::seconds(5);
  bool closed = false;
  while (!closed && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    closed = slow.closed_by_peer() || !slow.send("X");
  }
  EXPECT_TRUE(closed) << "a dripping client kept its connection past the head deadline";
  EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(kHttpRequestHeadDeadlineMs - 500));
  EXPECT_EQ(endpoint->refused_connections(), 1);
  EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);
}

TEST(HttpEndpoint, PastTheConnectionCapTheOldestIdleConnectionMakesRoom) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  constexpr int kExtra = 8;
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < kMaxHttpConnections + kExtra; ++i) {
    idle.push_back(std::make_unique<RawClient>(endpoint->address()));
    ASSERT_TRUE(idle.back()->connected());
  }
  // A request still gets through, each time, while they all wait.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(status_of(*endpoint, "/healthz"), 200);
  // Give the endpoint a moment to have accepted every connection.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int closed = 0;
  for (const auto& client : idle) closed += client->closed_by_peer() ? 1 : 0;
  // At most the cap is open, the probe included: the oldest went first.
  EXPECT_LE(static_cast<int>(idle.size()) - closed, kMaxHttpConnections - 1);
  EXPECT_TRUE(idle.front()->closed_by_peer());
  EXPECT_FALSE(idle.back()->closed_by_peer());
  EXPECT_GE(endpoint->refused_connections(), kExtra);
}

TEST(HttpEndpoint, SlowClientsDoNotDelayALivenessProbe) {
  std::unique_ptr<HttpEndpoint> endpoint = start("");
  ASSERT_TRUE(endpoint);
  std::atomic<bool> stop{false};
  // Two clients dripping a header byte every 100 ms, reconnecting when closed.
  auto drip = [&] {
    while (!stop) {
      RawClient client(endpoint->address());
      if (!client.send("GET /healthz HTTP/1.1\r\n")) continue;
      while (!stop && client.send("X")) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  };
  std::thread first(drip), second(drip);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHttpRequestHeadDeadlineMs + 1500);
  int probes = 0;
  while (std::chrono::steady_clock::now() < until) {
    // (A one-second timeout: a probe that waits longer fails.)
    Result<HttpReply> reply = http_fetch(endpoint->address(), "/healthz", "", 1);
    ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
    EXPECT_EQ(reply->status, 200);
    ++probes;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop = true;
  first.join();
  second.join();
  EXPECT_GT(probes, 10);
  EXPECT_GE(endpoint->refused_connections(), 2);  // each dripping connection reached the deadline
}

}  // namespace
}  // namespace fedmesh
