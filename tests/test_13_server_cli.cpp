// Lesson 13 through the product: `tiny-vllm serve` as a subprocess on an ephemeral loopback port.
//   - its greedy output equals `tiny-vllm generate --device cpu --output json` (ids, text, finish reason);
//   - SIGTERM with a stream in flight: the stream ends (an error event after the grace period), exit status 0;
//   - `tiny-vllm bench serve` against it: every request completes, the JSON report has TTFT/TPOT percentiles;
//     a non-loopback URL is refused.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "server/http_client.h"
#include "testing/cli.h"

extern char** environ;

namespace tvllm {
namespace {

const auto q = testing::shell_quote;

using nlohmann::json;
using namespace tvllm::testing_http;

std::string bin() { return std::string(TVLLM_BIN_DIR) + "/tiny-vllm"; }
std::string model_dir() { return TVLLM_TINY_MODEL_DIR; }


struct Ran {
  int status = -1;
  std::string out;
};
Ran run(const std::string& command) {
  Ran r;
  FILE* p = popen((command + " 2>/dev/null").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// `tiny-vllm serve ... --port 0`, started with posix_spawn; the port read from its "listening on" line.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        bin(), "serve",           "--model", model_dir(),      "--device", "cpu",    "--port",
        "0",   "--max-model-len", "512",     "--max-num-seqs", "16",       "--quiet"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    out_ = fds[0];
    // Wait (at most 30 s) for "listening on http://127.0.0.1:PORT".
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (pid_ > 0 && port_ == 0 && std::chrono::steady_clock::now() < until) {
      pollfd pfd{out_, POLLIN, 0};
      if (poll(&pfd, 1, 100) <= 0) continue;
      char buf[1024];
      const ssize_t n = read(out_, buf, sizeof buf);
      if (n <= 0) break;
      text_.append(buf, static_cast<size_t>(n));
      const std::string key = "listening on http://127.0.0.1:";
      const size_t at = text_.find(key);
      if (at != std::string::npos && text_.find(' ', at + key.size()) != std::string::npos)
        port_ = std::atoi(text_.c_str() + at + key.size());
    }
  }
  ~ServeProcess() {
    if (pid_ > 0 && status_ < 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }
  int port() const { return port_; }
  const std::string& output() const { return text_; }
  // Sends `sig` and waits (at most 30 s) for the exit status; -1 if it did not exit.
  int stop(int sig) {
    kill(pid_, sig);
    for (int i = 0; i < 3000; ++i) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1, port_ = 0, status_ = -1;
  std::string text_;
};

TEST(ServeCli13, GreedyEqualsGenerate) {
  ServeProcess s;
  ASSERT_GT(s.port(), 0) << "no 'listening on' line: " << s.output();
  struct Case {
    std::string flags, path;
    json body;
  };
  const std::string text = "The capital of Portugal is", ask = "Give me one tip for baking bread.";
  const std::vector<Case> cases = {
      {"--prompt " + q(text), "/v1/completions", {{"prompt", text}}},
      {"--prompt " + q(text) + " --ignore-eos", "/v1/completions", {{"prompt", text}, {"ignore_eos", true}}},
      {"--chat --prompt " + q(ask),
       "/v1/chat/completions",
       {{"messages", {{{"role", "user"}, {"content", ask}}}}}},
  };
  for (const Case& c : cases) {
    const Ran g = run(bin() + " generate --model " + q(model_dir()) +
                      " --device cpu --output json --max-tokens 24 " + c.flags);
    ASSERT_EQ(g.status, 0) << c.flags;
    const json want = json::parse(g.out);
    json body = c.body;
    body.update(
        {{"model", "tiny-llama3"}, {"max_tokens", 24}, {"temperature", 0}, {"return_token_ids", true}});
    const Reply r = post(s.port(), c.path, body);
    ASSERT_EQ(r.status, 200) << r.body;
    const json& choice = r.j["choices"][0];
    EXPECT_EQ(choice["prompt_token_ids"], want["prompt_ids"]) << c.flags;
    EXPECT_EQ(choice["token_ids"], want["ids"]) << c.flags;
    EXPECT_EQ(choice.contains("text") ? choice["text"] : choice["message"]["content"], want["text"])
        << c.flags;
    EXPECT_EQ(choice["finish_reason"], want["finish_reason"]) << c.flags;
    // Streamed: the same text.
    json sb = c.body;
    sb.update({{"model", "tiny-llama3"}, {"max_tokens", 24}, {"temperature", 0}});
    const Stream st = post_stream(s.port(), c.path, sb);
    EXPECT_EQ(st.text(), want["text"].get<std::string>()) << c.flags;
  }
  EXPECT_EQ(s.stop(SIGTERM), 0);
}

// --batch-invariant (lesson 11, section 11): the server says so on its first line, and a request answered while
// others are in flight equals `generate --batch-invariant` on the same prompt. This server also runs the
// synchronous engine (--no-async-scheduling), whose first line then names no async scheduling.
TEST(ServeCli13, BatchInvariantServeEqualsBatchInvariantGenerate) {
  ServeProcess s({"--batch-invariant", "--no-async-scheduling"});
  ASSERT_GT(s.port(), 0) << "no 'listening on' line: " << s.output();
  EXPECT_NE(s.output().find("; batch-invariant"), std::string::npos) << s.output();
  EXPECT_EQ(s.output().find("async scheduling"), std::string::npos) << s.output();
  const std::string text = "The capital of Portugal is";
  const Ran g = run(bin() + " generate --model " + q(model_dir()) + " --device cpu --output json --max-tokens 24 " +
                    "--batch-invariant --prompt " + q(text));
  ASSERT_EQ(g.status, 0) << g.out;
  const json want = json::parse(g.out);
  // Four at once: the same prompt, and three others beside it.
  std::vector<std::thread> others;
  for (const char* other : {"Give me one tip", "The capital of France", "Once upon a time"})
    others.emplace_back([&s, other] {
      post(s.port(), "/v1/completions", {{"model", "tiny-llama3"}, {"prompt", other}, {"max_tokens", 24}});
    });
  const Reply r = post(s.port(), "/v1/completions",
                       {{"model", "tiny-llama3"}, {"prompt", text}, {"max_tokens", 24}, {"temperature", 0},
                        {"return_token_ids", true}});
  for (std::thread& t : others) t.join();
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["token_ids"], want["ids"]);
  EXPECT_EQ(r.j["choices"][0]["text"], want["text"]);
  EXPECT_EQ(s.stop(SIGTERM), 0);
}

// Async scheduling (lesson 14, section 3; serve's default): the server says so on its first line; a greedy request answered
// while others are in flight, whole and streamed, equals `generate` (the CPU path gives every request its alone
// bits, Engine11's tests check it); and a stream whose client goes away mid-way does not stop the server.
TEST(ServeCli13, AsyncSchedulingServeEqualsGenerate) {
  ServeProcess s;  // the default
  ASSERT_GT(s.port(), 0) << "no 'listening on' line: " << s.output();
  EXPECT_NE(s.output().find("; async scheduling"), std::string::npos) << s.output();
  const std::string text = "The capital of Portugal is";
  const Ran g = run(bin() + " generate --model " + q(model_dir()) + " --device cpu --output json --max-tokens 24 " +
                    "--prompt " + q(text));
  ASSERT_EQ(g.status, 0) << g.out;
  const json want = json::parse(g.out);
  std::vector<std::thread> others;
  for (const char* other : {"Give me one tip", "The capital of France", "Once upon a time"})
    others.emplace_back([&s, other] {
      post(s.port(), "/v1/completions", {{"model", "tiny-llama3"}, {"prompt", other}, {"max_tokens", 40}});
    });
  const Reply r = post(s.port(), "/v1/completions",
                       {{"model", "tiny-llama3"}, {"prompt", text}, {"max_tokens", 24}, {"temperature", 0},
                        {"return_token_ids", true}});
  const Stream st = post_stream(s.port(), "/v1/completions",
                                {{"model", "tiny-llama3"}, {"prompt", text}, {"max_tokens", 24}, {"temperature", 0}});
  for (std::thread& t : others) t.join();
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["token_ids"], want["ids"]);
  EXPECT_EQ(r.j["choices"][0]["text"], want["text"]);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], want["finish_reason"]);
  EXPECT_EQ(r.j["usage"]["completion_tokens"], want["ids"].size());
  EXPECT_EQ(st.text(), want["text"].get<std::string>());
  EXPECT_EQ(s.stop(SIGTERM), 0);
}

TEST(ServeCli13, SigtermWithAStreamInFlightExitsZero) {
  ServeProcess s({"--shutdown-timeout", "0.2"});
  ASSERT_GT(s.port(), 0) << s.output();
  std::atomic<bool> started{false}, done{false};
  Stream st;
  std::thread t([&] {
    st =
        post_stream(s.port(), "/v1/completions",
                    {{"model", "tiny-llama3"}, {"prompt", "Once"}, {"max_tokens", 480}, {"ignore_eos", true}},
                    [&](const Stream&) {
                      started = true;
                      return true;
                    });
    done = true;
  });
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
       !started && !done && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!started) {
    t.join();
    FAIL() << "the request never streamed: " << st.status << " " << st.body;
  }
  EXPECT_EQ(s.stop(SIGTERM), 0);
  t.join();
  EXPECT_TRUE(st.done);
  ASSERT_NE(st.error_chunk(), nullptr) << "the stream should end with an error event";
  EXPECT_EQ((*st.error_chunk())["error"]["code"], "shutting_down");
  EXPECT_EQ(get(s.port(), "/health").status, 0);  // gone
}

// serve warms the engine up before it listens, and /metrics does not count it.
TEST(ServeCli13, WarmUpIsNotCounted) {
  ServeProcess s;
  ASSERT_GT(s.port(), 0) << s.output();
  const Reply m = get(s.port(), "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("\ntvllm_engine_steps_total 0\n"), std::string::npos) << m.body;
  EXPECT_NE(m.body.find("\ntvllm_kv_blocks_used 0\n"), std::string::npos) << m.body;
  EXPECT_NE(m.body.find("\ntvllm_prefix_cache_queries_total 0\n"), std::string::npos) << m.body;
  EXPECT_EQ(post(s.port(), "/v1/completions", {{"model", "tiny-llama3"}, {"prompt", "Hi"}, {"max_tokens", 2}})
                .status,
            200);
  EXPECT_EQ(s.stop(SIGTERM), 0);
}

// SIGTERM with clients that never finish (a request dripping a byte at a time, an idle keep-alive connection):
// the process still exits 0, within --shutdown-timeout and a few seconds.
TEST(ServeCli13, SigtermWithSlowClientsExits) {
  ServeProcess s({"--shutdown-timeout", "0.5", "--read-timeout", "600"});
  ASSERT_GT(s.port(), 0) << s.output();
  httplib::Client idle("127.0.0.1", s.port());
  idle.set_keep_alive(true);
  ASSERT_TRUE(idle.Get("/health"));
  std::atomic<bool> stop{false};
  std::thread drip([&] {
    httplib::Client c("127.0.0.1", s.port());
    c.set_read_timeout(60);
    c.set_write_timeout(60);
    // A body provider that sends a byte every 100 ms until the test ends.
    (void)c.Post(
        "/v1/completions", 1000000,
        [&](size_t offset, size_t, httplib::DataSink& sink) {
          if (stop || offset > 100000) return false;
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          return sink.write("x", 1);
        },
        "application/json");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.stop(SIGTERM), 0);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  stop = true;
  drip.join();
}

TEST(ServeCli13, BenchServe) {
  ServeProcess s;
  ASSERT_GT(s.port(), 0) << s.output();
  const Ran b = run(
      bin() + " bench serve --url http://127.0.0.1:" + std::to_string(s.port()) +
      " --concurrency 4 --num-requests 12 --max-tokens 6 --prompt-len 20 --duration-limit 60 --output json");
  ASSERT_EQ(b.status, 0) << b.out;
  const json j = json::parse(b.out);
  EXPECT_EQ(j["completed"], 12);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["model"], "tiny-llama3");
  EXPECT_EQ(j["output_tokens"], 12 * 6);
  EXPECT_EQ(j["prompt_tokens"], 12 * 20);
  EXPECT_GT(j["ttft_ms"]["p50"].get<double>(), 0.0);
  EXPECT_GE(j["ttft_ms"]["p99"].get<double>(), j["ttft_ms"]["p50"].get<double>());
  EXPECT_GT(j["tpot_ms"]["p50"].get<double>(), 0.0);
  EXPECT_GT(j["request_throughput"].get<double>(), 0.0);
  EXPECT_EQ(s.stop(SIGINT), 0);
  // Only loopback; a server that is not there is a clear error, not a hang.
  EXPECT_EQ(run(bin() + " bench serve --url http://192.168.1.1:8000 --num-requests 1").status, 2);
  EXPECT_EQ(
      run(bin() + " bench serve --url http://127.0.0.1:" + std::to_string(s.port()) + " --num-requests 1")
          .status,
      2);
}

// `tiny-vllm bench throughput` (lessons 11-12) on a small CPU workload: every request gets all its tokens, the
// JSON adds up, the same workload gives the same token counts in batch-invariant mode and with async scheduling,
// and bad flags exit 2.
TEST(ServeCli13, BenchThroughput) {
  const std::string base = bin() + " bench throughput --model " + q(model_dir()) +
                           " --device cpu --num-requests 8 --min-len 4 --max-len 12 --output json";
  int64_t output_tokens = -1;
  for (const char* mode : {"", " --batch-invariant", " --no-async-scheduling", " --async-scheduling"}) {
    const Ran b = run(base + mode);
    ASSERT_EQ(b.status, 0) << mode << "\n" << b.out;
    const json j = json::parse(b.out);
    EXPECT_EQ(j["requests"], 8);
    EXPECT_EQ(j["failed"], 0);
    EXPECT_EQ(j["batch_invariant"], std::string(mode) == " --batch-invariant");
    EXPECT_EQ(j["async_scheduling"], std::string(mode) != " --no-async-scheduling");  // on by default
    // The same workload, EOS ignored: the same tokens in every mode (async scheduling drops no real id).
    if (output_tokens < 0) output_tokens = j["output_tokens"].get<int64_t>();
    EXPECT_EQ(j["output_tokens"].get<int64_t>(), output_tokens) << mode;
    EXPECT_EQ(j["batching"], "continuous");
    EXPECT_GE(j["output_tokens"].get<int64_t>(), 8 * 4);  // EOS ignored: every request its whole length
    EXPECT_LE(j["output_tokens"].get<int64_t>(), 8 * 12);
    EXPECT_GT(j["output_tok_s"].get<double>(), 0.0);
    EXPECT_NEAR(j["total_tok_s"].get<double>() * j["seconds"].get<double>(),
                j["prompt_tokens"].get<double>() + j["output_tokens"].get<double>(), 1.0);
    // The host-time split of the steps: its parts add up to the steps' time, which fits in the run's.
    const json& t = j["step_seconds"];
    const double parts = t["prepare"].get<double>() + t["launch"].get<double>() + t["wait"].get<double>() +
                         t["other"].get<double>();
    EXPECT_GT(t["launch"].get<double>(), 0.0);  // on the CPU the forward pass itself runs in "launch"
    EXPECT_NEAR(parts, t["total"].get<double>(), 1e-6 + 1e-9 * t["total"].get<double>());
    EXPECT_LE(t["total"].get<double>(), j["seconds"].get<double>());
    // The warm-up ran before the timed run and is reported beside it, never inside "seconds".
    EXPECT_GE(j["warm_up_seconds"].get<double>(), 0.0);
  }
  EXPECT_EQ(run(base + " --kv nowhere").status, 2);
  EXPECT_EQ(run(base + " --async-scheduling=maybe").status, 2);  // a flag: true/false at most
  EXPECT_EQ(run(base + " --max-len 100000").status, 2);  // longer than the model's context
  // vLLM's flag names (as serve's); the old names still work, hidden from --help.
  for (const char* flags : {" --max-num-seqs 2 --max-num-batched-tokens 64 --gpu-memory-utilization 0.5",
                            " --max-sequences 2 --max-tokens-per-step 64 --kv-fraction 0.5"}) {
    const Ran b = run(base + flags);
    ASSERT_EQ(b.status, 0) << flags << "\n" << b.out;
    const json j = json::parse(b.out);
    EXPECT_EQ(j["requests"], 8);
    EXPECT_LE(j["peak_running"].get<int64_t>(), 2) << flags;  // the default would run all 8 at once
  }
  EXPECT_EQ(run(base + " --gpu-memory-utilization 2").status, 2);
  const Ran help = run(bin() + " bench throughput --help");
  EXPECT_NE(help.out.find("--max-num-seqs"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--max-num-batched-tokens"), std::string::npos);
  EXPECT_NE(help.out.find("--gpu-memory-utilization"), std::string::npos);
  EXPECT_EQ(help.out.find("--max-sequences"), std::string::npos) << help.out;
  EXPECT_EQ(help.out.find("--kv-fraction"), std::string::npos);
}

TEST(ServeCli13, BadUsage) {
  ServeProcess s;
  ASSERT_GT(s.port(), 0) << s.output();
  // The same port again: in use.
  // (timeout: a server that starts after all would otherwise run for ever; 124 fails the test instead)
  const std::string serve = "timeout 30 " + bin() + " serve --model ";
  EXPECT_EQ(run(serve + q(model_dir()) + " --device cpu --port " + std::to_string(s.port())).status, 2);
  EXPECT_EQ(run(serve + "/no/such/dir --device cpu --port 0").status, 2);
  EXPECT_EQ(run(serve + q(model_dir()) + " --port 70000").status, 2);
  EXPECT_EQ(s.stop(SIGTERM), 0);
}

}  // namespace
}  // namespace tvllm
