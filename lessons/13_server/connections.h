// The server's connection layer: cpp-httplib's HTTP parsing and routing, with the sockets handled here.
//
// httplib's own model is one worker thread per connection, blocking on every read: a client that sends its
// request a byte at a time holds a worker until it is done, so a few hundred slow clients leave none for
// /health (measured: ~215 connections each sending a byte every 2 s made the server unreachable). Here the
// accept thread hands every connection to one poller thread, which reads requests as they trickle in without
// holding a worker:
//
//   accept ──► poller (poll() over every open connection, one thread)
//                │ reads a request's headers and its Content-Length body; idle keep-alive connections wait
//                here │ deadline passed: 408 and close   over --max-connections: 503 and close at once ▼ a
//                whole request
//              workers (a fixed pool) ──► httplib parses and routes it, the handler answers (or streams)
//                │ keep-alive: the connection goes back to the poller
//
// Limits, each enforced on what arrives, whatever the framing:
//   - a request (headers + body) must arrive within request_timeout of its first byte (408 otherwise);
//   - the bytes of one request, framing included, may not exceed max_body_bytes + kMaxHeaderBytes (413): a
//     chunked body is counted as its chunks arrive; a Content-Length over max_body_bytes is refused before
//     a byte of the body is read;
//   - at most max_connections open connections (one more is answered 503 with Retry-After and closed);
//   - close_all() (shutdown, after the grace period) shuts every client socket down, so no client, however
//     slow, keeps the process alive.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tvllm::server {

struct ConnectionLimits {
  std::chrono::milliseconds request_timeout{30000};    // first byte to last byte of one request
  std::chrono::milliseconds keep_alive_timeout{5000};  // an idle connection between requests
  std::chrono::milliseconds write_timeout{5000};       // one write that makes no progress
  size_t max_body_bytes = size_t{1} << 20;
  int64_t max_connections = 1024;
  int workers = 64;
};

// What a handler may tell the connection layer about the request its thread is serving.
struct ConnectionContext {
  bool close_after_response = false;  // close once this response is written (e.g. a close-delimited stream)
  bool over_limit = false;            // the request's bytes passed the limit while httplib read the body
  bool timed_out = false;             // the request's deadline passed while httplib read the body
  int64_t request_bytes = 0;
};
ConnectionContext& current_connection();  // the calling worker's (thread-local)

class HttpServer : public httplib::Server {
 public:
  static constexpr size_t kMaxHeaderBytes = 64 * 1024;  // request line + headers

  HttpServer(ConnectionLimits limits, std::function<void(const std::string&)> log);
  ~HttpServer() override;

  void raise_backlog(int backlog);
  // Starts the poller and the workers; call before listen_after_bind().
  void start_connections();
  // Waits until no worker holds a connection and none is queued for one (the responses are written), at most
  // `timeout`. True if it got there.
  bool wait_idle(std::chrono::milliseconds timeout);
  // Shuts every open client connection down (blocked reads and writes return at once); new ones are refused.
  void close_all();
  // After stop() and the listen thread's return: stops the poller and joins the workers.
  void stop_connections();
  int64_t open_connections() const { return open_.load(); }
  int64_t timed_out() const { return timed_out_.load(); }

 private:
  struct Conn;
  bool process_and_close_socket(socket_t sock) override;  // the accept thread: hand over, never block
  void poll_loop();
  void worker_loop();
  void to_poller(std::unique_ptr<Conn> c);
  void to_worker(std::unique_ptr<Conn> c);
  bool request_ready(const Conn& c) const;
  void finish(std::unique_ptr<Conn> c, bool keep);  // back to the poller, or a lingering close
  void close_conn(Conn& c);
  void wake();

  ConnectionLimits limits_;
  std::function<void(const std::string&)> log_;
  int wake_fd_[2] = {-1, -1};
  std::atomic<bool> stopping_{false}, closing_{false};
  std::atomic<int64_t> open_{0}, timed_out_{0};

  std::mutex mutex_;                             // guards incoming_, ready_, busy_
  std::vector<std::unique_ptr<Conn>> incoming_;  // for the poller
  std::deque<std::unique_ptr<Conn>> ready_;      // for the workers
  std::unordered_map<int, bool> busy_;           // sockets a worker holds (close_all shuts them down)
  std::condition_variable ready_cv_, idle_cv_;
  std::thread poller_;
  std::vector<std::thread> workers_;
};

}  // namespace tvllm::server
