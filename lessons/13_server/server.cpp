// The OpenAI-compatible server (server.h): routes, admission, the engine thread, responses and streams.
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
#include "stop_strings.h"

namespace tvllm::server {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string dump(const OrderedJson& j) {
  return j.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

// SplitMix64: a seed for a request that brought none (sampled requests differ from each other, as at OpenAI).
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

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

// One admitted request: what the handler thread and the engine thread share.
struct OpenAiServer::Flight {
  int64_t engine_id = -1;
  GenerationRequest request;
  std::vector<int32_t> prompt;
  EventQueue queue;  // the engine thread pushes, the handler pops
  Clock::time_point arrival;
  std::atomic<bool> stopped_by_string{false};  // the handler matched a stop string and aborted the rest
  std::atomic<bool> engine_finished{false};    // the Finished event was delivered
  // Engine thread only (on_event).
  bool got_first = false;
  int64_t tokens = 0;
  Clock::time_point first_token, last_token;
};

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

// ---- generation requests ----------------------------------------------------------------------------------

const Tokenizer& OpenAiServer::tokenizer() const {
  if (!tokenizer_)
    throw ApiError(400, "this model has no tokenizer.json: send the prompt as token ids", "prompt",
                   "no_tokenizer");
  return *tokenizer_;
}

std::vector<int32_t> OpenAiServer::prompt_ids(const GenerationRequest& r) const {
  const int64_t vocab = engine_.weights().config.vocab_size;
  if (r.endpoint == Endpoint::Completions) {
    if (r.prompt_text)
      return tokenizer().encode(*r.prompt_text, /*add_special_tokens=*/true);  // BOS first, as HF
    std::vector<int32_t> ids;
    ids.reserve(r.prompt_ids->size());
    for (size_t i = 0; i < r.prompt_ids->size(); ++i) {
      const int64_t id = (*r.prompt_ids)[i];
      if (id < 0 || id >= vocab)
        throw ApiError(400,
                       "prompt token " + std::to_string(i) + " is " + std::to_string(id) +
                           ", outside the vocabulary [0, " + std::to_string(vocab) + ")",
                       "prompt", "invalid_value");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  }
  if (!tokenizer_)
    throw ApiError(400, "this model has no tokenizer.json: chat needs one; send token ids to /v1/completions",
                   "messages", "no_tokenizer");
  if (!chat_template_)
    throw ApiError(400, "this model has no chat template: use /v1/completions with a prompt", "messages",
                   "no_chat_template");
  std::string text;
  try {
    text = chat_template_->render(r.messages, /*add_generation_prompt=*/true);
  } catch (const InputError& e) {
    throw ApiError(400, std::string("the conversation cannot be rendered: ") + e.what(), "messages",
                   "invalid_value");
  }
  return tokenizer().encode(text, /*add_special_tokens=*/false);  // the template printed BOS itself
}

std::optional<ApiError> admission_refusal(const AdmissionLoad& load) {
  // --- exercise 13.3: admission (backpressure) ----------------------------------------------------------------
  // Task: decide whether one more generation request may enter. While load.draining, refuse it with
  //   ApiError(503, <message>, {}, "shutting_down"). Otherwise refuse it with ApiError(429, <message>, {},
  //   "queue_full") when the waiting room is full (awaiting_first >= max_waiting) or the whole house is
  //   (in_flight >= max_sequences + max_waiting: those running plus those waiting); else return std::nullopt.
  //   The 429 message should say what is full and that the client may retry (the server adds Retry-After).
  // Hint: waiting for a slot inside the server would hide the overload from the client and hold an HTTP worker
  //   per request; an immediate 429 lets the client (or a load balancer) back off or go elsewhere.
  // Tests: Server13Admission.Decisions Server13Backpressure.FullQueueIs429 Server13Hostile.RetryAfterOn429
  // --- solution ---
  if (load.draining) return ApiError(503, "the server is shutting down", {}, "shutting_down");
  if (load.awaiting_first >= load.max_waiting || load.in_flight >= load.max_sequences + load.max_waiting)
    return ApiError(429,
                    "the server is busy: " + std::to_string(load.awaiting_first) +
                        " request(s) are waiting to start and " + std::to_string(load.in_flight) +
                        " are in flight (limit --max-waiting " + std::to_string(load.max_waiting) +
                        "); retry later",
                    {}, "queue_full");
  return std::nullopt;
  // --- end of exercise 13.3 ---
}

std::shared_ptr<OpenAiServer::Flight> OpenAiServer::admit(std::vector<int32_t> prompt,
                                                          const GenerationRequest& r, int64_t max_tokens) {
  auto f = std::make_shared<Flight>();
  f->request = r;
  f->prompt = prompt;
  f->arrival = Clock::now();
  RequestParams params;
  params.sampling = r.sampling;
  params.max_tokens = max_tokens;
  params.ignore_eos = r.ignore_eos;
  // Held across submit() so that the engine's Finished (which erases the entry) cannot come first.
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::optional<ApiError> refusal = admission_refusal(
          {draining_, awaiting_first_, in_flight_, config_.max_waiting, engine_.limits().max_sequences}))
    throw *refusal;
  try {
    f->engine_id =
        engine_.submit(std::move(prompt), params, [this, f](const EngineEvent& e) { on_event(f, e); });
  } catch (const InputError& e) {
    throw ApiError(400, e.what(), {}, "invalid_value");
  }
  ++in_flight_;
  ++awaiting_first_;
  flights_[f->engine_id] = f;
  return f;
}

void OpenAiServer::on_event(const std::shared_ptr<Flight>& f, const EngineEvent& e) {
  // The engine thread: bookkeeping, then hand the event to the request's handler. Never blocks on a socket.
  const Clock::time_point now = Clock::now();
  if (e.kind == EngineEvent::Kind::Token) {
    if (!f->got_first) {
      f->got_first = true;
      f->first_token = now;
      std::lock_guard<std::mutex> lock(mutex_);
      --awaiting_first_;
    }
    f->last_token = now;
    ++f->tokens;
  } else {
    Outcome outcome = Outcome::Error;
    if (f->stopped_by_string || e.reason == FinishReason::Stop)
      outcome = Outcome::Stop;
    else if (e.reason == FinishReason::Length)
      outcome = Outcome::Length;
    else if (e.reason == FinishReason::Abort)
      outcome = Outcome::Abort;
    const double ttft = f->got_first ? seconds_between(f->arrival, f->first_token) : -1.0;
    const double tpot =
        f->tokens >= 2 ? seconds_between(f->first_token, f->last_token) / static_cast<double>(f->tokens - 1)
                       : -1.0;
    metrics_.record_finished(outcome, e.usage.prompt_tokens, e.usage.completion_tokens, ttft, tpot,
                             seconds_between(f->arrival, now));
    if (config_.log) {
      std::ostringstream line;
      line << "request " << e.request_id << ": " << outcome_name(outcome) << ", " << e.usage.prompt_tokens
           << " prompt + " << e.usage.completion_tokens << " generated tokens";
      if (ttft >= 0) line << ", TTFT " << ttft * 1e3 << " ms";
      if (tpot >= 0) line << ", TPOT " << tpot * 1e3 << " ms";
      if (!e.error.empty()) line << ": " << e.error;
      log_line(line.str());
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!f->got_first) --awaiting_first_;
      f->got_first = true;
      --in_flight_;
      flights_.erase(f->engine_id);
      f->engine_finished = true;
    }
    idle_cv_.notify_all();
  }
  f->queue.push(e);
}

void OpenAiServer::handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  check_auth(req);
  if (draining_) throw ApiError(503, "the server is shutting down", {}, "shutting_down");
  GenerationRequest r = parse_generation_request(req.body, endpoint);
  if (r.model != config_.model_name)
    throw ApiError(
        404, "The model `" + r.model + "` does not exist (this server serves `" + config_.model_name + "`)",
        "model", "model_not_found");
  std::vector<int32_t> prompt = prompt_ids(r);

  // The context: prompt + completion must fit (the engine's max_context, vLLM's --max-model-len).
  const int64_t context = engine_.limits().max_context;
  const auto P = static_cast<int64_t>(prompt.size());
  const char* prompt_param = endpoint == Endpoint::Completions ? "prompt" : "messages";
  if (P >= context)
    throw ApiError(400,
                   "This model's maximum context length is " + std::to_string(context) +
                       " tokens. However, your prompt has " + std::to_string(P) +
                       " tokens, which leaves no room for a completion. Please shorten the prompt.",
                   prompt_param, "context_length_exceeded");
  int64_t max_tokens = 0;
  if (r.max_tokens) {
    max_tokens = *r.max_tokens;
    // Written so that nothing overflows: P + max_tokens would for a max_tokens near 2^63 (undefined behaviour,
    // and a sum that wraps negative passes the test). The message adds them as unsigned: that fits.
    if (max_tokens > context - P)
      throw ApiError(400,
                     "This model's maximum context length is " + std::to_string(context) +
                         " tokens. However, you requested " +
                         std::to_string(static_cast<uint64_t>(P) + static_cast<uint64_t>(max_tokens)) +
                         " tokens (" +
                         std::to_string(P) + " in the prompt, " + std::to_string(max_tokens) +
                         " for the completion). Please reduce the length of the prompt or the completion.",
                     endpoint == Endpoint::Completions ? "max_tokens" : "max_completion_tokens",
                     "context_length_exceeded");
  } else {
    max_tokens =
        endpoint == Endpoint::Completions ? std::min(config_.default_max_tokens, context - P) : context - P;
  }
  if (!r.seed_given)
    r.sampling.seed = mix(seed_counter_++ ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count()));

  std::shared_ptr<Flight> f = admit(std::move(prompt), r, max_tokens);
  if (r.stream)
    respond_stream(f, res, req.version == "HTTP/1.0");
  else
    respond_whole(f, res);
}

void OpenAiServer::respond_whole(const std::shared_ptr<Flight>& f, httplib::Response& res) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++active_handlers_;
  }
  struct Done {  // the handler's share of the shutdown wait, released however it leaves
    OpenAiServer* s;
    ~Done() {
      {
        std::lock_guard<std::mutex> lock(s->mutex_);
        --s->active_handlers_;
      }
      s->idle_cv_.notify_all();
    }
  } done{this};
  // If this handler leaves early (an exception), the engine must not go on for nobody.
  struct AbortUnlessFinished {
    OpenAiServer* s;
    const Flight* f;
    ~AbortUnlessFinished() {
      if (!f->engine_finished) s->engine_.abort(f->engine_id);
    }
  } abort_guard{this, f.get()};

  const GenerationRequest& r = f->request;
  OutputText out(tokenizer_, r.stop);
  const bool with_ids = r.return_token_ids || !tokenizer_;
  std::string text;
  std::string_view finish;
  Usage usage{static_cast<int64_t>(f->prompt.size()), 0};
  for (;;) {
    const std::optional<EngineEvent> e = f->queue.pop(std::chrono::milliseconds(200));
    if (!e) continue;  // shutdown aborts through the engine: a Finished(Abort) will come
    if (e->kind == EngineEvent::Kind::Token) {
      text += out.push(e->token);
      if (out.stopped()) {  // a stop string: the rest of the generation is not wanted
        f->stopped_by_string = true;
        engine_.abort(f->engine_id);
        finish = "stop";
        usage.completion_tokens = out.tokens();
        break;
      }
      continue;
    }
    if (e->reason == FinishReason::Stop || e->reason == FinishReason::Length) {
      text += out.finish();
      finish = out.stopped() ? "stop" : finish_reason_text(e->reason);
      usage.completion_tokens = out.stopped() ? out.tokens() : e->usage.completion_tokens;
      break;
    }
    if (e->reason == FinishReason::Abort)
      throw ApiError(503, "the request was aborted: the server is shutting down", {}, "shutting_down");
    throw ApiError(500, "the engine failed this request: " + e->error, {}, "engine_error");
  }
  const std::vector<int32_t> ids(out.ids());
  const ResponseIds rid{new_response_id(r.endpoint), static_cast<int64_t>(std::time(nullptr)),
                        config_.model_name};
  res.set_content(dump(completion_response(r.endpoint, rid, text, finish, usage,
                                           with_ids ? &f->prompt : nullptr, with_ids ? &ids : nullptr)),
                  "application/json");
}

void OpenAiServer::respond_stream(const std::shared_ptr<Flight>& f, httplib::Response& res,
                                  bool close_delimited) {
  struct Stream {
    std::shared_ptr<Flight> flight;
    OutputText out;
    StreamChunks chunks;
    bool
        with_ids;  // one chunk per id, with its token_ids (return_token_ids, or no tokenizer: no text at all)
    std::string piece_chunk(const std::string& piece, int32_t id) const {
      return with_ids ? chunks.text_with_ids(piece, {id}) : chunks.text(piece);
    }
  };
  const GenerationRequest& r = f->request;
  auto st = std::make_shared<Stream>(
      Stream{f, OutputText(tokenizer_, r.stop),
             StreamChunks(r.endpoint,
                          ResponseIds{new_response_id(r.endpoint), static_cast<int64_t>(std::time(nullptr)),
                                      config_.model_name},
                          r.include_usage),
             r.return_token_ids || !tokenizer_});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++active_handlers_;
  }
  res.set_header("Cache-Control", "no-cache");
  // httplib calls the provider on this connection's thread once the headers are out; it writes the whole
  // stream in one call. A failed write means the client is gone: abort, and return false to drop the connection.
  auto provider = [this, st](size_t, httplib::DataSink& sink) {
        // Nothing may escape into httplib's worker thread (it would end the process): any failure drops the
        // connection and aborts the request.
        try {
          Flight& fl = *st->flight;
          const auto write = [&](const std::string& s) {
            return s.empty() || sink.write(s.data(), s.size());
          };
          const auto client_left = [&] {
            engine_.abort(fl.engine_id);  // its KV cache returns to the pool at the next step
            return false;
          };
          if (!write(st->chunks.start())) return client_left();
          Clock::time_point last_write = Clock::now();
          const Usage prompt_only{static_cast<int64_t>(fl.prompt.size()), 0};
          for (;;) {
            const std::optional<EngineEvent> e = fl.queue.pop(std::chrono::milliseconds(100));
            if (!e) {
              // Queued or prefilling: an SSE comment now and then finds a client that left (clients ignore it).
              if (Clock::now() - last_write > std::chrono::seconds(1)) {
                if (!write(": keep-alive\n\n")) return client_left();
                last_write = Clock::now();
              }
              continue;
            }
            last_write = Clock::now();
            if (e->kind == EngineEvent::Kind::Token) {
              const std::string piece = st->out.push(e->token);
              if (st->out.stopped()) {
                fl.stopped_by_string = true;
                engine_.abort(fl.engine_id);
                Usage u = prompt_only;
                u.completion_tokens = st->out.tokens();
                if (!write(st->piece_chunk(piece, e->token) + st->chunks.finish("stop", u))) return false;
                sink.done();
                return true;
              }
              if (!write(st->piece_chunk(piece, e->token))) return client_left();
              continue;
            }
            std::string last;
            if (e->reason == FinishReason::Stop || e->reason == FinishReason::Length) {
              last = st->chunks.text(st->out.finish());
              Usage u = prompt_only;
              u.completion_tokens = st->out.stopped() ? st->out.tokens() : e->usage.completion_tokens;
              last += st->chunks.finish(st->out.stopped() ? "stop" : finish_reason_text(e->reason), u);
            } else if (e->reason == FinishReason::Abort) {
              last = st->chunks.error(
                  ApiError(503, "the request was aborted: the server is shutting down", {}, "shutting_down"));
            } else {
              last = st->chunks.error(
                  ApiError(500, "the engine failed this request: " + e->error, {}, "engine_error"));
            }
            if (!write(last)) return false;
            sink.done();
            return true;
          }
        } catch (const std::exception& e) {
          log_line(std::string("stream of request ") + std::to_string(st->flight->engine_id) +
                   " failed: " + e.what());
          engine_.abort(st->flight->engine_id);
          return false;
        }
      };
  auto release = [this, st](bool) {
        // Called when httplib is done with the response, however it ended: the engine must not go on for nobody.
        if (!st->flight->engine_finished) engine_.abort(st->flight->engine_id);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          --active_handlers_;
        }
        idle_cv_.notify_all();
      };
  // HTTP/1.1: chunked transfer encoding. HTTP/1.0 has none (RFC 9112 forbids sending it to a 1.0 client): the
  // body ends when the connection closes, which the connection layer does after this response.
  if (close_delimited) {
    current_connection().close_after_response = true;
    res.set_content_provider("text/event-stream", std::move(provider), std::move(release));
  } else {
    res.set_chunked_content_provider("text/event-stream", std::move(provider), std::move(release));
  }
}

}  // namespace tvllm::server
