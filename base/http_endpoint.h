// A small HTTP endpoint for what a process shows about itself: Prometheus
// metrics at /metrics, a JSON status at /status, a liveness probe at
// /healthz and, for the aggregator, its dashboard. It serves GET (and HEAD)
// only, from pages the owner renders on request, on one thread of its own
// running a poll() loop; nothing it receives reaches the rest of the
// process. Off when the address is empty.
//
// Every connection is bounded, so that no client, however slow or however
// many, keeps the others (a liveness probe) waiting: its request head must
// arrive whole within kHttpRequestHeadDeadlineMs of the connection (a
// deadline, not a per-read timeout: a byte now and then does not extend
// it) and within kMaxHttpRequestHeadBytes (else 431); its answer must be
// taken within kHttpResponseDeadlineMs; every answer closes the connection.
// At most kMaxHttpConnections are open: a connection past the cap closes
// the oldest one still sending its head, or, when none is, is closed at
// once. Each connection closed so is counted (refused_connections()).
//
// With an access token set, every page not marked open needs it, as
// `Authorization: Bearer TOKEN` or `?token=TOKEN`; anything else is answered
// 401 and counted. Tokens are compared in constant time (BLAKE2b of both,
// then sodium_memcmp), so neither the token's bytes nor its length leak
// through response times.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "base/status.h"

namespace fedmesh {

// An access token is printable ASCII without spaces (it travels in a header
// and a query string), long enough not to be guessed, short enough to bound
// what a request makes us hash.
inline constexpr size_t kMinAccessTokenChars = 16;
inline constexpr size_t kMaxAccessTokenChars = 256;

// Bounds on what one HTTP client can hold (see above).
inline constexpr int kMaxHttpConnections = 64;
inline constexpr int kHttpRequestHeadDeadlineMs = 3000;
inline constexpr int kHttpResponseDeadlineMs = 5000;
inline constexpr size_t kMaxHttpRequestHeadBytes = 8 * 1024;

struct HttpPage {
  std::string content_type;               // e.g. "text/plain; version=0.0.4"
  std::function<std::string()> render;    // called on the endpoint's thread
  bool open = false;                      // served without the access token (liveness probes)
};

struct HttpEndpointOptions {
  std::string access_token;  // "" = every page open
};

class HttpEndpoint {
 public:
  // Listens on "HOST:PORT" (PORT 0: any free port) and serves `pages` by
  // path. kInvalidArgument for a malformed address or token, kUnavailable
  // when it cannot bind.
  static Result<std::unique_ptr<HttpEndpoint>> start(const std::string& address, std::map<std::string, HttpPage> pages,
                                                     HttpEndpointOptions options = {});
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  const std::string& address() const { return address_; }  // with the port bound
  // Requests answered 401: no token, or the wrong one.
  int64_t unauthorized_requests() const;
  // Connections closed without a page: past the connection cap, a request
  // head late, too large or malformed, an answer not taken in time.
  int64_t refused_connections() const;

 private:
  HttpEndpoint() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

// What every fedmesh role serves: Prometheus text at /metrics, JSON at
// /status, rendered on request, and "ok" at /healthz (always open: it says
// only that the process answers).
std::map<std::string, HttpPage> metrics_and_status_pages(std::function<std::string()> metrics,
                                                         std::function<std::string()> status);
// Those pages on `address`; an empty address serves nothing (null).
Result<std::unique_ptr<HttpEndpoint>> serve_metrics_and_status(const std::string& address,
                                                               std::function<std::string()> metrics,
                                                               std::function<std::string()> status);

struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
};

// GET http://HOST:PORT/path, with `Authorization: Bearer TOKEN` when a token
// is given; whatever status answered, or kUnavailable naming what failed.
Result<HttpReply> http_fetch(const std::string& address, const std::string& path, const std::string& bearer_token = "",
                             int timeout_seconds = 5);
// The body of a 200 answer; kUnavailable naming the status or failure otherwise.
Result<std::string> http_get(const std::string& address, const std::string& path, int timeout_seconds = 5,
                             const std::string& bearer_token = "");

// A request head as the endpoint reads it: the request line and headers up
// to the blank line, `head` holding exactly that (at most
// kMaxHttpRequestHeadBytes). The path and the `token` query parameter come
// URL-decoded; `token` is the bearer credentials of `Authorization: Bearer`
// if present, else the query's `token`, else empty. kInvalidArgument naming
// what is malformed.
struct HttpRequestHead {
  std::string method;
  std::string path;
  std::string token;
};
Result<HttpRequestHead> parse_http_request_head(const std::string& head);

// Splits "HOST:PORT"; kInvalidArgument naming the text otherwise.
Status parse_host_port(const std::string& address, std::string& host, int& port);

// Whether HOST reaches only this machine: 127.0.0.0/8, ::1, localhost. Any
// other host (0.0.0.0, ::, a name, an interface's address) exposes the
// endpoint to the network.
bool is_loopback_host(const std::string& host);

// kInvalidArgument unless `token` is a usable access token (see above).
Status check_access_token(const std::string& token);

// Whether `presented` equals `expected`, in time independent of both.
bool access_token_matches(const std::string& presented, const std::string& expected);

}  // namespace fedmesh
