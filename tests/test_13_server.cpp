// Lesson 13 over real HTTP on loopback: OpenAiServer started in this process on an ephemeral port, the engine of
// lessons 11-12 behind it on the CPU (the bundled model), and cpp-httplib's client in front of it.
//
// Every test ends with the engine idle and every KV block free (TearDown), whatever the test did to it:
// finished, stopped, rejected, disconnected or shut-down requests alike.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "chat_template.h"
#include "engine_check.h"
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

constexpr int64_t kContext = 512;
const char* const kModel = "tiny-llama3";

// An engine and a server in front of it.
struct Harness {
  explicit Harness(ServerConfig sc = {}, int64_t max_sequences = 16, bool paged = true) {
    EngineConfig ec;
    ec.max_sequences = max_sequences;
    ec.max_tokens_per_step = 256;
    ec.max_context = kContext;
    engine = std::make_unique<Engine>(model().weights, ec, paged ? paged_kv() : contiguous_kv());
    sc.port = 0;
    if (sc.model_name.empty()) sc.model_name = kModel;
    server = std::make_unique<OpenAiServer>(*engine, &model().tok, model().chat, sc);
    port = server->start();
  }
  ~Harness() {
    server.reset();  // shuts down first: the engine thread stops before the engine goes
    engine.reset();
  }
  // Waits until nothing is in flight and every KV block is free; false after 20 s.
  bool settle() {
    const auto until = Clock::now() + std::chrono::seconds(20);
    for (;;) {
      const EngineStats s = engine->stats();
      const ServerStats v = server->stats();
      if (v.in_flight == 0 && v.active_handlers == 0 && s.pending + s.waiting + s.running == 0 &&
          s.kv.free_blocks == s.kv.total_blocks)
        return true;
      if (Clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  std::unique_ptr<Engine> engine;
  std::unique_ptr<OpenAiServer> server;
  int port = 0;
};

json completion(const json& prompt, int64_t max_tokens, json extra = json::object()) {
  json b = {{"model", kModel}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
  b.update(extra);
  return b;
}

json chat_body(const std::string& user, int64_t max_tokens) {
  return {{"model", kModel},
          {"messages", json::array({{{"role", "system"}, {"content", "Be brief."}},
                                    {{"role", "user"}, {"content", user}}})},
          {"max_completion_tokens", max_tokens},
          {"temperature", 0}};
}

// Prompt ids in the ordinary part of the bundled vocabulary (specials start at 744).
std::vector<int32_t> ids_prompt(int n, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  uint64_t x = seed * 2654435761u + 17;
  for (int32_t& id : ids) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>(1 + (x >> 33) % 700);
  }
  return ids;
}

class Server13 : public ::testing::Test {
 protected:
  void SetUp() override { h = std::make_unique<Harness>(); }
  void TearDown() override {
    if (h) {
      EXPECT_TRUE(h->settle()) << "requests left in flight or KV blocks held at the end";
    }
  }
  std::unique_ptr<Harness> h;
};

// ---- endpoints --------------------------------------------------------------------------------------------------

// chat_template_kwargs {"enable_thinking": false} reaches the template: a server whose chat template is Qwen3's
// (the fixture's real one, on the bundled weights and tokenizer) renders the empty think block into the prompt,
// exactly as the library does; without the field the template's default (thinking on) holds.
TEST(Server13Thinking, ChatTemplateKwargsReachTheTemplate) {
  const std::optional<ChatTemplate> qwen3 =
      ChatTemplate::from_model_dir(std::filesystem::path(TVLLM_TEST_DATA_DIR) / "chat_templates" / "qwen3");
  ASSERT_TRUE(qwen3 && qwen3->has_thinking_switch());
  EngineConfig ec;
  ec.max_context = kContext;
  Engine engine(model().weights, ec, paged_kv());
  ServerConfig sc;
  sc.port = 0;
  sc.model_name = kModel;
  OpenAiServer server(engine, &model().tok, qwen3, sc);
  const int port = server.start();
  const std::vector<ChatMessage> messages = {{"user", "Hi"}};
  json body = {{"model", kModel},
               {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
               {"max_tokens", 2},
               {"temperature", 0},
               {"return_token_ids", true}};
  for (const bool thinking : {true, false}) {
    if (!thinking) body["chat_template_kwargs"] = {{"enable_thinking", false}};
    const Reply r = post(port, "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.j["choices"][0]["prompt_token_ids"].get<std::vector<int32_t>>(),
              model().tok.encode(qwen3->render(messages, true, {}, thinking), false))
        << "enable_thinking " << thinking;
  }
  body["chat_template_kwargs"] = {{"enable_thinking", "false"}};
  const Reply bad = post(port, "/v1/chat/completions", body);
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.j["error"]["param"], "chat_template_kwargs.enable_thinking") << bad.body;
}

TEST_F(Server13, Endpoints) {
  const Reply health = get(h->port, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.j["status"], "ok");

  const Reply models = get(h->port, "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.j["object"], "list");
  ASSERT_EQ(models.j["data"].size(), 1u);
  EXPECT_EQ(models.j["data"][0]["id"], kModel);
  EXPECT_EQ(models.j["data"][0]["object"], "model");
  EXPECT_EQ(models.j["data"][0]["max_model_len"], kContext);
  EXPECT_EQ(get(h->port, std::string("/v1/models/") + kModel).j["id"], kModel);
  EXPECT_EQ(get(h->port, "/v1/models/other").status, 404);

  const Reply c = post(h->port, "/v1/completions", completion("The capital of Portugal is", 8));
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(c.j["object"], "text_completion");
  EXPECT_EQ(c.j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(c.j["model"], kModel);
  EXPECT_GT(c.j["created"].get<int64_t>(), 1600000000);
  EXPECT_TRUE(c.j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(c.j["choices"][0]["index"], 0);
  const std::string reason = c.j["choices"][0]["finish_reason"];
  EXPECT_TRUE(reason == "stop" || reason == "length");
  EXPECT_EQ(c.j["usage"]["prompt_tokens"], model().tok.encode("The capital of Portugal is", true).size());
  EXPECT_EQ(c.j["usage"]["total_tokens"],
            c.j["usage"]["prompt_tokens"].get<int>() + c.j["usage"]["completion_tokens"].get<int>());

  const Reply m = post(h->port, "/v1/chat/completions", chat_body("Give me one tip for baking bread.", 8));
  ASSERT_EQ(m.status, 200) << m.body;
  EXPECT_EQ(m.j["object"], "chat.completion");
  EXPECT_EQ(m.j["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(m.j["choices"][0]["message"]["content"].is_string());

  const Reply metrics = get(h->port, "/metrics");
  ASSERT_EQ(metrics.status, 200);
  for (const char* line :
       {"# TYPE tvllm_time_to_first_token_seconds histogram",
        "tvllm_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2",
        "# TYPE tvllm_time_per_output_token_seconds histogram", "tvllm_kv_blocks_free ",
        "tvllm_kv_blocks_used ", "tvllm_num_requests_waiting ", "tvllm_num_requests_running ",
        "tvllm_prefix_cache_hits_total ", "tvllm_generation_tokens_total "})
    EXPECT_NE(metrics.body.find(line), std::string::npos) << line;
}

// ---- correctness --------------------------------------------------------------------------------------------------

// Greedy server output == lesson 10's Generator running the same prompt alone (what `tiny-vllm generate` runs;
// test_13_server_cli.cpp compares with the command itself).
TEST_F(Server13, GreedyEqualsGeneratorAlone) {
  const std::string text = "The capital of Portugal is";
  const std::vector<int32_t> prompt = model().tok.encode(text, true);
  for (const json& p : {json(text), json(prompt)}) {  // a text prompt and the same as ids
    const Reply r = post(h->port, "/v1/completions",
                         completion(p, 20, {{"return_token_ids", true}, {"ignore_eos", true}}));
    ASSERT_EQ(r.status, 200) << r.body;
    CheckRequest q;
    q.prompt = prompt;
    q.params.sampling.temperature = 0;
    q.params.max_tokens = 20;
    q.params.ignore_eos = true;
    const AloneResults alone = run_alone(model().weights, {q}, kContext);
    EXPECT_EQ(r.j["choices"][0]["prompt_token_ids"].get<std::vector<int32_t>>(), prompt);
    EXPECT_EQ(r.j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), alone.ids[0]);
    EXPECT_EQ(r.j["choices"][0]["text"], model().tok.decode(alone.ids[0], true));
    EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(r.j["usage"]["completion_tokens"], 20);
  }
}

TEST_F(Server13, StreamingEqualsNonStreaming) {
  for (const int64_t n : {1, 5, 40}) {
    const json body = completion("Once upon a time", n, {{"ignore_eos", n == 40}});
    const Reply whole = post(h->port, "/v1/completions", body);
    ASSERT_EQ(whole.status, 200) << whole.body;
    const Stream s = post_stream(h->port, "/v1/completions", body);
    ASSERT_EQ(s.status, 200) << s.error;
    EXPECT_TRUE(s.done);
    EXPECT_FALSE(s.bad_framing);
    EXPECT_EQ(json(s.text()), whole.j["choices"][0]["text"]) << n;
    EXPECT_EQ(json(s.finish_reason()), whole.j["choices"][0]["finish_reason"]);
    EXPECT_EQ(s.usage_chunk(), nullptr);  // only with stream_options.include_usage
    for (const json& c : s.chunks) {
      EXPECT_EQ(c["object"], "text_completion");
      EXPECT_EQ(c["id"], s.chunks[0]["id"]);  // one id for the whole stream
      EXPECT_FALSE(c.contains("usage"));
    }
    // Only the last chunk carries a finish_reason.
    for (size_t i = 0; i + 1 < s.chunks.size(); ++i)
      EXPECT_TRUE(s.chunks[i]["choices"][0]["finish_reason"].is_null());
  }
}

TEST_F(Server13, ChatStreaming) {
  const json body = chat_body("Give me one tip for baking bread.", 24);
  const Reply whole = post(h->port, "/v1/chat/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  json sb = body;
  sb["stream_options"] = {{"include_usage", true}};
  const Stream s = post_stream(h->port, "/v1/chat/completions", sb);
  ASSERT_EQ(s.status, 200);
  ASSERT_GE(s.chunks.size(), 3u);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.chunks[0]["choices"][0]["delta"]["role"], "assistant");  // the role comes first
  EXPECT_EQ(s.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(json(s.text()), whole.j["choices"][0]["message"]["content"]);
  EXPECT_EQ(json(s.finish_reason()), whole.j["choices"][0]["finish_reason"]);
  // include_usage: every chunk has "usage": null but the last, which has no choices and the usage.
  const json& last = s.chunks.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"], whole.j["usage"]);
  for (size_t i = 0; i + 1 < s.chunks.size(); ++i) EXPECT_TRUE(s.chunks[i]["usage"].is_null());
  EXPECT_EQ(s.chunks[s.chunks.size() - 2]["choices"][0]["delta"],
            json::object());  // the finish chunk: delta {}
}

TEST_F(Server13, StopStrings) {
  const json base = completion("Once upon a time", 40, {{"ignore_eos", true}});
  const Reply full = post(h->port, "/v1/completions", base);
  ASSERT_EQ(full.status, 200);
  const std::string text = full.j["choices"][0]["text"];
  ASSERT_GE(text.size(), 12u) << text;
  const std::string stop = text.substr(text.size() / 2, 3);
  const std::string expected = text.substr(0, text.find(stop));
  json b = base;
  b["stop"] = json::array({"this never appears", stop});
  const Reply cut = post(h->port, "/v1/completions", b);
  ASSERT_EQ(cut.status, 200);
  EXPECT_EQ(cut.j["choices"][0]["text"], expected);
  EXPECT_EQ(cut.j["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(cut.j["usage"]["completion_tokens"].get<int>(), 40);
  const Stream s = post_stream(h->port, "/v1/completions", b);
  EXPECT_EQ(s.text(), expected);
  EXPECT_EQ(s.finish_reason(), "stop");
  EXPECT_TRUE(s.done);
  // A stop string that never appears changes nothing.
  json n = base;
  n["stop"] = "this never appears";
  EXPECT_EQ(post(h->port, "/v1/completions", n).j["choices"][0]["text"], text);
}

// 12 requests of different prompts and lengths at once == each one alone (sequentially, one at a time).
TEST_F(Server13, ConcurrentEqualsSolo) {
  constexpr int kN = 12;
  std::vector<json> bodies;
  for (int i = 0; i < kN; ++i)
    bodies.push_back(completion(ids_prompt(5 + 7 * i, i), 4 + 3 * i, {{"ignore_eos", i % 2 == 0}}));
  std::vector<std::string> solo(kN), together(kN);
  for (int i = 0; i < kN; ++i) {
    const Reply r = post(h->port, "/v1/completions", bodies[static_cast<size_t>(i)]);
    ASSERT_EQ(r.status, 200) << r.body;
    solo[static_cast<size_t>(i)] = r.j.dump();
  }
  std::vector<std::thread> threads;
  std::vector<Reply> replies(kN);
  for (int i = 0; i < kN; ++i)
    threads.emplace_back([&, i] {
      replies[static_cast<size_t>(i)] =
          i % 3 == 0 ? Reply{} : post(h->port, "/v1/completions", bodies[static_cast<size_t>(i)]);
      if (i % 3 == 0) {  // a third of them streamed
        const Stream s = post_stream(h->port, "/v1/completions", bodies[static_cast<size_t>(i)]);
        replies[static_cast<size_t>(i)].status = s.status;
        replies[static_cast<size_t>(i)].j = {{"text", s.text()}, {"finish_reason", s.finish_reason()}};
      }
    });
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kN; ++i) {
    const json alone = json::parse(solo[static_cast<size_t>(i)]);
    const Reply& r = replies[static_cast<size_t>(i)];
    ASSERT_EQ(r.status, 200) << i;
    if (i % 3 == 0) {
      EXPECT_EQ(r.j["text"], alone["choices"][0]["text"]) << i;
      EXPECT_EQ(r.j["finish_reason"], alone["choices"][0]["finish_reason"]) << i;
    } else {
      EXPECT_EQ(r.j["choices"][0]["text"], alone["choices"][0]["text"]) << i;
      EXPECT_EQ(r.j["choices"][0]["finish_reason"], alone["choices"][0]["finish_reason"]) << i;
      EXPECT_EQ(r.j["usage"], alone["usage"]) << i;
    }
  }
}

// ---- load ---------------------------------------------------------------------------------------------------------

// 64 streams at once (more than the engine's 16 sequences: the rest wait their turn), bounded in time.
TEST_F(Server13, SixtyFourConcurrentStreams) {
  constexpr int kN = 64;
  const auto start = Clock::now();
  std::vector<Stream> streams(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i)
    threads.emplace_back([&, i] {
      json b = completion(ids_prompt(8 + i % 9, 100 + i), 8,
                          {{"ignore_eos", true}, {"stream_options", {{"include_usage", true}}}});
      streams[static_cast<size_t>(i)] = post_stream(h->port, "/v1/completions", b);
    });
  for (std::thread& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  int ok = 0;
  for (const Stream& s : streams) {
    const json* u = s.usage_chunk();
    const bool good =
        s.status == 200 && s.done && !s.bad_framing && u && (*u)["usage"]["completion_tokens"] == 8;
    ok += good;
    if (!good && ok + 3 > 0)
      ADD_FAILURE() << "HTTP " << s.status << " " << s.error << ": " << s.body.substr(0, 200);
  }
  EXPECT_EQ(ok, kN);
  EXPECT_LT(seconds, 30.0);
  EXPECT_EQ(h->server->stats().finished_length, kN);
  EXPECT_GE(h->engine->stats().peak_running, 2);  // they really ran together
}

// ---- bad requests -------------------------------------------------------------------------------------------------

struct BadCase {
  const char* name;
  const char* method;
  std::string path, body;
  int status;
  const char* type;
  const char* code;  // "" : not checked
};

TEST_F(Server13, MalformedRequestSweep) {
  const std::string c = "/v1/completions", m = "/v1/chat/completions";
  const std::string ok = R"({"model":"tiny-llama3","prompt":"hi","max_tokens":2,)";
  const std::string too_long = json{{"model", kModel}, {"prompt", ids_prompt(kContext, 1)}}.dump();
  const std::vector<BadCase> cases = {
      {"malformed JSON", "POST", c, "{\"model\":", 400, "invalid_request_error", "invalid_json"},
      {"not an object", "POST", c, "[1]", 400, "invalid_request_error", "invalid_json"},
      {"empty body", "POST", c, "", 400, "invalid_request_error", "invalid_json"},
      {"invalid UTF-8", "POST", c, "{\"model\":\"tiny-llama3\",\"prompt\":\"\xff\xfe\"}", 400,
       "invalid_request_error", "invalid_json"},
      {"nested 50k deep", "POST", c, std::string(50000, '[') + std::string(50000, ']'), 400,
       "invalid_request_error", "invalid_json"},
      {"missing model", "POST", c, R"({"prompt":"hi"})", 400, "invalid_request_error",
       "missing_required_parameter"},
      {"unknown model", "POST", c, R"({"model":"gpt-4","prompt":"hi"})", 404, "invalid_request_error",
       "model_not_found"},
      {"unknown model (chat)", "POST", m, R"({"model":"gpt-4","messages":[{"role":"user","content":"x"}]})",
       404, "invalid_request_error", "model_not_found"},
      {"temperature type", "POST", c, ok + R"("temperature":"hot"})", 400, "invalid_request_error",
       "invalid_type"},
      {"temperature range", "POST", c, ok + R"("temperature":7})", 400, "invalid_request_error",
       "invalid_value"},
      {"top_p range", "POST", c, ok + R"("top_p":0})", 400, "invalid_request_error", "invalid_value"},
      {"top_k range", "POST", c, ok + R"("top_k":-5})", 400, "invalid_request_error", "invalid_value"},
      {"max_tokens 0", "POST", c, R"({"model":"tiny-llama3","prompt":"hi","max_tokens":0})", 400,
       "invalid_request_error", "invalid_value"},
      {"max_tokens string", "POST", c, R"({"model":"tiny-llama3","prompt":"hi","max_tokens":"5"})", 400,
       "invalid_request_error", "invalid_type"},
      {"n = 2", "POST", c, ok + R"("n":2})", 400, "invalid_request_error", "invalid_value"},
      {"five stops", "POST", c, ok + R"("stop":["a","b","c","d","e"]})", 400, "invalid_request_error",
       "invalid_value"},
      {"several prompts", "POST", c, R"({"model":"tiny-llama3","prompt":["a","b"]})", 400,
       "invalid_request_error", "invalid_value"},
      {"empty ids", "POST", c, R"({"model":"tiny-llama3","prompt":[]})", 400, "invalid_request_error",
       "invalid_value"},
      {"id past vocab", "POST", c, R"({"model":"tiny-llama3","prompt":[1,2,1000]})", 400,
       "invalid_request_error", "invalid_value"},
      {"negative id", "POST", c, R"({"model":"tiny-llama3","prompt":[-1]})", 400, "invalid_request_error",
       "invalid_value"},
      {"huge id", "POST", c, R"({"model":"tiny-llama3","prompt":[18446744073709551615]})", 400,
       "invalid_request_error", "invalid_value"},
      {"float id", "POST", c, R"({"model":"tiny-llama3","prompt":[1.0]})", 400, "invalid_request_error",
       "invalid_type"},
      {"prompt + max_tokens > context", "POST", c,
       R"({"model":"tiny-llama3","prompt":"hi","max_tokens":600})", 400, "invalid_request_error",
       "context_length_exceeded"},
      {"prompt >= context", "POST", c, too_long, 400, "invalid_request_error", "context_length_exceeded"},
      {"stream_options alone", "POST", c, ok + R"("stream_options":{"include_usage":true}})", 400,
       "invalid_request_error", "invalid_value"},
      {"logprobs", "POST", c, ok + R"("logprobs":1})", 400, "invalid_request_error", "unsupported_parameter"},
      {"no messages", "POST", m, R"({"model":"tiny-llama3"})", 400, "invalid_request_error",
       "missing_required_parameter"},
      {"role tool", "POST", m, R"({"model":"tiny-llama3","messages":[{"role":"tool","content":"x"}]})", 400,
       "invalid_request_error", "invalid_value"},
      {"image part", "POST", m,
       R"({"model":"tiny-llama3","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})",
       400, "invalid_request_error", "unsupported_parameter"},
      {"content number", "POST", m, R"({"model":"tiny-llama3","messages":[{"role":"user","content":5}]})",
       400, "invalid_request_error", "invalid_type"},
      {"unknown path", "POST", "/v1/engines", "{}", 404, "invalid_request_error", "unknown_url"},
      {"unknown GET path", "GET", "/v2/models", "", 404, "invalid_request_error", "unknown_url"},
      {"GET a POST path", "GET", c, "", 405, "invalid_request_error", "method_not_allowed"},
      {"DELETE models", "DELETE", "/v1/models", "", 405, "invalid_request_error", "method_not_allowed"},
      {"PUT chat", "PUT", m, "{}", 405, "invalid_request_error", "method_not_allowed"},
      {"body over 1 MiB", "POST", c, std::string((1 << 20) + 100, ' '), 413, "invalid_request_error",
       "request_too_large"},
  };
  for (const BadCase& bc : cases) {
    httplib::Client cli = client(h->port);
    const std::string method = bc.method;
    const Reply reply = to_reply(method == "POST"  ? cli.Post(bc.path, bc.body, "application/json")
                                 : method == "GET" ? cli.Get(bc.path)
                                 : method == "PUT" ? cli.Put(bc.path, bc.body, "application/json")
                                                   : cli.Delete(bc.path));
    EXPECT_EQ(reply.status, bc.status) << bc.name << ": " << reply.body.substr(0, 300) << reply.error;
    ASSERT_FALSE(reply.j.is_discarded()) << bc.name << ": not JSON: " << reply.body.substr(0, 300);
    ASSERT_TRUE(reply.j.contains("error")) << bc.name;
    const json& e = reply.j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << bc.name;
    EXPECT_EQ(e["type"], bc.type) << bc.name;
    EXPECT_TRUE(e.contains("param") && e.contains("code")) << bc.name;
    if (*bc.code) {
      EXPECT_EQ(e["code"], bc.code) << bc.name;
    }
    EXPECT_EQ(get(h->port, "/health").status, 200) << "unhealthy after: " << bc.name;
  }
  // Still serving properly afterwards, and every refusal counted.
  EXPECT_EQ(post(h->port, "/v1/completions", completion("hi", 2)).status, 200);
  int bad_requests = 0;
  for (const BadCase& bc : cases) bad_requests += bc.status == 400;
  EXPECT_EQ(h->server->metrics().rejected(400), bad_requests);
  EXPECT_EQ(h->engine->stats().requests_submitted, 1);  // none of the bad ones reached the engine
}

TEST(Server13Auth, BearerKey) {
  ServerConfig sc;
  sc.api_key = "sk-test";
  Harness h(sc);
  const json body = completion("hi", 2);
  const Reply none = post(h.port, "/v1/completions", body);
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.j["error"]["code"], "invalid_api_key");
  EXPECT_EQ(none.j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(post(h.port, "/v1/completions", body, {{"Authorization", "Bearer sk-wrong"}}).status, 401);
  EXPECT_EQ(get(h.port, "/v1/models").status, 401);
  EXPECT_EQ(post(h.port, "/v1/completions", body, {{"Authorization", "Bearer sk-test"}}).status, 200);
  EXPECT_EQ(get(h.port, "/v1/models", {{"Authorization", "Bearer sk-test"}}).status, 200);
  EXPECT_EQ(get(h.port, "/health").status, 200);  // probes need no key
  EXPECT_TRUE(h.settle());
}

// A full queue answers 429 at once. One sequence at a time, at most 2 waiting: A runs, B and C wait, D is refused.
TEST(Server13Backpressure, FullQueueIs429) {
  ServerConfig sc;
  sc.max_waiting = 2;
  Harness h(sc, /*max_sequences=*/1);
  std::atomic<bool> a_started{false}, a_done{false};
  std::thread a([&] {
    post_stream(h.port, "/v1/completions", completion("A", 300, {{"ignore_eos", true}}), [&](const Stream&) {
      a_started = true;
      return true;
    });
    a_done = true;
  });
  // Bounded: a server that refuses A (a stubbed exercise) must fail this test, not hang it.
  for (const auto until = Clock::now() + std::chrono::seconds(60); !a_started && !a_done && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!a_started) {
    a.join();
    FAIL() << "request A never streamed";
  }
  std::vector<std::thread> waiting;
  std::vector<Reply> bc(2);
  for (int i = 0; i < 2; ++i)
    waiting.emplace_back(
        [&, i] { bc[static_cast<size_t>(i)] = post(h.port, "/v1/completions", completion("B", 2)); });
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (h.server->stats().awaiting_first < 2 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(h.server->stats().awaiting_first, 2);
  const auto t0 = Clock::now();
  const Reply d = post(h.port, "/v1/completions", completion("D", 2));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);  // at once, not after the queue
  EXPECT_EQ(d.status, 429);
  EXPECT_EQ(d.j["error"]["type"], "rate_limit_error");
  EXPECT_EQ(d.j["error"]["code"], "queue_full");
  a.join();
  for (std::thread& t : waiting) t.join();
  for (const Reply& r : bc) EXPECT_EQ(r.status, 200);
  EXPECT_EQ(h.server->stats().rejected_429, 1);
  EXPECT_TRUE(h.settle());
}

// ---- disconnects and shutdown -------------------------------------------------------------------------------------

// A client that leaves mid-stream: its request is aborted, long before its 400 tokens, and its KV returns.
TEST_F(Server13, ClientDisconnectAbortsRequest) {
  const json body = completion(ids_prompt(40, 3), 400, {{"ignore_eos", true}});
  int events = 0;
  const Stream s = post_stream(h->port, "/v1/completions", body, [&](const Stream&) { return ++events < 3; });
  EXPECT_EQ(events, 3);
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (h->server->stats().aborted < 1 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(h->server->stats().aborted, 1);
  EXPECT_TRUE(h->settle());
  const EngineStats e = h->engine->stats();
  EXPECT_EQ(e.aborted, 1);
  EXPECT_LT(e.generated_tokens, 400);
  EXPECT_EQ(e.kv.free_blocks, e.kv.total_blocks);
  EXPECT_EQ(get(h->port, "/health").status, 200);
}

// shutdown(): a request in flight past the grace period is aborted (its stream ends with an error event), new
// requests are refused, and everything is returned.
TEST(Server13Shutdown, AbortsWhatOutlivesTheGrace) {
  Harness h;
  std::atomic<bool> started{false}, done{false};
  Stream s;
  std::thread t([&] {
    s = post_stream(h.port, "/v1/completions", completion(ids_prompt(20, 9), 480, {{"ignore_eos", true}}),
                    [&](const Stream&) {
                      started = true;
                      return true;
                    });
    done = true;
  });
  for (const auto until = Clock::now() + std::chrono::seconds(60); !started && !done && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!started) {
    t.join();
    FAIL() << "the request never streamed: " << s.status << " " << s.body;
  }
  EXPECT_EQ(h.server->shutdown(std::chrono::milliseconds(50)), 1);
  t.join();
  EXPECT_EQ(s.status, 200);
  ASSERT_NE(s.error_chunk(), nullptr);
  EXPECT_EQ((*s.error_chunk())["error"]["code"], "shutting_down");
  EXPECT_TRUE(s.done);
  EXPECT_EQ(get(h.port, "/health").status, 0);  // no longer listening
  const EngineStats e = h.engine->stats();
  EXPECT_EQ(e.aborted, 1);
  EXPECT_EQ(e.kv.free_blocks, e.kv.total_blocks);
}

TEST(Server13Shutdown, LetsShortRequestsFinish) {
  Harness h;
  Reply r;
  std::thread t([&] {
    r = post(h.port, "/v1/completions", completion(ids_prompt(20, 9), 60, {{"ignore_eos", true}}));
  });
  while (h.server->stats().in_flight == 0 && r.status == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(h.server->shutdown(std::chrono::seconds(20)), 0);
  t.join();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.j["usage"]["completion_tokens"], 60);
}

// A model directory without tokenizer.json (random weights for a benchmark): token ids in, token ids out.
TEST(Server13NoTokenizer, IdsInIdsOut) {
  EngineConfig ec;
  ec.max_sequences = 4;
  ec.max_tokens_per_step = 64;
  ec.max_context = kContext;
  Engine engine(model().weights, ec, paged_kv());
  ServerConfig sc;
  sc.port = 0;
  sc.model_name = kModel;
  OpenAiServer srv(engine, nullptr, std::nullopt, sc);
  const int port = srv.start();
  const std::vector<int32_t> prompt = ids_prompt(10, 4);
  const Reply r = post(port, "/v1/completions", completion(prompt, 5, {{"ignore_eos", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["text"], "");
  EXPECT_EQ(r.j["choices"][0]["token_ids"].size(), 5u);
  EXPECT_EQ(r.j["choices"][0]["prompt_token_ids"], prompt);
  const Stream s = post_stream(port, "/v1/completions", completion(prompt, 5, {{"ignore_eos", true}}));
  std::vector<int32_t> streamed;
  for (const json& c : s.chunks)
    if (c["choices"][0].contains("token_ids"))
      for (const json& id : c["choices"][0]["token_ids"]) streamed.push_back(id.get<int32_t>());
  EXPECT_EQ(json(streamed), r.j["choices"][0]["token_ids"]);  // one chunk per id, the same ids
  EXPECT_EQ(post(port, "/v1/completions", completion("text", 2)).j["error"]["code"], "no_tokenizer");
  EXPECT_EQ(post(port, "/v1/chat/completions", chat_body("hi", 2)).j["error"]["code"], "no_tokenizer");
  srv.shutdown(std::chrono::seconds(5));
}

// Lesson 11's contiguous cache behind the server works the same.
TEST(Server13Contiguous, SameAnswers) {
  Harness paged;
  Harness contiguous(ServerConfig{}, 16, /*paged=*/false);
  const json body = completion("The capital of Portugal is", 12, {{"ignore_eos", true}});
  EXPECT_EQ(post(paged.port, "/v1/completions", body).j["choices"][0]["text"],
            post(contiguous.port, "/v1/completions", body).j["choices"][0]["text"]);
  EXPECT_TRUE(contiguous.settle());
  EXPECT_TRUE(paged.settle());
}

}  // namespace
}  // namespace tvllm::server
