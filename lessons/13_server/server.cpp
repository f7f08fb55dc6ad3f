// The OpenAI-compatible server (server.h): start, the engine thread, shutdown, statistics and the routes.
// Generation requests (admission, the token stream, whole and streamed responses) are in server_generate.cpp.
#include "server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <sstream>

#include "common/errors.h"
#include "common/exercise.h"
#include "connections.h"
#include "server_internal.h"
#include "stop_strings.h"

namespace tvllm::server {

namespace {

const char* const kGetPaths[] = {"/health", "/metrics", "/v1/models"};
const char* const kPostPaths[] = {"/v1/completions", "/v1/chat/completions"};

bool is_get_path(const std::string& p) {
  return std::find(std::begin(kGetPaths), std::end(kGetPaths), p) != std::end(kGetPaths) ||
         p.rfind("/v1/models/", 0) == 0;
}
bool is_post_path(const std::string& p) {
  return std::find(std::begin(kPostPaths), std::end(kPostPaths), p) != std::end(kPostPaths);
}

}  // namespace

OpenAiServer::OpenAiServer(Engine& engine, const Tokenizer* tokenizer,
                           std::optional<ChatTemplate> chat_template, ServerConfig config)
    : engine_(engine),
      tokenizer_(tokenizer),
      chat_template_(std::move(chat_template)),
      config_(std::move(config)) {
  TVLLM_REQUIRE(!config_.model_name.empty(), "server: the served model name is empty");
  TVLLM_REQUIRE(config_.port >= 0 && config_.port <= 65535, "server: --port must be in [0, 65535]");
  TVLLM_REQUIRE(config_.max_waiting >= 0, "server: --max-waiting must be >= 0");
  TVLLM_REQUIRE(config_.max_body_bytes >= 1024, "server: the body limit must be >= 1024 bytes");
  TVLLM_REQUIRE(config_.default_max_tokens >= 1, "server: the default max_tokens must be >= 1");
  TVLLM_REQUIRE(config_.read_timeout_s > 0, "server: --read-timeout must be > 0 seconds");
  TVLLM_REQUIRE(config_.max_connections >= 1, "server: --max-connections must be >= 1");
}

OpenAiServer::~OpenAiServer() {
  try {
    shutdown(std::chrono::milliseconds(0));
  } catch (...) {  // a destructor must not throw; the threads are joined either way
  }
}

void OpenAiServer::log_line(const std::string& line) const {
  if (!config_.log) return;
  static std::mutex log_mutex;
  std::lock_guard<std::mutex> lock(log_mutex);
  *config_.log << line << std::endl;
}

// ---- start and stop ---------------------------------------------------------------------------------------

int OpenAiServer::start() {
  TVLLM_REQUIRE(!running_ && !http_, "server: start() may be called once");
  // A write to a connection the client closed raises SIGPIPE, whose default action ends the process. Ignored,
  // the write fails with EPIPE instead: that is how a stream learns its client left.
  std::signal(SIGPIPE, SIG_IGN);
  // One worker per request being answered: every admitted request may hold one (a stream), plus room for
  // /health, /metrics and the requests answered 429 at once. Requests still arriving hold none (connections.h).
  ConnectionLimits limits;
  limits.workers = config_.http_threads > 0
                       ? config_.http_threads
                       : static_cast<int>(engine_.limits().max_sequences + config_.max_waiting + 16);
  limits.request_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.read_timeout_s * 1000));
  limits.keep_alive_timeout = std::chrono::seconds(config_.keep_alive_timeout_s);
  limits.max_body_bytes = config_.max_body_bytes;
  limits.max_connections = config_.max_connections;
  http_ = std::make_unique<HttpServer>(limits, [this](const std::string& line) { log_line(line); });
  http_->set_payload_max_length(config_.max_body_bytes);
  http_->set_keep_alive_timeout(config_.keep_alive_timeout_s);
  // Small writes go out at once. With Nagle's algorithm on (httplib's default), the second small write of a
  // response (headers, then the first SSE chunk) waits for the ACK of the first, and the client may delay that
  // ACK by ~40 ms: measured, time to first token fell from ~100 ms to a few ms when this was set.
  http_->set_tcp_nodelay(true);
  // httplib's default sets SO_REUSEPORT too, which lets a second server bind the same port and take half of the
  // connections: a port in use must be an error. SO_REUSEADDR alone allows a restart right after a stop.
  http_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  route();
  if (config_.port == 0) {
    port_ = http_->bind_to_any_port(config_.host);
  } else {
    port_ = http_->bind_to_port(config_.host, config_.port) ? config_.port : -1;
  }
  // cpp-httplib listens with a backlog of CPPHTTPLIB_LISTEN_BACKLOG, 5 in Debian's build (compiled into the
  // library): a burst of 64 clients connecting at once overflows it, and the connections the kernel could not
  // queue fail. listen() again on the bound socket sets a larger one (POSIX; the kernel caps it at somaxconn).
  if (port_ > 0) http_->raise_backlog(1024);
  if (port_ <= 0) {
    http_.reset();
    throw InputError("server: cannot listen on " + config_.host + ":" + std::to_string(config_.port) +
                     " (the port is in use, or the host is not an address of this machine)");
  }
  created_ = static_cast<int64_t>(std::time(nullptr));
  engine_thread_ = std::thread([this] { engine_loop(); });
  http_->start_connections();
  http_thread_ = std::thread([this] { http_->listen_after_bind(); });
  // stop() only works once the accept loop runs: wait for it (the socket already queues connections).
  for (int i = 0; i < 5000 && !http_->is_running(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  running_ = true;
  return port_;
}

void OpenAiServer::engine_loop() {
  while (!stop_engine_) {
    try {
      if (engine_.wait_for_work(std::chrono::milliseconds(50))) engine_.step();
    } catch (const std::exception& e) {
      // step() fails the requests of a bad step itself; anything escaping it is a bug worth a line, not a crash.
      log_line(std::string("engine loop: ") + e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

int64_t OpenAiServer::shutdown(std::chrono::milliseconds grace) {
  if (!running_.exchange(false)) return 0;
  draining_ = true;  // from here every new generation request is answered 503
  int64_t aborted = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto idle = [&] { return in_flight_ == 0 && active_handlers_ == 0; };
    if (!idle())
      log_line("shutting down: " + std::to_string(in_flight_) + " request(s) in flight, waiting up to " +
               std::to_string(grace.count()) + " ms");
    if (!idle_cv_.wait_for(lock, grace, idle)) {
      aborting_ = true;
      for (const auto& entry : flights_) {
        engine_.abort(entry.first);  // the engine frees its KV at the next step and sends Finished(Abort)
        ++aborted;
      }
      log_line("shutting down: aborting " + std::to_string(aborted) + " request(s)");
      // Their handlers write their last event; one stuck on a client that does not read gives up within the
      // write timeout, and close_all() below ends it anyway.
      idle_cv_.wait_for(lock, std::chrono::seconds(5), idle);
    }
  }
  // The handlers are done, but a worker may still be writing a response (a whole completion is written after
  // its handler returns): a moment for that, then every client socket is shut down. No client, however slow
  // (a byte a second, a request that never ends, a stream it does not read), keeps the process past about
  // grace + 10 s.
  http_->wait_idle(std::chrono::seconds(5));
  http_->close_all();
  http_->stop();
  if (http_thread_.joinable()) http_thread_.join();
  http_->stop_connections();
  stop_engine_ = true;
  if (engine_thread_.joinable()) engine_thread_.join();
  log_line("shut down");
  return aborted;
}

ServerStats OpenAiServer::stats() const {
  ServerStats s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s.in_flight = in_flight_;
    s.awaiting_first = awaiting_first_;
    s.active_handlers = active_handlers_;
  }
  s.finished_stop = metrics_.finished(Outcome::Stop);
  s.finished_length = metrics_.finished(Outcome::Length);
  s.aborted = metrics_.finished(Outcome::Abort);
  s.failed = metrics_.finished(Outcome::Error);
  s.rejected_429 = metrics_.rejected(429);
  s.rejected_503 = metrics_.rejected(503);
  return s;
}

// ---- routes -----------------------------------------------------------------------------------------------

void OpenAiServer::set_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  // When to retry, in seconds (the openai client honours it). A full queue drains in about one request's time.
  if (e.status == 429 && !res.has_header("Retry-After")) res.set_header("Retry-After", "1");
  try {
    res.set_content(dump(error_json(e)), "application/json");
  } catch (const std::exception&) {  // never leave a client without a JSON body (a stubbed exercise, say)
    res.set_content(R"({"error":{"message":"internal error while reporting an error","type":"server_error",)"
                    R"("param":null,"code":null}})",
                    "application/json");
  }
  metrics_.record_rejected(e.status);
}

void OpenAiServer::check_auth(const httplib::Request& req) const {
  if (config_.api_key.empty()) return;
  if (req.get_header_value("Authorization") != "Bearer " + config_.api_key)
    throw ApiError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'", {},
                   "invalid_api_key");
}

void OpenAiServer::route() {
  using httplib::Request;
  using httplib::Response;
  // Every handler's failures become OpenAI errors; nothing escapes into httplib.
  const auto guarded = [this](std::function<void(const Request&, Response&)> handler) {
    return [this, handler](const Request& req, Response& res) {
      try {
        handler(req, res);
      } catch (const ApiError& e) {
        set_error(res, e);
      } catch (const InputError& e) {
        set_error(res, ApiError(400, e.what(), {}, "invalid_value"));
      } catch (const std::exception& e) {
        set_error(res, ApiError(500, std::string("internal error: ") + e.what()));
      }
    };
  };

  http_->Get("/health", [this](const Request&, Response& res) {
    if (draining_) {
      set_error(res, ApiError(503, "the server is shutting down", {}, "shutting_down"));
      return;
    }
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  http_->Get("/metrics", guarded([this](const Request&, Response& res) {
               const ServerStats s = stats();
               res.set_content(metrics_.render(engine_.stats(), s.in_flight, s.awaiting_first),
                               "text/plain; version=0.0.4; charset=utf-8");
             }));
  const auto model_json = [this] {
    OrderedJson m;
    m["id"] = config_.model_name;
    m["object"] = "model";
    m["created"] = created_;
    m["owned_by"] = "tiny-vllm";
    m["max_model_len"] = engine_.limits().max_context;
    return m;
  };
  http_->Get("/v1/models", guarded([this, model_json](const Request& req, Response& res) {
               check_auth(req);
               OrderedJson j;
               j["object"] = "list";
               j["data"] = OrderedJson::array({model_json()});
               res.set_content(dump(j), "application/json");
             }));
  http_->Get("/v1/models/(.+)", guarded([this, model_json](const Request& req, Response& res) {
               check_auth(req);
               if (req.matches[1] != config_.model_name)
                 throw ApiError(404, "The model `" + std::string(req.matches[1]) + "` does not exist",
                                "model", "model_not_found");
               res.set_content(dump(model_json()), "application/json");
             }));
  http_->Post("/v1/completions", guarded([this](const Request& req, Response& res) {
                handle_generate(req, res, Endpoint::Completions);
              }));
  http_->Post("/v1/chat/completions", guarded([this](const Request& req, Response& res) {
                handle_generate(req, res, Endpoint::ChatCompletions);
              }));

  // Everything else: a known path with the wrong method is 405 (with Allow), an unknown path 404.
  const auto fallback = [this](const Request& req, Response& res) {
    if (is_get_path(req.path) || is_post_path(req.path)) {
      const char* allow = is_get_path(req.path) ? "GET" : "POST";
      res.set_header("Allow", allow);
      set_error(res,
                ApiError(405, "Method " + req.method + " not allowed on " + req.path + " (use " + allow + ")",
                         {}, "method_not_allowed"));
    } else {
      set_error(res, ApiError(404, "Invalid URL (" + req.method + " " + req.path + ")", {}, "unknown_url"));
    }
  };
  http_->Get(".*", fallback);
  http_->Post(".*", fallback);
  http_->Put(".*", fallback);
  http_->Patch(".*", fallback);
  http_->Delete(".*", fallback);

  // Before the body is read: a Content-Length over the limit is refused now, without reading (or skipping) a
  // byte of it. httplib would read and drop all of it: 10^15 bytes announced would hold a worker for ever.
  const auto too_large = [this](Response& res) {
    current_connection().close_after_response = true;  // the rest of the body is not read: the connection ends
    res.set_header("Connection", "close");
    set_error(res, ApiError(413,
                            "the request body is larger than the limit of " +
                                std::to_string(config_.max_body_bytes) + " bytes",
                            {}, "request_too_large"));
  };
  http_->set_pre_routing_handler([this, too_large](const Request& req, Response& res) {
    if (req.has_header("Content-Length")) {
      const std::string v = req.get_header_value("Content-Length");
      errno = 0;
      const unsigned long long n = std::strtoull(v.c_str(), nullptr, 10);
      if (errno != 0 || n > config_.max_body_bytes) {
        too_large(res);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Errors httplib answers itself (400 for a malformed request line, ...) get an OpenAI body too, and so do the
  // reads the connection layer failed on purpose (connections.h): past the byte limit (413), past the deadline.
  http_->set_error_handler(httplib::Server::HandlerWithResponse([this, too_large](const Request&, Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // one of ours
    if (current_connection().over_limit) {  // a chunked body (or endless headers) passed the limit as it came
      too_large(res);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (current_connection().timed_out) {  // a chunked body still arriving at the request's deadline
      res.set_header("Connection", "close");
      set_error(res, ApiError(408, "the request did not arrive within --read-timeout", {}, "request_timeout"));
      return httplib::Server::HandlerResponse::Handled;
    }
    const int status = res.status;
    std::string message = "HTTP " + std::to_string(status);
    std::string code;
    if (status == 413) {
      message =
          "the request body is larger than the limit of " + std::to_string(config_.max_body_bytes) + " bytes";
      code = "request_too_large";
    } else if (status == 400) {
      message = "malformed HTTP request";
    }
    set_error(res, ApiError(status, message, {}, code));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http_->set_exception_handler([this](const Request&, Response& res, std::exception_ptr) {
    set_error(res, ApiError(500, "internal error"));
  });
}

}  // namespace tvllm::server
