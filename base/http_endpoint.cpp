#include "base/http_endpoint.h"

#include <httplib.h>

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

class HttpEndpoint::Impl {
 public:
  httplib::Server server;
  std::thread thread;
};

Result<std::unique_ptr<HttpEndpoint>> HttpEndpoint::start(const std::string& address,
                                                          std::map<std::string, HttpPage> pages) {
  std::string host;
  int port = 0;
  FEDMESH_RETURN_IF_ERROR(parse_host_port(address, host, port));
  std::unique_ptr<HttpEndpoint> endpoint(new HttpEndpoint());
  endpoint->impl_ = std::make_unique<Impl>();
  httplib::Server& server = endpoint->impl_->server;
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_payload_max_length(64 * 1024);
  for (auto& [path, page] : pages) {
    server.Get(path, [page](const httplib::Request&, httplib::Response& response) {
      response.set_content(page.render(), page.content_type.c_str());
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

Result<std::string> http_get(const std::string& address, const std::string& path, int timeout_seconds) {
  std::string host;
  int port = 0;
  FEDMESH_RETURN_IF_ERROR(parse_host_port(address, host, port));
  httplib::Client client(host, port);
  client.set_connection_timeout(timeout_seconds, 0);
  client.set_read_timeout(timeout_seconds, 0);
  const httplib::Result result = client.Get(path.c_str());
  if (!result) return unavailable("no answer from http://" + address + path + ": " + httplib::to_string(result.error()));
  if (result->status != 200) {
    return unavailable("http://" + address + path + " answered " + std::to_string(result->status));
  }
  return result->body;
}

Result<std::unique_ptr<HttpEndpoint>> serve_metrics_and_status(const std::string& address,
                                                               std::function<std::string()> metrics,
                                                               std::function<std::string()> status) {
  if (address.empty()) return std::unique_ptr<HttpEndpoint>();
  std::map<std::string, HttpPage> pages;
  pages["/metrics"] = {"text/plain; version=0.0.4", std::move(metrics)};
  pages["/status"] = {"application/json", std::move(status)};
  return HttpEndpoint::start(address, std::move(pages));
}

}  // namespace fedmesh
