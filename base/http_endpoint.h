// A small HTTP endpoint for what a process shows about itself: Prometheus
// metrics at /metrics and a JSON status at /status. It serves GET only, on
// its own thread, from pages the owner renders on request; nothing it
// receives reaches the rest of the process. Off when the address is empty.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "base/status.h"

namespace fedmesh {

struct HttpPage {
  std::string content_type;               // e.g. "text/plain; version=0.0.4"
  std::function<std::string()> render;    // called on the endpoint's thread
};

class HttpEndpoint {
 public:
  // Listens on "HOST:PORT" (PORT 0: any free port) and serves `pages` by
  // path. kInvalidArgument for a malformed address, kUnavailable when it
  // cannot bind.
  static Result<std::unique_ptr<HttpEndpoint>> start(const std::string& address, std::map<std::string, HttpPage> pages);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  const std::string& address() const { return address_; }  // with the port bound

 private:
  HttpEndpoint() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

// What every fedmesh role serves: Prometheus text at /metrics and JSON at
// /status, rendered on request. An empty address serves nothing (null).
Result<std::unique_ptr<HttpEndpoint>> serve_metrics_and_status(const std::string& address,
                                                               std::function<std::string()> metrics,
                                                               std::function<std::string()> status);

// GET http://HOST:PORT/path; the body, or kUnavailable naming what failed.
Result<std::string> http_get(const std::string& address, const std::string& path, int timeout_seconds = 5);

// Splits "HOST:PORT"; kInvalidArgument naming the text otherwise.
Status parse_host_port(const std::string& address, std::string& host, int& port);

}  // namespace fedmesh
