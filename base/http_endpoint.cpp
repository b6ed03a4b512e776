#include "base/http_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sodium.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

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

namespace {

using Clock = std::chrono::steady_clock;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX decoded (and '+' as a space in a query); nullopt for a broken escape.
std::optional<std::string> url_decode(std::string_view text, bool plus_is_space) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '%') {
      if (i + 2 >= text.size()) return std::nullopt;
      const int high = hex_digit(text[i + 1]), low = hex_digit(text[i + 2]);
      if (high < 0 || low < 0) return std::nullopt;
      out.push_back(static_cast<char>(high * 16 + low));
      i += 2;
    } else {
      out.push_back(plus_is_space && c == '+' ? ' ' : c);
    }
  }
  return out;
}

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

std::string_view trim_blanks(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

// Where the head ends (just past its blank line), or npos while incomplete.
size_t end_of_head(const std::string& received) {
  const size_t crlf = received.find("\r\n\r\n");
  const size_t lf = received.find("\n\n");
  if (crlf == std::string::npos && lf == std::string::npos) return std::string::npos;
  if (lf == std::string::npos || (crlf != std::string::npos && crlf < lf)) return crlf + 4;
  return lf + 2;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 431: return "Request Header Fields Too Large";
    default: return "Internal Server Error";
  }
}

// Nothing served here loads anything from elsewhere, nor may it: a page
// that tried would be blocked by the browser (and works offline).
constexpr const char* kSecurityHeaders =
    "Cache-Control: no-store\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "X-Frame-Options: DENY\r\n"
    "Referrer-Policy: no-referrer\r\n"
    "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n";

std::string http_response(int status, const std::string& content_type, const std::string& body, bool head_only,
                          const std::string& extra_headers = "") {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  out += "Content-Type: " + content_type + "\r\n";
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  out += "Connection: close\r\n";
  out += kSecurityHeaders;
  out += extra_headers;
  out += "\r\n";
  if (!head_only) out += body;
  return out;
}

void close_quietly(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

Result<HttpRequestHead> parse_http_request_head(const std::string& head) {
  if (head.size() > kMaxHttpRequestHeadBytes) return invalid_argument("the request head is too large");
  for (const char c : head) {
    const auto byte = static_cast<unsigned char>(c);
    if ((byte < 0x20 && c != '\r' && c != '\n' && c != '\t') || byte == 0x7f) {
      return invalid_argument("the request head holds a control character");
    }
  }
  // Lines, each without its CR LF (or bare LF); the head ends at an empty one.
  std::vector<std::string_view> lines;
  std::string_view rest(head);
  bool ended = false;
  while (!rest.empty()) {
    const size_t newline = rest.find('\n');
    if (newline == std::string_view::npos) return invalid_argument("the request head does not end in a blank line");
    std::string_view line = rest.substr(0, newline);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    rest.remove_prefix(newline + 1);
    if (line.empty()) {
      ended = true;
      break;
    }
    lines.push_back(line);
  }
  if (lines.empty()) return invalid_argument("the request has no request line");
  if (!ended) return invalid_argument("the request head does not end in a blank line");
  if (!rest.empty()) return invalid_argument("the request head does not end at its blank line");

  // METHOD SP TARGET SP HTTP/1.x
  const std::string_view request_line = lines.front();
  const size_t first_space = request_line.find(' ');
  const size_t last_space = request_line.rfind(' ');
  if (first_space == std::string_view::npos || first_space == last_space) {
    return invalid_argument("the request line is not METHOD TARGET VERSION");
  }
  HttpRequestHead parsed;
  parsed.method = std::string(request_line.substr(0, first_space));
  const std::string_view target = request_line.substr(first_space + 1, last_space - first_space - 1);
  const std::string_view version = request_line.substr(last_space + 1);
  if (parsed.method.empty() || !std::all_of(parsed.method.begin(), parsed.method.end(), [](char c) {
        return c >= 'A' && c <= 'Z';
      })) {
    return invalid_argument("the request method is not a token");
  }
  if (version.substr(0, 7) != "HTTP/1." || version.size() != 8) return invalid_argument("not an HTTP/1.x request");
  if (target.empty() || target.front() != '/' || target.find(' ') != std::string_view::npos) {
    return invalid_argument("the request target is not an absolute path");
  }
  const size_t question = target.find('?');
  std::optional<std::string> path = url_decode(target.substr(0, question), false);
  if (!path || path->find('\0') != std::string::npos) return invalid_argument("the request path is not URL-encoded");
  parsed.path = std::move(*path);

  std::optional<std::string> query_token;
  if (question != std::string_view::npos) {
    std::string_view query = target.substr(question + 1);
    while (!query.empty()) {
      const size_t amp = query.find('&');
      const std::string_view pair = query.substr(0, amp);
      query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
      const size_t equals = pair.find('=');
      if (pair.substr(0, equals) != "token" || query_token) continue;
      std::optional<std::string> value =
          url_decode(equals == std::string_view::npos ? std::string_view() : pair.substr(equals + 1), true);
      if (!value) return invalid_argument("the query's token is not URL-encoded");
      query_token = std::move(*value);
    }
  }

  std::optional<std::string> bearer;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return invalid_argument("a header line is not NAME: VALUE");
    const std::string_view name = line.substr(0, colon);
    if (name.find_first_of(" \t") != std::string_view::npos) return invalid_argument("a header name holds a blank");
    if (!equals_ignoring_case(name, "Authorization") || bearer) continue;
    const std::string_view value = trim_blanks(line.substr(colon + 1));
    constexpr std::string_view kBearer = "Bearer ";
    if (value.size() > kBearer.size() && value.substr(0, kBearer.size()) == kBearer) {
      bearer = std::string(value.substr(kBearer.size()));
    }
  }
  parsed.token = bearer ? *bearer : query_token.value_or("");
  return parsed;
}

// One thread, one poll() loop: the listening socket, a wake-up pipe for
// stopping, and every open connection, each either reading its request
// head or writing its answer, each with a deadline.
class HttpEndpoint::Impl {
 public:
  struct Connection {
    int fd = -1;
    uint64_t serial = 0;  // order of acceptance: the oldest is evicted first
    Clock::time_point deadline;
    bool answering = false;
    std::string received;
    std::string answer;
    size_t sent = 0;
  };

  ~Impl() {
    for (Connection& c : connections) close_quietly(c.fd);
    close_quietly(listener);
    close_quietly(wake_read);
    close_quietly(wake_write);
    close_quietly(spare);
  }

  std::map<std::string, HttpPage> pages;
  std::string token;
  int listener = -1;
  int wake_read = -1, wake_write = -1;
  // A descriptor held in reserve: when the process has none left, it is
  // given up for a moment to accept and close a waiting connection, so that
  // the listener neither spins nor keeps a queue nobody serves.
  int spare = -1;
  std::thread thread;
  std::atomic<int64_t> unauthorized{0};
  std::atomic<int64_t> refused{0};
  std::vector<Connection> connections;
  uint64_t accepted = 0;
  Clock::time_point accept_paused_until{};

  void serve();

 private:
  void accept_waiting(Clock::time_point now);
  void read_from(Connection& connection, Clock::time_point now);
  void write_to(Connection& connection);
  void refuse(Connection& connection) {
    close_quietly(connection.fd);
    refused.fetch_add(1);
  }
  void begin_answer(Connection& connection, std::string answer, Clock::time_point now) {
    connection.answering = true;
    connection.answer = std::move(answer);
    connection.sent = 0;
    connection.received.clear();
    connection.received.shrink_to_fit();
    connection.deadline = now + std::chrono::milliseconds(kHttpResponseDeadlineMs);
    write_to(connection);
  }
  std::string answer_for(const HttpRequestHead& request);
};

void HttpEndpoint::Impl::serve() {
  std::vector<pollfd> polled;
  while (true) {
    Clock::time_point now = Clock::now();
    polled.clear();
    polled.push_back({wake_read, POLLIN, 0});
    const bool accepting = now >= accept_paused_until;
    polled.push_back({accepting ? listener : -1, POLLIN, 0});
    int timeout_ms = accepting ? -1 : 100;
    for (const Connection& c : connections) {
      polled.push_back({c.fd, static_cast<short>(c.answering ? POLLOUT : POLLIN), 0});
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(c.deadline - now).count();
      const int left_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? left_ms : std::min(timeout_ms, left_ms);
    }
    if (::poll(polled.data(), polled.size(), timeout_ms) < 0 && errno != EINTR) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (polled[0].revents != 0) return;  // stopping
    now = Clock::now();
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short events = polled[i + 2].revents;
      if (events == 0 || c.fd < 0) continue;
      if (c.answering) {
        write_to(c);
      } else {
        read_from(c, now);
      }
    }
    for (Connection& c : connections) {
      if (c.fd >= 0 && now >= c.deadline) refuse(c);
    }
    std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });
    if (accepting && (polled[1].revents & POLLIN) != 0) accept_waiting(now);
  }
}

void HttpEndpoint::Impl::accept_waiting(Clock::time_point now) {
  while (true) {
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if ((errno == EMFILE || errno == ENFILE) && spare >= 0) {
        close_quietly(spare);
        const int waiting = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (waiting >= 0) {
          ::close(waiting);
          refused.fetch_add(1);
        }
        spare = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (waiting >= 0) continue;
      }
      // Out of descriptors or buffers: try again shortly rather than spin.
      accept_paused_until = now + std::chrono::milliseconds(100);
      return;
    }
    if (connections.size() >= static_cast<size_t>(kMaxHttpConnections)) {
      // Make room by closing the oldest connection still sending its head:
      // a client that keeps many open cannot keep a new one out.
      Connection* oldest = nullptr;
      for (Connection& c : connections) {
        if (!c.answering && (oldest == nullptr || c.serial < oldest->serial)) oldest = &c;
      }
      if (oldest == nullptr) {
        ::close(fd);
        refused.fetch_add(1);
        continue;
      }
      refuse(*oldest);
      std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });
    }
    Connection connection;
    connection.fd = fd;
    connection.serial = ++accepted;
    connection.deadline = now + std::chrono::milliseconds(kHttpRequestHeadDeadlineMs);
    connections.push_back(std::move(connection));
  }
}

void HttpEndpoint::Impl::read_from(Connection& connection, Clock::time_point now) {
  char chunk[4096];
  while (true) {
    // Never more than one byte past the limit: enough to know it is passed.
    const size_t room = kMaxHttpRequestHeadBytes + 1 - std::min(connection.received.size(), kMaxHttpRequestHeadBytes);
    const ssize_t n = ::recv(connection.fd, chunk, std::min(sizeof chunk, room), 0);
    if (n == 0) {  // the client left before asking anything
      close_quietly(connection.fd);
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) close_quietly(connection.fd);
      return;
    }
    connection.received.append(chunk, static_cast<size_t>(n));
    const size_t end = end_of_head(connection.received);
    if (end == std::string::npos ? connection.received.size() > kMaxHttpRequestHeadBytes
                                 : end > kMaxHttpRequestHeadBytes) {
      refused.fetch_add(1);
      begin_answer(connection,
                   http_response(431, "text/plain", "431: the request head is over " +
                                                        std::to_string(kMaxHttpRequestHeadBytes) + " bytes\n",
                                 false),
                   now);
      return;
    }
    if (end == std::string::npos) continue;
    Result<HttpRequestHead> request = parse_http_request_head(connection.received.substr(0, end));
    if (!request.is_ok()) {
      refused.fetch_add(1);
      begin_answer(connection, http_response(400, "text/plain", "400: " + request.status().message() + "\n", false),
                   now);
      return;
    }
    begin_answer(connection, answer_for(*request), now);
    return;
  }
}

std::string HttpEndpoint::Impl::answer_for(const HttpRequestHead& request) {
  const bool head_only = request.method == "HEAD";
  if (request.method != "GET" && !head_only) {
    return http_response(405, "text/plain", "405: this endpoint serves GET only\n", false, "Allow: GET, HEAD\r\n");
  }
  const auto page = pages.find(request.path);
  if (page == pages.end()) return http_response(404, "text/plain", "404: no such page\n", head_only);
  if (!page->second.open && !token.empty() && !access_token_matches(request.token, token)) {
    unauthorized.fetch_add(1);
    return http_response(401, "text/plain",
                         "401: this endpoint needs its access token (Authorization: Bearer TOKEN, or ?token=TOKEN)\n",
                         head_only, "WWW-Authenticate: Bearer realm=\"fedmesh\"\r\n");
  }
  try {
    return http_response(200, page->second.content_type, page->second.render(), head_only);
  } catch (const std::exception&) {
    return http_response(500, "text/plain", "500: the page could not be rendered\n", head_only);
  }
}

void HttpEndpoint::Impl::write_to(Connection& connection) {
  while (connection.sent < connection.answer.size()) {
    const ssize_t n = ::send(connection.fd, connection.answer.data() + connection.sent,
                             connection.answer.size() - connection.sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) close_quietly(connection.fd);
      return;
    }
    connection.sent += static_cast<size_t>(n);
  }
  // All sent: end the connection (the FIN follows the answer).
  ::shutdown(connection.fd, SHUT_WR);
  close_quietly(connection.fd);
}

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
  Impl& impl = *endpoint->impl_;
  impl.pages = std::move(pages);
  impl.token = options.access_token;

  const std::string bind_host = host.size() > 2 && host.front() == '[' && host.back() == ']'
                                    ? host.substr(1, host.size() - 2)
                                    : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  std::string refused = "cannot listen for HTTP on " + address + " (not an address of this host)";
  if (::getaddrinfo(bind_host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return unavailable(refused);
  for (addrinfo* candidate = found; candidate != nullptr && impl.listener < 0; candidate = candidate->ai_next) {
    int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd < 0) continue;
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, candidate->ai_addr, candidate->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      const int error = errno;
      refused = "cannot listen for HTTP on " + address + ": " + std::strerror(error) +
                (error == EADDRINUSE ? " (another process, perhaps another fedmesh on this host, holds the port: give "
                                       "this one another metrics address)"
                                     : "");
      ::close(fd);
      continue;
    }
    impl.listener = fd;
  }
  ::freeaddrinfo(found);
  if (impl.listener < 0) return unavailable(refused);
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof bound;
  if (::getsockname(impl.listener, reinterpret_cast<sockaddr*>(&bound), &bound_size) != 0) return unavailable(refused);
  const int bound_port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) return unavailable("cannot make the HTTP endpoint's wake-up pipe");
  impl.wake_read = wake[0];
  impl.wake_write = wake[1];
  impl.spare = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  endpoint->address_ = host + ":" + std::to_string(bound_port);
  impl.thread = std::thread([&impl] { impl.serve(); });
  return endpoint;
}

HttpEndpoint::~HttpEndpoint() {
  if (impl_) {
    if (impl_->thread.joinable()) {
      const char stop = 1;
      while (::write(impl_->wake_write, &stop, 1) < 0 && errno == EINTR) {
      }
      impl_->thread.join();
    }
  }
}

int64_t HttpEndpoint::unauthorized_requests() const { return impl_->unauthorized.load(); }
int64_t HttpEndpoint::refused_connections() const { return impl_->refused.load(); }

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
