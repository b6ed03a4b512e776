#include "base/http_endpoint.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <sodium.h>

#include <atomic>
#include <thread>

namespace fedmesh {

Status parse_host_port(const std::string& address, std::string& host, int& port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return invalid_argument("address '" + address + "' is not HOST:PORT");
  }
  host = address.substr(0, colon);
  try {
    size_t used = 0;
    port = std::stoi(address.substr(colon + 1), &used);
    if (used != address.size() - colon - 1 || port < 0 || port > 65535) throw std::out_of_range("port");
  } catch (const std::exception&) {
    return invalid_argument("address '" + address + "' has no valid port (0-65535)");
  }
  return Status::ok();
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host == "[::1]") return true;
  // 127.0.0.0/8 in dotted decimal, nothing else.
  in_addr parsed{};
  if (inet_pton(AF_INET, host.c_str(), &parsed) != 1) return false;
  return (ntohl(parsed.s_addr) >> 24) == 127;
}

Status check_access_token(const std::string& token) {
  if (token.size() < kMinAccessTokenChars || token.size() > kMaxAccessTokenChars) {
    return invalid_argument("an access token needs " + std::to_string(kMinAccessTokenChars) + " to " +
                            std::to_string(kMaxAccessTokenChars) + " characters, not " + std::to_string(token.size()) +
                            " (e.g. `openssl rand -hex 32`)");
  }
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) return invalid_argument("an access token is printable ASCII without spaces");
  }
  return Status::ok();
}

bool access_token_matches(const std::string& presented, const std::string& expected) {
  // Equal-length digests compared in constant time: the time depends on
  // neither the expected token's bytes nor its length.
  unsigned char a[crypto_generichash_BYTES], b[crypto_generichash_BYTES];
  crypto_generichash(a, sizeof a, reinterpret_cast<const unsigned char*>(presented.data()), presented.size(), nullptr, 0);
  crypto_generichash(b, sizeof b, reinterpret_cast<const unsigned char*>(expected.data()), expected.size(), nullptr, 0);
  return sodium_memcmp(a, b, sizeof a) == 0;
}

class HttpEndpoint::Impl {
 public:
  httplib::Server server;
  std::thread thread;
  std::atomic<int64_t> unauthorized{0};
};

namespace {

// What a request presents as its token: the bearer credentials, else the
// `token` query parameter, else nothing.
std::string presented_token(const httplib::Request& request) {
  const std::string authorization = request.get_header_value("Authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() > kBearer.size() && authorization.compare(0, kBearer.size(), kBearer) == 0) {
    return authorization.substr(kBearer.size());
  }
  return request.has_param("token") ? request.get_param_value("token") : std::string();
}

}  // namespace

Result<std::unique_ptr<HttpEndpoint>> HttpEndpoint::start(const std::string& address,
                                                          std::map<std::string, HttpPage> pages,
                                                          HttpEndpointOptions options) {
  std::string host;
  int port = 0;
  FEDMESH_RETURN_IF_ERROR(parse_host_port(address, host, port));
  if (!options.access_token.empty()) FEDMESH_RETURN_IF_ERROR(check_access_token(options.access_token));
  if (sodium_init() < 0) return unavailable("libsodium failed to initialize");
  std::unique_ptr<HttpEndpoint> endpoint(new HttpEndpoint());
  endpoint->impl_ = std::make_unique<Impl>();
  Impl* impl = endpoint->impl_.get();
  httplib::Server& server = impl->server;
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_payload_max_length(64 * 1024);
  // Nothing served here loads anything from elsewhere, nor may it: a page
  // that tried would be blocked by the browser (and works offline).
  server.set_default_headers({{"Cache-Control", "no-store"},
                              {"X-Content-Type-Options", "nosniff"},
                              {"X-Frame-Options", "DENY"},
                              {"Referrer-Policy", "no-referrer"},
                              {"Content-Security-Policy",
                               "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'"}});
  const std::string token = options.access_token;
  for (auto& [path, page] : pages) {
    // (page = page: clang before 16 cannot capture a structured binding.)
    server.Get(path, [page = page, token, impl](const httplib::Request& request, httplib::Response& response) {
      if (!page.open && !token.empty() && !access_token_matches(presented_token(request), token)) {
        impl->unauthorized.fetch_add(1);
        response.status = 401;
        response.set_header("WWW-Authenticate", "Bearer realm=\"fedmesh\"");
        response.set_content("401: this endpoint needs its access token (Authorization: Bearer TOKEN, or ?token=TOKEN)\n",
                             "text/plain");
        return;
      }
      try {
        response.set_content(page.render(), page.content_type.c_str());
      } catch (const std::exception&) {
        response.status = 500;
        response.set_content("500: the page could not be rendered\n", "text/plain");
      }
    });
  }
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound < 0) return unavailable("cannot listen for HTTP on " + address + " (in use, or not an address of this host)");
  endpoint->address_ = host + ":" + std::to_string(bound);
  endpoint->impl_->thread = std::thread([&server] { server.listen_after_bind(); });
  return endpoint;
}

HttpEndpoint::~HttpEndpoint() {
  if (impl_) {
    impl_->server.stop();
    if (impl_->thread.joinable()) impl_->thread.join();
  }
}

int64_t HttpEndpoint::unauthorized_requests() const { return impl_->unauthorized.load(); }

Result<HttpReply> http_fetch(const std::string& address, const std::string& path, const std::string& bearer_token,
                             int timeout_seconds) {
  std::string host;
  int port = 0;
  FEDMESH_RETURN_IF_ERROR(parse_host_port(address, host, port));
  httplib::Client client(host, port);
  client.set_connection_timeout(timeout_seconds, 0);
  client.set_read_timeout(timeout_seconds, 0);
  if (!bearer_token.empty()) client.set_bearer_token_auth(bearer_token.c_str());
  const httplib::Result result = client.Get(path.c_str());
  if (!result) return unavailable("no answer from http://" + address + path + ": " + httplib::to_string(result.error()));
  return HttpReply{result->status, result->body, result->get_header_value("Content-Type")};
}

Result<std::string> http_get(const std::string& address, const std::string& path, int timeout_seconds,
                             const std::string& bearer_token) {
  Result<HttpReply> reply = http_fetch(address, path, bearer_token, timeout_seconds);
  if (!reply.is_ok()) return reply.status();
  if (reply->status == 401) {
    return unavailable("http://" + address + path + " answered 401: it needs the aggregator's access token" +
                       (bearer_token.empty() ? " (none given)" : " (the one given is not it)"));
  }
  if (reply->status != 200) {
    return unavailable("http://" + address + path + " answered " + std::to_string(reply->status));
  }
  return std::move(reply->body);
}

std::map<std::string, HttpPage> metrics_and_status_pages(std::function<std::string()> metrics,
                                                         std::function<std::string()> status) {
  std::map<std::string, HttpPage> pages;
  pages["/metrics"] = {"text/plain; version=0.0.4", std::move(metrics)};
  pages["/status"] = {"application/json", std::move(status)};
  pages["/healthz"] = {"text/plain", [] { return std::string("ok\n"); }, true};
  return pages;
}

Result<std::unique_ptr<HttpEndpoint>> serve_metrics_and_status(const std::string& address,
                                                               std::function<std::string()> metrics,
                                                               std::function<std::string()> status) {
  if (address.empty()) return std::unique_ptr<HttpEndpoint>();
  return HttpEndpoint::start(address, metrics_and_status_pages(std::move(metrics), std::move(status)));
}

}  // namespace fedmesh
