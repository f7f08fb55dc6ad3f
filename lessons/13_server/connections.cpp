// The connection layer (connections.h): the poller, the workers, and a socket stream with deadlines.
#include "connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tvllm::server {

namespace {

using Clock = std::chrono::steady_clock;

// Rounded up: a wait of ms_until(t) does not end before t.
int ms_until(Clock::time_point t) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

// True when fd is ready for `events` within timeout_ms (EINTR retried with the time left).
bool wait_fd(int fd, short events, int timeout_ms) {
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms_until(until));
    if (r > 0) return true;
    if (r == 0 || errno != EINTR) return false;
  }
}

// A whole answer written in one non-blocking send, for the poller's refusals (it must never block). A client
// whose socket buffer is full simply does not get it.
void send_refusal(int fd, int status, const char* reason, const std::string& message, bool retry_after) {
  const std::string body = R"({"error":{"message":")" + message + R"(","type":")" +
                           (status >= 500 ? "server_error" : "invalid_request_error") +
                           R"(","param":null,"code":null}})";
  std::string r = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                  "\r\nContent-Type: application/json\r\nConnection: close\r\n";
  if (retry_after) r += "Retry-After: 1\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)::send(fd, r.data(), r.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

class InlineQueue : public httplib::TaskQueue {  // the accept thread runs each task itself: a hand-over
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

thread_local ConnectionContext t_context;

}  // namespace

ConnectionContext& current_connection() { return t_context; }

struct HttpServer::Conn {
  enum class State { Idle, Reading, Lingering };
  int fd = -1;
  State state = State::Idle;
  std::string buf;             // received, not yet parsed
  Clock::time_point deadline;  // Idle: keep-alive ends; Reading: the request's deadline; Lingering: close
};

// httplib reads and writes through this stream instead of its own socket stream: reads come from what the
// poller already received, then from the socket until the request's deadline; every byte counts against the
// request's limit.
class ConnStream : public httplib::Stream {
 public:
  ConnStream(int fd, std::string& buf, Clock::time_point deadline, size_t cap, std::chrono::milliseconds wt)
      : fd_(fd), buf_(buf), deadline_(deadline), cap_(cap), write_timeout_(wt) {}
  ~ConnStream() override { buf_.erase(0, pos_); }  // what is left belongs to the next request

  bool is_readable() const override {
    return pos_ < buf_.size() || wait_fd(fd_, POLLIN, ms_until(deadline_));
  }
  bool is_writable() const override {
    return wait_fd(fd_, POLLOUT, static_cast<int>(write_timeout_.count()));
  }
  ssize_t read(char* ptr, size_t size) override {
    ConnectionContext& ctx = current_connection();
    if (pos_ == buf_.size()) {
      buf_.clear();
      pos_ = 0;
      if (!wait_fd(fd_, POLLIN, ms_until(deadline_))) {
        ctx.timed_out = Clock::now() >= deadline_;  // the error handler answers 408
        return -1;
      }
      char tmp[16384];
      const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n <= 0) return -1;
      buf_.assign(tmp, static_cast<size_t>(n));
    }
    const size_t n = std::min(size, buf_.size() - pos_);
    if (static_cast<size_t>(ctx.request_bytes) + n > cap_) {
      ctx.over_limit = true;  // the error handler answers 413
      return -1;
    }
    ctx.request_bytes += static_cast<int64_t>(n);
    std::memcpy(ptr, buf_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    size_t sent = 0;
    while (sent < size) {
      if (!is_writable()) return -1;  // a client that stopped reading
      const ssize_t n = ::send(fd_, ptr + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return -1;
      }
      sent += static_cast<size_t>(n);
    }
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    auto* sa = reinterpret_cast<sockaddr*>(&a);
    if ((peer ? ::getpeername(fd_, sa, &len) : ::getsockname(fd_, sa, &len)) != 0) return;
    char text[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
      ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<sockaddr_in6*>(&a);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
      port = ntohs(v6->sin6_port);
    }
    ip = text;
  }

  int fd_;
  std::string& buf_;
  size_t pos_ = 0;
  Clock::time_point deadline_;
  size_t cap_;
  std::chrono::milliseconds write_timeout_;
};

HttpServer::HttpServer(ConnectionLimits limits, std::function<void(const std::string&)> log)
    : limits_(limits), log_(std::move(log)) {
  new_task_queue = [] { return new InlineQueue; };
  if (::pipe2(wake_fd_, O_NONBLOCK | O_CLOEXEC) != 0) wake_fd_[0] = wake_fd_[1] = -1;
}

HttpServer::~HttpServer() {
  close_all();
  stop_connections();
  for (const int fd : wake_fd_)
    if (fd >= 0) ::close(fd);
}

void HttpServer::raise_backlog(int backlog) {
  const socket_t sock = svr_sock_;
  if (sock != INVALID_SOCKET) ::listen(sock, backlog);
}

void HttpServer::start_connections() {
  if (poller_.joinable()) return;
  poller_ = std::thread([this] { poll_loop(); });
  for (int i = 0; i < std::max(1, limits_.workers); ++i) workers_.emplace_back([this] { worker_loop(); });
}

void HttpServer::wake() {
  if (wake_fd_[1] >= 0) (void)!::write(wake_fd_[1], "w", 1);
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  if (closing_ || open_.load() >= limits_.max_connections) {
    send_refusal(sock, 503, "Service Unavailable",
                 closing_ ? "the server is shutting down"
                          : "too many open connections (--max-connections " +
                                std::to_string(limits_.max_connections) + "); retry later",
                 true);
    ::close(sock);
    return false;
  }
  const int one = 1;
  ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // see set_tcp_nodelay in server.cpp
  ++open_;
  auto c = std::make_unique<Conn>();
  c->fd = sock;
  c->deadline = Clock::now() + limits_.keep_alive_timeout;
  to_poller(std::move(c));
  return true;
}

void HttpServer::to_poller(std::unique_ptr<Conn> c) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming_.push_back(std::move(c));
  }
  wake();
}

void HttpServer::to_worker(std::unique_ptr<Conn> c) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_.push_back(std::move(c));
  }
  ready_cv_.notify_one();
}

void HttpServer::close_conn(Conn& c) {
  if (c.fd < 0) return;
  ::close(c.fd);
  c.fd = -1;
  --open_;
}

// A request is ready for a worker once its headers have come and, when it announces a Content-Length within
// the limit, its body too. A chunked body is read by the worker (counted, under the same deadline); a
// Content-Length over the limit goes at once (413 without reading the body); headers that never end go when
// they pass kMaxHeaderBytes (httplib refuses them).
bool HttpServer::request_ready(const Conn& c) const {
  const size_t end = c.buf.find("\r\n\r\n");
  if (end == std::string::npos) return c.buf.size() > kMaxHeaderBytes;
  size_t line = c.buf.find("\r\n") + 2;  // skip the request line
  while (line < end + 2) {
    const size_t eol = c.buf.find("\r\n", line);
    const size_t colon = c.buf.find(':', line);
    if (colon != std::string::npos && colon < eol) {
      std::string name = c.buf.substr(line, colon - line);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char ch) { return std::tolower(ch); });
      if (name == "transfer-encoding") return true;
      if (name == "content-length") {
        const std::string value = c.buf.substr(colon + 1, eol - colon - 1);
        char* stop = nullptr;
        errno = 0;
        const unsigned long long n = std::strtoull(value.c_str(), &stop, 10);
        if (errno != 0 || n > limits_.max_body_bytes) return true;
        return c.buf.size() >= end + 4 + n;
      }
    }
    line = eol + 2;
  }
  return true;
}

void HttpServer::poll_loop() {
  std::vector<std::unique_ptr<Conn>> conns;
  std::vector<pollfd> fds;
  char tmp[16384];
  while (!stopping_) {
    const Clock::time_point now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& c : incoming_) conns.push_back(std::move(c));
      incoming_.clear();
    }
    // A connection back from a worker may hold the start of the next request already (pipelining).
    for (auto& c : conns) {
      if (c->state == Conn::State::Idle && !c->buf.empty()) {
        c->state = Conn::State::Reading;
        c->deadline = now + limits_.request_timeout;
      }
      if (c->state == Conn::State::Reading && request_ready(*c)) to_worker(std::move(c));
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
    if (closing_) {
      for (auto& c : conns) close_conn(*c);
      conns.clear();
    }

    fds.assign(1, pollfd{wake_fd_[0], POLLIN, 0});
    Clock::time_point next = now + std::chrono::seconds(1);
    for (const auto& c : conns) {
      fds.push_back(pollfd{c->fd, POLLIN, 0});
      next = std::min(next, c->deadline);
    }
    const int r = ::poll(fds.data(), fds.size(), ms_until(next));
    if (r < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN)
      while (::read(wake_fd_[0], tmp, sizeof tmp) > 0) {
      }
    const Clock::time_point after = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = *conns[i];
      if (fds[i + 1].revents != 0) {
        const ssize_t n = ::recv(c.fd, tmp, sizeof tmp, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          close_conn(c);  // the client closed (or reset) it
          conns[i].reset();
          continue;
        }
        if (n > 0 && c.state != Conn::State::Lingering) {
          if (c.state == Conn::State::Idle) {
            c.state = Conn::State::Reading;
            c.deadline = after + limits_.request_timeout;
          }
          c.buf.append(tmp, static_cast<size_t>(n));
          if (request_ready(c)) {
            to_worker(std::move(conns[i]));
            continue;
          }
        }
      }
      if (after >= c.deadline) {
        if (c.state == Conn::State::Reading) {
          ++timed_out_;
          send_refusal(c.fd, 408, "Request Timeout",
                       "the request did not arrive within " +
                           std::to_string(limits_.request_timeout.count() / 1000.0).substr(0, 5) + " s",
                       false);
        }
        close_conn(c);
        conns[i].reset();
      }
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
  }
  for (auto& c : conns) close_conn(*c);
}

void HttpServer::worker_loop() {
  for (;;) {
    std::unique_ptr<Conn> c;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_cv_.wait(lock, [&] { return !ready_.empty() || stopping_; });
      if (ready_.empty()) return;
      c = std::move(ready_.front());
      ready_.pop_front();
      busy_[c->fd] = true;
    }
    bool keep = false;
    if (!closing_) {
      ConnectionContext& ctx = current_connection();
      ctx = ConnectionContext{};
      // An HTTP/1.0 request: httplib answers "Connection: close" (and the stream is close-delimited).
      const size_t eol = c->buf.find("\r\n");
      const bool http10 = eol != std::string::npos && eol >= 8 && c->buf.compare(eol - 8, 8, "HTTP/1.0") == 0;
      bool connection_closed = false, ok = false;
      {
        ConnStream strm(c->fd, c->buf, c->deadline, limits_.max_body_bytes + kMaxHeaderBytes,
                        limits_.write_timeout);
        try {
          ok = process_request(strm, /*close_connection=*/http10, connection_closed, {});
        } catch (const std::exception& e) {  // httplib's own failures (allocation, ...): drop the connection
          if (log_) log_(std::string("connection: ") + e.what());
        }
      }
      keep = ok && !http10 && !connection_closed && !ctx.close_after_response && !ctx.over_limit &&
             !ctx.timed_out;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_.erase(c->fd);
    }
    idle_cv_.notify_all();
    finish(std::move(c), keep);
  }
}

void HttpServer::finish(std::unique_ptr<Conn> c, bool keep) {
  if (closing_ || stopping_) {
    close_conn(*c);
    return;
  }
  if (keep) {
    c->state = Conn::State::Idle;
    c->deadline = Clock::now() + limits_.keep_alive_timeout;
  } else {
    // A lingering close: stop writing, read and drop what the client still sends (the rest of a body refused
    // with 413) for a moment. Closing a socket with unread input sends a reset, which can destroy the answer
    // before the client reads it.
    ::shutdown(c->fd, SHUT_WR);
    c->state = Conn::State::Lingering;
    c->buf.clear();
    c->deadline = Clock::now() + std::chrono::seconds(2);
  }
  to_poller(std::move(c));
}

bool HttpServer::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return idle_cv_.wait_for(lock, timeout, [&] { return busy_.empty() && ready_.empty(); });
}

void HttpServer::close_all() {
  closing_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [fd, busy] : busy_) ::shutdown(fd, SHUT_RDWR);  // the worker's read or write fails now
  }
  wake();
}

void HttpServer::stop_connections() {
  stopping_ = true;
  ready_cv_.notify_all();
  wake();
  if (poller_.joinable()) poller_.join();
  for (std::thread& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& c : incoming_) close_conn(*c);
  for (auto& c : ready_) close_conn(*c);
  incoming_.clear();
  ready_.clear();
}

}  // namespace tvllm::server
