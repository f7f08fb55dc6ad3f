// Lesson 13 against hostile and odd clients, over real sockets on loopback (issue 16): bodies over the limit
// whatever their framing, slow clients, a read deadline, a connection limit, shutdown with clients that never
// finish, requests OpenAI refuses, an HTTP/1.0 stream and Retry-After. Raw sockets speak HTTP here: the point is
// to send what a well-behaved client library never would.
//
// Timings are generous (a loaded 2-core CI machine): the limits under test are set small (a 1 s read deadline,
// 4 workers, 4 connections) and every wait is bounded by a deadline far above what a passing run needs and far
// below what the failure it guards against would take (a hang).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "chat_template.h"
#include "engine_paged.h"
#include "model_dir.h"
#include "model_weights.h"
#include "server.h"
#include "server/bundled_model.h"
#include "server/http_client.h"
#include "tokenizer.h"

namespace tvllm::server {
namespace {

using nlohmann::json;
using namespace tvllm::testing_http;
using Clock = std::chrono::steady_clock;

const char* const kModel = "tiny-llama3";

struct Harness {
  explicit Harness(ServerConfig sc = {}) {
    EngineConfig ec;
    ec.max_sequences = 8;
    ec.max_tokens_per_step = 256;
    ec.max_context = 512;
    engine = std::make_unique<Engine>(model().weights, ec, paged_kv());
    sc.port = 0;
    sc.model_name = kModel;
    server = std::make_unique<OpenAiServer>(*engine, &model().tok, model().chat, sc);
    port = server->start();
  }
  ~Harness() {
    server.reset();
    engine.reset();
  }
  std::unique_ptr<Engine> engine;
  std::unique_ptr<OpenAiServer> server;
  int port = 0;
};

// ---- a raw HTTP client ------------------------------------------------------------------------------------

class Raw {
 public:
  explicit Raw(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~Raw() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  // False once the server has closed (or reset) the connection.
  bool send(const std::string& s) {
    size_t sent = 0;
    while (sent < s.size()) {
      const ssize_t n = ::send(fd_, s.data() + sent, s.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  // Everything until the server closes the connection or `timeout_s` passes.
  std::string read_all(double timeout_s = 30) {
    std::string out;
    const auto until = Clock::now() + std::chrono::duration<double>(timeout_s);
    char buf[65536];
    while (Clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  // One response (headers, then Content-Length bytes of body), leaving the connection open.
  std::string read_response(double timeout_s = 30) {
    std::string out;
    const auto until = Clock::now() + std::chrono::duration<double>(timeout_s);
    char buf[65536];
    while (Clock::now() < until) {
      const size_t end = out.find("\r\n\r\n");
      if (end != std::string::npos) {
        const size_t cl = out.find("Content-Length: ");
        const size_t len = cl < end ? std::stoul(out.substr(cl + 16)) : 0;
        if (out.size() >= end + 4 + len) break;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  bool closed() const { return closed_; }

 private:
  int fd_ = -1;
  bool closed_ = false;
};

int status_of(const std::string& response) {
  return response.rfind("HTTP/1.1 ", 0) == 0 ? std::atoi(response.c_str() + 9) : 0;
}
json body_of(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? json() : json::parse(response.substr(end + 4), nullptr, false);
}

std::string post_head(const std::string& path, const std::string& extra_headers) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra_headers +
         "\r\n";
}
std::string request(const std::string& path, const std::string& body) {
  return post_head(path, "Content-Length: " + std::to_string(body.size()) + "\r\n") + body;
}
std::string chunk(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

json completion(int64_t max_tokens, json extra = json::object()) {
  json b = {{"model", kModel}, {"prompt", "The capital of Portugal is"}, {"max_tokens", max_tokens},
            {"temperature", 0}};
  b.update(extra);
  return b;
}
json chat(json extra = json::object()) {
  json b = {{"model", kModel},
            {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
            {"max_completion_tokens", 1},
            {"temperature", 0}};
  b.update(extra);
  return b;
}

// ---- admission (exercise 13.3) ----------------------------------------------------------------------------

TEST(Server13Admission, Decisions) {
  AdmissionLoad load;
  load.max_waiting = 2;
  load.max_sequences = 4;
  EXPECT_FALSE(admission_refusal(load).has_value());  // empty
  load.awaiting_first = 1;
  load.in_flight = 5;
  EXPECT_FALSE(admission_refusal(load).has_value());  // room in both
  load.awaiting_first = 2;  // the waiting room is full
  std::optional<ApiError> r = admission_refusal(load);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 429);
  EXPECT_EQ(r->code, "queue_full");
  EXPECT_NE(std::string(r->what()).find("retry"), std::string::npos) << r->what();
  load.awaiting_first = 0;
  load.in_flight = 6;  // 4 running + 2 waiting: the house is full though none waits for a first token
  r = admission_refusal(load);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 429);
  load.in_flight = 5;
  EXPECT_FALSE(admission_refusal(load).has_value());
  load.draining = true;  // shutting down: 503 even with room
  r = admission_refusal(load);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(r->code, "shutting_down");
  AdmissionLoad none;  // --max-waiting 0: nothing can wait, so nothing is admitted
  none.max_sequences = 4;
  ASSERT_TRUE(admission_refusal(none).has_value());
  EXPECT_EQ(admission_refusal(none)->status, 429);
}

TEST(Server13Hostile, RetryAfterOn429) {
  ServerConfig sc;
  sc.max_waiting = 0;  // every generation request is refused at once
  Harness h(sc);
  Raw c(h.port);
  ASSERT_TRUE(c.send(request("/v1/completions", completion(2).dump())));
  const std::string r = c.read_response();
  EXPECT_EQ(status_of(r), 429) << r;
  EXPECT_NE(r.find("\r\nRetry-After: 1\r\n"), std::string::npos) << r;
  EXPECT_EQ(body_of(r)["error"]["code"], "queue_full");
}

// ---- bodies over the limit, whatever the framing ----------------------------------------------------------

TEST(Server13Hostile, ChunkedBodyOverTheLimitIs413) {
  ServerConfig sc;
  sc.max_body_bytes = 64 * 1024;
  Harness h(sc);
  // A valid request sent chunked, under the limit: answered.
  {
    const std::string body = completion(2).dump();
    Raw c(h.port);
    ASSERT_TRUE(c.send(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n") +
                       chunk(body.substr(0, 10)) + chunk(body.substr(10)) + "0\r\n\r\n"));
    const std::string r = c.read_response();
    EXPECT_EQ(status_of(r), 200) << r;
  }
  // 8 MiB in 16 KiB chunks: refused once 64 KiB have come, long before the end (the server stops reading; the
  // client may see its later sends fail).
  Raw c(h.port);
  ASSERT_TRUE(c.send(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n")));
  const std::string piece(16 * 1024, 'a');
  for (int i = 0; i < 512 && c.send(chunk(piece)); ++i) {
  }
  const std::string r = c.read_all();
  EXPECT_EQ(status_of(r), 413) << r.substr(0, 300);
  EXPECT_EQ(body_of(r)["error"]["code"], "request_too_large");
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(get(h.port, "/health").status, 200);
}

// 10^15 bytes announced: refused before a byte of the body is read (httplib alone reads and drops it all).
TEST(Server13Hostile, HugeContentLengthIs413AtOnce) {
  Harness h;
  Raw c(h.port);
  const auto t0 = Clock::now();
  ASSERT_TRUE(c.send(post_head("/v1/completions", "Content-Length: 1000000000000000\r\n") + "{\"mod"));
  const std::string r = c.read_all(30);
  EXPECT_EQ(status_of(r), 413) << r;
  EXPECT_TRUE(c.closed());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0);
}

// ---- slow clients -----------------------------------------------------------------------------------------

// 32 clients sending a request a byte at a time, 4 workers: /health and a completion are still answered at
// once (requests still arriving hold no worker). Without the poller, /health waited for a free worker (for
// ever with the old defaults).
TEST(Server13Hostile, SlowClientsDoNotBlockHealth) {
  ServerConfig sc;
  sc.http_threads = 4;
  sc.read_timeout_s = 120;
  Harness h(sc);
  std::vector<std::unique_ptr<Raw>> slow;
  for (int i = 0; i < 32; ++i) {
    slow.push_back(std::make_unique<Raw>(h.port));
    ASSERT_TRUE(slow.back()->ok());
    ASSERT_TRUE(slow.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"));
  }
  for (int round = 0; round < 3; ++round) {
    for (auto& s : slow) EXPECT_TRUE(s->send("X"));
    const auto t0 = Clock::now();
    httplib::Client cl("127.0.0.1", h.port);
    cl.set_read_timeout(20);
    const auto health = cl.Get("/health");
    ASSERT_TRUE(health) << "round " << round;
    EXPECT_EQ(health->status, 200);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
  }
  EXPECT_EQ(post(h.port, "/v1/completions", completion(2)).status, 200);
}

// A request that does not arrive within --read-timeout (headers + body, from its first byte): 408, closed.
TEST(Server13Hostile, ReadDeadlineIs408) {
  ServerConfig sc;
  sc.read_timeout_s = 1;
  Harness h(sc);
  // Headers that never end, a byte at a time.
  Raw a(h.port);
  ASSERT_TRUE(a.send("GET /health HTTP/1.1\r\n"));
  // A body that never ends (the headers came whole).
  Raw b(h.port);
  ASSERT_TRUE(b.send(post_head("/v1/completions", "Content-Length: 100\r\n") + "{\"model\""));
  // A chunked body that never ends: read by a worker, under the same deadline.
  Raw c(h.port);
  ASSERT_TRUE(c.send(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n") + chunk("{\"model\"")));
  const auto t0 = Clock::now();
  std::string ra;
  for (int i = 0; i < 300 && !a.closed(); ++i) {  // at most 30 s
    (void)a.send("X");
    ra += a.read_all(0.1);
  }
  const std::string rb = b.read_all(30), rc = c.read_all(30);
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(status_of(ra), 408) << ra;
  EXPECT_EQ(status_of(rb), 408) << rb;
  EXPECT_EQ(status_of(rc), 408) << rc;
  EXPECT_TRUE(a.closed() && b.closed() && c.closed());
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 30.0);
  EXPECT_EQ(get(h.port, "/health").status, 200);
}

// One connection over --max-connections: 503 with Retry-After at once, the others unaffected.
TEST(Server13Hostile, MaxConnections) {
  ServerConfig sc;
  sc.max_connections = 4;
  sc.keep_alive_timeout_s = 120;
  Harness h(sc);
  std::vector<std::unique_ptr<Raw>> held;
  for (int i = 0; i < 4; ++i) held.push_back(std::make_unique<Raw>(h.port));
  Raw extra(h.port);
  const std::string r = extra.read_all(30);
  EXPECT_EQ(status_of(r), 503) << r;
  EXPECT_NE(r.find("Retry-After: 1"), std::string::npos) << r;
  // A held connection still works, and keeps working (keep-alive).
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(held[0]->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(status_of(held[0]->read_response()), 200);
  }
  held.clear();  // closed: room again
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (get(h.port, "/health").status != 200 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(get(h.port, "/health").status, 200);
}

// shutdown() is bounded by grace + ~10 s, whatever the clients do: one drips a byte every 100 ms,
// one holds an idle keep-alive connection, one streams and never reads.
TEST(Server13Hostile, ShutdownClosesEveryConnection) {
  ServerConfig sc;
  sc.read_timeout_s = 600;
  sc.keep_alive_timeout_s = 600;
  auto h = std::make_unique<Harness>(sc);
  Raw drip(h->port), idle(h->port), deaf(h->port);
  ASSERT_TRUE(drip.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"));
  ASSERT_TRUE(deaf.send(request("/v1/completions",
                                completion(400, {{"stream", true}, {"ignore_eos", true}}).dump())));
  std::atomic<bool> stop{false};
  std::thread dripper([&] {
    while (!stop) {
      (void)drip.send("X");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const auto t0 = Clock::now();
  h->server->shutdown(std::chrono::milliseconds(200));
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  dripper.join();
  EXPECT_LT(took, 25.0);  // grace 0.2 s + at most 5 + 5 s for handlers and writes; the old one never returned
  (void)drip.read_all(5);
  (void)idle.read_all(5);
  EXPECT_TRUE(drip.closed());
  EXPECT_TRUE(idle.closed());
  h.reset();
}

// ---- requests OpenAI and vLLM refuse ----------------------------------------------------------------------

TEST(Server13Hostile, MaxTokensNear2To63IsACleanContextError) {
  Harness h;
  for (const int64_t n : {INT64_MAX, INT64_MAX - 3, int64_t{9223372036854775000}}) {
    const Reply r = post(h.port, "/v1/completions", completion(0, {{"max_tokens", n}}));
    EXPECT_EQ(r.status, 400) << n << " " << r.body;
    EXPECT_EQ(r.j["error"]["code"], "context_length_exceeded") << r.body;
    EXPECT_EQ(r.j["error"]["param"], "max_tokens");
  }
  const Reply c = post(h.port, "/v1/chat/completions", chat({{"max_completion_tokens", INT64_MAX}}));
  EXPECT_EQ(c.status, 400) << c.body;
  EXPECT_EQ(c.j["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(h.server->stats().in_flight, 0);
}

TEST(Server13Hostile, NulByteIsInvalidJson) {
  Harness h;
  const std::string good = completion(1).dump();
  for (const std::string& body : {good + std::string("\0garbage", 8), good + std::string(1, '\0'),
                                  std::string("{\"model\":\0\"x\"}", 15)}) {
    const Reply r = post(h.port, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(r.j["error"]["code"], "invalid_json") << r.body;
  }
  EXPECT_EQ(post(h.port, "/v1/completions", good).status, 200);  // the same body without the NUL
}

TEST(Server13Hostile, OpenAiRefusesTheseValues) {
  Harness h;
  struct Case {
    const char* path;
    json body;
    const char* param;
  };
  const std::vector<Case> bad = {
      {"/v1/completions", completion(1, {{"logprobs", -1}}), "logprobs"},
      {"/v1/completions", completion(1, {{"logprobs", 6}}), "logprobs"},
      {"/v1/completions", completion(1, {{"logit_bias", json::array()}}), "logit_bias"},
      {"/v1/chat/completions", chat({{"top_logprobs", -1}}), "top_logprobs"},
      {"/v1/chat/completions", chat({{"top_logprobs", 21}}), "top_logprobs"},
      {"/v1/chat/completions", chat({{"logit_bias", json::array()}}), "logit_bias"},
      {"/v1/chat/completions", chat({{"tools", json::object()}}), "tools"},
      {"/v1/chat/completions", chat({{"functions", json::object()}}), "functions"},
  };
  for (const Case& c : bad) {
    const Reply r = post(h.port, c.path, c.body);
    EXPECT_EQ(r.status, 400) << c.body.dump() << " -> " << r.body;
    EXPECT_EQ(r.j["error"]["param"], c.param) << r.body;
    EXPECT_EQ(r.j["error"]["type"], "invalid_request_error");
  }
  // Their empty or zero forms are fine, as at OpenAI.
  const std::vector<std::pair<const char*, json>> fine = {
      {"/v1/completions", completion(1, {{"logprobs", 0}, {"logit_bias", json::object()}})},
      {"/v1/chat/completions",
       chat({{"top_logprobs", 0}, {"logit_bias", json::object()}, {"tools", json::array()}})},
  };
  for (const auto& [path, body] : fine) EXPECT_EQ(post(h.port, path, body).status, 200) << body.dump();
}

// ---- HTTP/1.0 ---------------------------------------------------------------------------------------------

// A 1.0 client cannot read chunked encoding: the stream is sent as is and ends when the server closes.
TEST(Server13Hostile, Http10StreamIsCloseDelimited) {
  Harness h;
  const std::string body = completion(6, {{"stream", true}, {"ignore_eos", true}}).dump();
  Raw c(h.port);
  ASSERT_TRUE(c.send("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\n\r\n" + body));
  const std::string r = c.read_all(60);
  EXPECT_TRUE(c.closed());
  ASSERT_EQ(status_of(r), 200) << r;
  const size_t end = r.find("\r\n\r\n");
  const std::string head = r.substr(0, end), events = r.substr(end + 4);
  EXPECT_EQ(head.find("Transfer-Encoding"), std::string::npos) << head;
  EXPECT_NE(head.find("Content-Type: text/event-stream"), std::string::npos) << head;
  EXPECT_NE(head.find("Connection: close"), std::string::npos) << head;
  EXPECT_EQ(events.rfind("data: {", 0), 0u) << events;  // no chunk-size line before the first event
  ASSERT_GE(events.size(), 14u);
  EXPECT_EQ(events.substr(events.size() - 14), "data: [DONE]\n\n");
  EXPECT_NE(events.find("\"finish_reason\":null"), std::string::npos) << events;  // text came
  EXPECT_NE(events.find("\"finish_reason\":\"length\""), std::string::npos) << events;
  // HTTP/1.1 on the same server still gets chunked encoding.
  Raw d(h.port);
  ASSERT_TRUE(d.send(post_head("/v1/completions",
                               "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n") +
                     body));
  const std::string r11 = d.read_all(60);
  EXPECT_NE(r11.find("Transfer-Encoding: chunked"), std::string::npos) << r11.substr(0, 300);
}

}  // namespace
}  // namespace tvllm::server
