// Lesson 13: an OpenAI-compatible HTTP server over lesson 11's Engine.
//
//   HTTP threads (cpp-httplib's pool)                      the engine thread (one, owns the model)
//   ─────────────────────────────────                      ──────────────────────────────────────
//   parse + validate the body (protocol.h)                 loop:
//   tokenize / render the chat template                      wait_for_work()
//   admit: --max-waiting full? -> 429 at once                step(): inbox -> schedule -> forward -> sample
//   engine.submit(ids, params, sink) ───── inbox ──────►     sink(event) for each new id ──┐
//   pop events from the request's queue  ◄──── queue ──────────────────────────────────────┘
//   decode, stop strings (stop_strings.h)
//   write JSON, or SSE chunks as they come (protocol.h); a failed write = the client left -> engine.abort(id)
//
// HTTP threads never touch the model: they parse, submit and stream. The engine thread never blocks on a
// socket: its sinks push into a per-request queue and return. So a slow client slows only itself.
//
// Backpressure: requests admitted but without a first token yet ("waiting") are capped by max_waiting, and all
// admitted requests by max_sequences + max_waiting; one more is answered 429 at once (an OpenAI client retries
// with backoff), never queued without bound.
// Shutdown (shutdown(), the serve command's SIGINT/SIGTERM): new requests get 503, in-flight ones may finish
// within the grace period, the rest are aborted (their KV returns to the pool), every client connection is
// closed (no client keeps the process alive), then the threads stop.
// Connections (connections.h): a request must arrive whole within read_timeout_s, its bytes count against
// max_body_bytes whatever the framing, at most max_connections are open; a request still arriving holds no
// HTTP worker.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <unordered_map>

#include "chat_template.h"
#include "engine.h"
#include "metrics.h"
#include "protocol.h"
#include "tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace tvllm::server {

class HttpServer;  // connections.h

struct ServerConfig {
  std::string host = "127.0.0.1";           // loopback only unless asked (--host 0.0.0.0 exposes it)
  int port = 8000;                          // 0: any free port (start() returns the one it got)
  std::string model_name;                   // what clients send as "model" (required)
  std::string api_key;                      // non-empty: "Authorization: Bearer <key>" required on /v1/*
  int64_t max_waiting = 128;                // admitted requests without a first token yet; one more -> 429
  size_t max_body_bytes = size_t{1} << 20;  // larger bodies -> 413
  int64_t default_max_tokens = 16;          // completions without max_tokens (OpenAI's default); chat: the
                                            // rest of the context, as vLLM does
  int http_threads = 0;                     // 0: max_sequences + max_waiting + 16
  int keep_alive_timeout_s = 5;
  double read_timeout_s = 30;       // a whole request (headers + body) must arrive within this (408 otherwise)
  int64_t max_connections = 1000;   // open client connections; one more is answered 503 and closed
  std::ostream* log = nullptr;  // one line per generation request and per shutdown phase (nullptr: quiet)
};

// What the server has seen, for tests and the lesson executable (GET /metrics has the same and more).
struct ServerStats {
  int64_t in_flight = 0;        // admitted generation requests the engine has not finished
  int64_t awaiting_first = 0;   // of those, without a first token
  int64_t active_handlers = 0;  // HTTP handlers still writing a response
  int64_t finished_stop = 0, finished_length = 0, aborted = 0, failed = 0;
  int64_t rejected_429 = 0, rejected_503 = 0;
};

// What admission looks at when one more generation request arrives (under the server's lock).
struct AdmissionLoad {
  bool draining = false;       // shutdown() has begun
  int64_t awaiting_first = 0;  // admitted requests without a first token yet
  int64_t in_flight = 0;       // admitted requests the engine has not finished
  int64_t max_waiting = 0;     // ServerConfig::max_waiting
  int64_t max_sequences = 0;   // the engine's limit of sequences running at once
};
// nullopt: admit it. Otherwise the error to answer at once: 503 "shutting_down" while draining, 429
// "queue_full" when the waiting room or the whole house is full (exercise 13.3).
std::optional<ApiError> admission_refusal(const AdmissionLoad& load);

class OpenAiServer {
 public:
  // engine and tokenizer must outlive the server; the server's engine thread is the only caller of
  // engine.step() while it runs. tokenizer nullptr (a model without tokenizer.json, e.g. random weights for a
  // benchmark): prompts must be token ids, completions carry token_ids and no text. chat_template nullopt:
  // /v1/chat/completions answers 400.
  OpenAiServer(Engine& engine, const Tokenizer* tokenizer, std::optional<ChatTemplate> chat_template,
               ServerConfig config);
  ~OpenAiServer();  // shutdown(0 s) if still running
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  // Binds host:port, starts the engine thread and the HTTP threads; returns the port. InputError when the
  // address cannot be bound (in use, not an address of this machine). Ignores SIGPIPE for the process: a write
  // to a closed connection must fail (and abort its request), not kill the server.
  int start();
  int port() const { return port_; }
  bool running() const { return running_; }

  // Stops accepting (new generation requests: 503), lets in-flight requests finish for up to `grace`, aborts
  // the rest (streams end with an error event, non-streaming requests get 503), gives the workers up to 5 s to
  // write, shuts every client socket down, then stops the HTTP and engine threads: it returns within about
  // grace + 10 s whatever the clients do. Idempotent. Returns the number of requests it had to abort.
  int64_t shutdown(std::chrono::milliseconds grace);

  ServerStats stats() const;
  const ServerMetrics& metrics() const { return metrics_; }
  const ServerConfig& config() const { return config_; }
  Engine& engine() { return engine_; }

 private:
  struct Flight;  // one admitted request (server_internal.h)

  void engine_loop();
  void route();
  void check_auth(const httplib::Request& req) const;
  void handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  std::vector<int32_t> prompt_ids(const GenerationRequest& r) const;
  const Tokenizer& tokenizer() const;  // ApiError 400 when the model has none
  std::shared_ptr<Flight> admit(std::vector<int32_t> prompt, const GenerationRequest& r, int64_t max_tokens);
  void on_event(const std::shared_ptr<Flight>& flight, const EngineEvent& event);
  void respond_whole(const std::shared_ptr<Flight>& flight, httplib::Response& res);
  void respond_stream(const std::shared_ptr<Flight>& flight, httplib::Response& res, bool close_delimited);
  void set_error(httplib::Response& res, const ApiError& e);
  void log_line(const std::string& line) const;

  Engine& engine_;
  const Tokenizer* tokenizer_;  // nullptr: token ids only
  std::optional<ChatTemplate> chat_template_;
  ServerConfig config_;
  std::unique_ptr<HttpServer> http_;
  ServerMetrics metrics_;
  int port_ = 0;
  int64_t created_ = 0;  // Unix seconds at start(): /v1/models' "created"

  std::thread http_thread_, engine_thread_;
  std::atomic<bool> running_{false}, draining_{false}, stop_engine_{false}, aborting_{false};

  // Admission and the in-flight table (shutdown aborts what is left in it).
  mutable std::mutex mutex_;
  std::condition_variable idle_cv_;                             // in_flight_ or active_handlers_ went down
  std::unordered_map<int64_t, std::weak_ptr<Flight>> flights_;  // by engine request id
  int64_t in_flight_ = 0, awaiting_first_ = 0;
  int64_t active_handlers_ = 0;  // handlers still writing a response (shutdown waits for them)
  std::atomic<uint64_t> seed_counter_{0};
};

}  // namespace tvllm::server
