// The serving benchmark (bench_serve.h).
#include "bench_serve.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "common/input_error.h"
#include "common/random.h"

namespace tvllm::server {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

bool is_loopback_host(const std::string& h) {
  if (h == "localhost" || h == "::1") return true;
  // 127.0.0.0/8, as a dotted quad of numbers
  unsigned a = 0, b = 0, c = 0, d = 0;
  char tail = 0;
  if (std::sscanf(h.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4)
    return a == 127 && b < 256 && c < 256 && d < 256;
  return false;
}

// What one request measured.
struct Sample {
  bool ok = false;
  std::string error;
  double ttft_ms = -1, e2e_ms = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
};

// Reads an SSE stream as it arrives: events are separated by a blank line; "data: " lines carry the JSON.
struct SseReader {
  std::string buffer, body;  // body: everything, for an error status
  bool done = false;
  std::string error;
  Clock::time_point start, first_text, last_event;
  bool got_text = false;
  int64_t completion_tokens = -1, prompt_tokens = 0;

  void feed(const char* data, size_t n) {
    buffer.append(data, n);
    if (body.size() < 4096) body.append(data, std::min(n, 4096 - body.size()));
    for (size_t pos; (pos = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, pos);
      buffer.erase(0, pos + 2);
      if (event.rfind("data: ", 0) != 0) continue;  // a comment (": keep-alive") or another field
      on_data(event.substr(6));
    }
  }
  void on_data(const std::string& data) {
    const Clock::time_point now = Clock::now();
    if (data == "[DONE]") {
      done = true;
      last_event = now;
      return;
    }
    const Json j = Json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      error = "a chunk that is not JSON: " + data.substr(0, 200);
      return;
    }
    if (j.contains("error")) {
      error = j["error"].value("message", std::string("an error event"));
      return;
    }
    const auto choices = j.find("choices");
    if (choices != j.end() && choices->is_array() && !choices->empty()) {
      const Json& c = (*choices)[0];
      // A token arrived: text, or token ids (a model served without a tokenizer has no text).
      const bool text = c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty();
      const bool ids = c.contains("token_ids") && c["token_ids"].is_array() && !c["token_ids"].empty();
      if (text || ids) {
        if (!got_text) first_text = now;
        got_text = true;
      }
      last_event = now;
    }
    const auto usage = j.find("usage");
    if (usage != j.end() && usage->is_object()) {
      completion_tokens = usage->value("completion_tokens", int64_t{-1});
      prompt_tokens = usage->value("prompt_tokens", int64_t{0});
    }
  }
};

std::string model_of(httplib::Client& cli, const httplib::Headers& headers) {
  const httplib::Result r = cli.Get("/v1/models", headers);
  if (!r)
    throw InputError("bench serve: cannot reach the server (" + httplib::to_string(r.error()) +
                     "): start it first (tiny-vllm serve --model DIR)");
  if (r->status != 200)
    throw InputError("bench serve: GET /v1/models answered " + std::to_string(r->status) + ": " + r->body);
  const Json j = Json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
    throw InputError("bench serve: GET /v1/models did not list a model");
  return j["data"][0]["id"].get<std::string>();
}

}  // namespace

LoopbackUrl parse_loopback_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0)
    throw InputError("--url must start with http:// (the server speaks plain HTTP on loopback), got '" + url +
                     "'");
  std::string rest = url.substr(scheme.size());
  for (const std::string suffix : {"/v1/", "/v1", "/"})
    if (rest.size() >= suffix.size() &&
        rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
      rest.erase(rest.size() - suffix.size());
      break;
    }
  LoopbackUrl u;
  std::string port;
  if (!rest.empty() && rest[0] == '[') {  // [::1]:8000
    const size_t close = rest.find(']');
    if (close == std::string::npos) throw InputError("--url: a '[' without ']' in '" + url + "'");
    u.host = rest.substr(1, close - 1);
    if (close + 1 < rest.size() && rest[close + 1] == ':') port = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    u.host = rest.substr(0, colon);
    if (colon != std::string::npos) port = rest.substr(colon + 1);
  }
  if (!is_loopback_host(u.host))
    throw InputError(
        "bench serve only talks to a server on this machine (127.0.0.1, ::1, localhost); got host '" +
        u.host + "'");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    throw InputError("--url needs a port: http://127.0.0.1:8000, got '" + url + "'");
  u.port = std::stoi(port);
  if (u.port < 1 || u.port > 65535) throw InputError("--url: port " + port + " is outside [1, 65535]");
  return u;
}

LatencySummary summarize(std::vector<double> v) {
  LatencySummary s;
  s.n = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  const auto pct = [&](double q) {
    const double pos = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
  };
  s.p50 = pct(0.50);
  s.p99 = pct(0.99);
  return s;
}

BenchServeResult run_bench_serve(const BenchServeOptions& o) {
  TVLLM_REQUIRE(o.concurrency >= 1 && o.concurrency <= 1024, "--concurrency must be in [1, 1024]");
  TVLLM_REQUIRE(o.num_requests >= 1 && o.num_requests <= 1000000, "--num-requests must be in [1, 1000000]");
  TVLLM_REQUIRE(o.max_tokens >= 1, "--max-tokens must be >= 1");
  TVLLM_REQUIRE(o.prompt_len >= 1, "--prompt-len must be >= 1");
  TVLLM_REQUIRE(o.duration_limit_s > 0 && o.duration_limit_s <= 86400,
                "--duration-limit must be in (0, 86400] seconds");
  TVLLM_REQUIRE(o.id_low >= 0 && o.id_low < o.id_high, "the prompt id range is empty");
  const LoopbackUrl url = parse_loopback_url(o.url);

  httplib::Headers headers;
  if (!o.api_key.empty()) headers.emplace("Authorization", "Bearer " + o.api_key);
  std::string model = o.model;
  {
    httplib::Client probe(url.host, url.port);
    probe.set_connection_timeout(5);
    probe.set_read_timeout(30);
    if (model.empty()) model = model_of(probe, headers);
  }

  // The prompts, drawn up front (a worker's timing should not include it).
  Rng rng(o.seed);
  std::vector<std::string> bodies;
  bodies.reserve(static_cast<size_t>(o.num_requests));
  for (int64_t i = 0; i < o.num_requests; ++i) {
    std::vector<int32_t> ids(static_cast<size_t>(o.prompt_len));
    for (int32_t& id : ids) id = o.id_low + static_cast<int32_t>(rng.below(o.id_high - o.id_low));
    Json body = {{"model", model},
                 {"prompt", ids},
                 {"max_tokens", o.max_tokens},
                 {"temperature", 0},
                 {"ignore_eos", true},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    bodies.push_back(body.dump());
  }

  std::atomic<int64_t> next{0};
  std::mutex mutex;
  std::vector<Sample> samples;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_limit_s));
  std::atomic<bool> limit_hit{false};

  const auto worker = [&] {
    httplib::Client cli(url.host, url.port);
    cli.set_keep_alive(true);
    cli.set_tcp_nodelay(true);  // the request's headers and body are two writes: send both at once (server.cpp)
    cli.set_connection_timeout(5);
    cli.set_read_timeout(static_cast<time_t>(o.duration_limit_s) + 5);
    for (;;) {
      const int64_t i = next++;
      if (i >= o.num_requests) return;
      if (Clock::now() >= deadline) {
        limit_hit = true;
        return;
      }
      SseReader sse;
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.headers = headers;
      req.set_header("Content-Type", "application/json");
      req.body = bodies[static_cast<size_t>(i)];
      req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        sse.feed(data, n);
        if (Clock::now() >= deadline) {  // cut off: the run is bounded in time
          limit_hit = true;
          return false;
        }
        return true;
      };
      sse.start = Clock::now();
      const httplib::Result r = cli.send(req);
      Sample s;
      if (!r) {
        s.error = "connection: " + httplib::to_string(r.error());
      } else if (r->status != 200) {
        s.error = "HTTP " + std::to_string(r->status) + ": " + sse.body.substr(0, 300);
      } else if (!sse.error.empty()) {
        s.error = sse.error;
      } else if (!sse.done || sse.completion_tokens < 1 || !sse.got_text) {
        s.error = "the stream ended without text, usage and [DONE]";
      } else {
        s.ok = true;
        s.ttft_ms = ms_between(sse.start, sse.first_text);
        s.e2e_ms = ms_between(sse.start, sse.last_event);
        s.output_tokens = sse.completion_tokens;
        s.prompt_tokens = sse.prompt_tokens;
      }
      std::lock_guard<std::mutex> lock(mutex);
      samples.push_back(std::move(s));
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < o.concurrency; ++w) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();

  BenchServeResult res;
  res.url = o.url;
  res.model = model;
  res.concurrency = o.concurrency;
  res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  res.duration_limit_hit = limit_hit;
  std::vector<double> ttft, tpot, e2e;
  for (const Sample& s : samples) {
    ++res.requests_sent;
    if (!s.ok) {
      ++res.failed;
      if (res.first_error.empty()) res.first_error = s.error;
      continue;
    }
    ++res.completed;
    res.output_tokens += s.output_tokens;
    res.prompt_tokens += s.prompt_tokens;
    ttft.push_back(s.ttft_ms);
    e2e.push_back(s.e2e_ms);
    if (s.output_tokens >= 2)
      tpot.push_back((s.e2e_ms - s.ttft_ms) / static_cast<double>(s.output_tokens - 1));
  }
  res.request_throughput = static_cast<double>(res.completed) / res.seconds;
  res.output_tok_s = static_cast<double>(res.output_tokens) / res.seconds;
  res.ttft_ms = summarize(ttft);
  res.tpot_ms = summarize(tpot);
  res.e2e_ms = summarize(e2e);
  return res;
}

nlohmann::ordered_json BenchServeResult::to_json() const {
  const auto lat = [](const LatencySummary& s) {
    return nlohmann::ordered_json{{"n", s.n}, {"mean", s.mean}, {"p50", s.p50}, {"p99", s.p99}};
  };
  nlohmann::ordered_json j;
  j["url"] = url;
  j["model"] = model;
  j["concurrency"] = concurrency;
  j["requests_sent"] = requests_sent;
  j["completed"] = completed;
  j["failed"] = failed;
  j["duration_s"] = seconds;
  j["duration_limit_hit"] = duration_limit_hit;
  j["request_throughput"] = request_throughput;
  j["output_tok_s"] = output_tok_s;
  j["prompt_tokens"] = prompt_tokens;
  j["output_tokens"] = output_tokens;
  j["ttft_ms"] = lat(ttft_ms);
  j["tpot_ms"] = lat(tpot_ms);
  j["e2e_ms"] = lat(e2e_ms);
  if (!first_error.empty()) j["first_error"] = first_error;
  return j;
}

std::string BenchServeResult::table() const {
  char line[256];
  std::string out;
  std::snprintf(line, sizeof line,
                "completed %lld/%lld requests in %.2f s%s: %.2f req/s, %.1f output tok/s\n",
                static_cast<long long>(completed), static_cast<long long>(requests_sent), seconds,
                duration_limit_hit ? " (duration limit hit)" : "", request_throughput, output_tok_s);
  out += line;
  std::snprintf(line, sizeof line, "%-10s %10s %10s %10s\n", "", "mean", "p50", "p99");
  out += line;
  for (const auto& [name, s] :
       {std::pair{"TTFT ms", &ttft_ms}, std::pair{"TPOT ms", &tpot_ms}, std::pair{"E2E ms", &e2e_ms}}) {
    std::snprintf(line, sizeof line, "%-10s %10.2f %10.2f %10.2f\n", name, s->mean, s->p50, s->p99);
    out += line;
  }
  if (failed > 0) out += "failed: " + std::to_string(failed) + " (first: " + first_error + ")\n";
  return out;
}

}  // namespace tvllm::server
