// lesson13_server: the engine behind an OpenAI-compatible HTTP server, checked over a real socket.
//
//   build/bin/lesson13_server [--model DIR] [--device auto|cpu|cuda]
//
// Starts OpenAiServer on an ephemeral loopback port (the engine of lessons 11-12 behind it), then talks to it as
// any client would, with cpp-httplib's client, and checks:
//   health, models          GET /health, GET /v1/models
//   completion == alone     POST /v1/completions, greedy: the ids (return_token_ids) equal lesson 10's Generator
//                           running the prompt alone (CPU: id for id; GPU: teacher-forced, lesson 11's rule);
//                           the text is their decoding
//   streaming == whole      the same request with "stream": true: the SSE chunks' text joined == the text
//   chat                    POST /v1/chat/completions, the same two checks on the chat-rendered prompt
//   stop strings            a stop string taken from the middle of the text: the text up to it, finish "stop",
//                           streaming and not
//   errors                  an unknown model: 404 with an OpenAI error body
//   KV returned             the engine idle, every KV block free
// and prints a PASS/FAIL table. Exit codes as every lesson: 0 PASS, 1 FAIL, 2 bad usage, 77 no GPU for cuda.
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "chat_template.h"
#include "common/lesson.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "model_dir.h"
#include "model_weights.h"
#include "server.h"
#include "tokenizer.h"

namespace tvllm {
namespace {

using nlohmann::json;

struct Row {
  std::string check, detail;
  bool pass = false;
};

// POST a JSON body; the parsed response, or {"http_error": ...}.
json post(httplib::Client& cli, const std::string& path, const json& body, int* status = nullptr) {
  const httplib::Result r = cli.Post(path, body.dump(), "application/json");
  if (!r) return json{{"http_error", httplib::to_string(r.error())}};
  if (status) *status = r->status;
  return json::parse(r->body, nullptr, false);
}

struct Streamed {
  int status = 0;
  std::string text, finish_reason;
  bool done = false;
};
// POST with "stream": true; joins the chunks' text (completions) or delta.content (chat).
Streamed post_stream(httplib::Client& cli, const std::string& path, json body) {
  body["stream"] = true;
  Streamed s;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    for (size_t pos; (pos = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, pos);
      buffer.erase(0, pos + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string data_text = event.substr(6);
      if (data_text == "[DONE]") {
        s.done = true;
        continue;
      }
      const json c = json::parse(data_text, nullptr, false);
      if (c.is_discarded() || !c.contains("choices") || c["choices"].empty()) continue;
      const json& ch = c["choices"][0];
      if (ch.contains("text")) s.text += ch["text"].get<std::string>();
      if (ch.contains("delta") && ch["delta"].contains("content"))
        s.text += ch["delta"]["content"].get<std::string>();
      if (!ch["finish_reason"].is_null()) s.finish_reason = ch["finish_reason"].get<std::string>();
    }
    return true;
  };
  const httplib::Result r = cli.send(req);
  if (r) s.status = r->status;
  return s;
}

std::string choice_text(const json& j) {
  const json& c = j["choices"][0];
  return c.contains("text") ? c["text"].get<std::string>() : c["message"]["content"].get<std::string>();
}

int run_lesson(const LessonOptions& opt) {
  const ModelDir model = ModelDir::open(opt.model_dir);
  const Tokenizer tok = Tokenizer::from_file(opt.model_dir / "tokenizer.json");
  std::optional<ChatTemplate> chat = ChatTemplate::from_model_dir(opt.model_dir);
  const ModelWeights weights = ModelWeights::bind(model, opt.device);
  EngineConfig ec;
  ec.max_sequences = 16;
  ec.max_tokens_per_step = 512;
  ec.max_context = std::min<int64_t>(1024, model.config.max_position_embeddings);
  Engine engine(weights, ec, paged_kv());
  server::ServerConfig sc;
  sc.port = 0;  // any free port
  sc.model_name = opt.model_dir.filename().string();
  server::OpenAiServer srv(engine, &tok, chat, sc);
  const int port = srv.start();
  std::printf("lesson13_server: %s on %s, serving \"%s\" at http://127.0.0.1:%d (KV: %s)\n\n",
              opt.model_dir.string().c_str(), std::string(device_name(opt.device)).c_str(),
              sc.model_name.c_str(), port, engine.kv().describe().c_str());
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120);

  std::vector<Row> rows;
  const auto add = [&](std::string check, bool pass, std::string detail) {
    rows.push_back(Row{std::move(check), std::move(detail), pass});
  };

  // 1. health and models
  {
    const httplib::Result h = cli.Get("/health");
    const httplib::Result m = cli.Get("/v1/models");
    const json mj = m ? json::parse(m->body, nullptr, false) : json();
    const bool ok = h && h->status == 200 && m && m->status == 200 && !mj.is_discarded() &&
                    mj["data"][0]["id"] == sc.model_name;
    add("GET /health, /v1/models", ok, ok ? "200, lists \"" + sc.model_name + "\"" : "unexpected answer");
  }

  // 2-5. completions and chat: the server's greedy ids against the Generator alone, then streaming == whole.
  const int64_t kMaxTokens = 24;
  struct Case {
    std::string name, path;
    json body;
    std::vector<int32_t> prompt;  // what the server should have tokenized
  };
  std::vector<Case> cases;
  {
    const std::string text = "The capital of Portugal is";
    cases.push_back(
        {"completion", "/v1/completions",
         json{{"model", sc.model_name}, {"prompt", text}, {"max_tokens", kMaxTokens}, {"temperature", 0}},
         tok.encode(text, true)});
  }
  if (chat) {
    const std::vector<ChatMessage> messages = {{"user", "Give me one tip for baking bread."}};
    cases.push_back({"chat", "/v1/chat/completions",
                     json{{"model", sc.model_name},
                          {"messages", json::array({{{"role", "user"}, {"content", messages[0].content}}})},
                          {"max_completion_tokens", kMaxTokens},
                          {"temperature", 0}},
                     tok.encode(chat->render(messages, true), false)});
  }
  std::vector<CheckRequest> requests;
  EngineRunResult run;
  std::vector<std::string> texts;
  for (Case& c : cases) {
    json body = c.body;
    body["return_token_ids"] = true;
    int status = 0;
    const json r = post(cli, c.path, body, &status);
    if (status != 200 || r.is_discarded() || !r.contains("choices")) {
      add(c.name + " == alone", false,
          "HTTP " + std::to_string(status) + ": " + (r.is_discarded() ? "" : r.dump()));
      texts.emplace_back();
      continue;
    }
    const json& choice = r["choices"][0];
    const auto ids = choice["token_ids"].get<std::vector<int32_t>>();
    const std::string reason = choice["finish_reason"];
    const bool prompt_ok = choice["prompt_token_ids"].get<std::vector<int32_t>>() == c.prompt;
    const bool text_ok = choice_text(r) == tok.decode(ids, true);
    const bool usage_ok =
        r["usage"]["prompt_tokens"] == c.prompt.size() && r["usage"]["completion_tokens"] == ids.size();
    CheckRequest q;
    q.prompt = c.prompt;
    q.params.sampling.temperature = 0.0f;
    q.params.max_tokens = kMaxTokens;
    requests.push_back(q);
    run.ids.push_back(ids);
    run.reasons.push_back(reason == "stop" ? FinishReason::Stop : FinishReason::Length);
    const AloneResults alone = run_alone(weights, {q}, ec.max_context);
    EngineRunResult one;
    one.ids = {ids};
    one.reasons = {run.reasons.back()};
    const AloneCheck check = check_against_alone(weights, {q}, one, alone, ec.max_context);
    const bool pass = prompt_ok && text_ok && usage_ok && check.pass();
    add(c.name + " == alone", pass,
        std::to_string(ids.size()) + " ids, " + reason + ", " + check.summary() +
            (prompt_ok ? "" : "; prompt ids differ") + (text_ok ? "" : "; text is not decode(ids)") +
            (usage_ok ? "" : "; usage wrong") +
            (check.first_failure.empty() ? "" : "; " + check.first_failure));
    texts.push_back(choice_text(r));

    const Streamed s = post_stream(cli, c.path, c.body);
    const bool same = s.status == 200 && s.done && s.text == texts.back() && s.finish_reason == reason;
    add(c.name + " streamed == whole", same,
        same ? std::to_string(s.text.size()) + " bytes, [DONE]"
             : "HTTP " + std::to_string(s.status) + ", got \"" + s.text + "\" (" + s.finish_reason + ")");
  }

  // 6. a stop string from the middle of the completion's text
  if (!texts.empty() && texts[0].size() >= 8) {
    const std::string& full = texts[0];
    // Three bytes from the middle, widened to whole UTF-8 characters: a cut inside a character (a random model's
    // text is full of U+FFFD, three bytes each) would be a stop string that is not UTF-8, which JSON cannot carry.
    const auto boundary = [&](size_t i) {
      while (i < full.size() && (static_cast<unsigned char>(full[i]) & 0xC0) == 0x80) ++i;
      return i;
    };
    const size_t begin = boundary(full.size() / 2);
    const std::string stop = full.substr(begin, boundary(std::min(begin + 3, full.size())) - begin);
    const std::string expected = full.substr(0, full.find(stop));
    json body = cases[0].body;
    body["stop"] = json::array({stop});
    int status = 0;
    const json r = post(cli, cases[0].path, body, &status);
    const Streamed s = post_stream(cli, cases[0].path, body);
    const bool ok = status == 200 && choice_text(r) == expected &&
                    r["choices"][0]["finish_reason"] == "stop" && s.text == expected &&
                    s.finish_reason == "stop";
    add("stop string", ok,
        "stop \"" + stop + "\": " + std::to_string(expected.size()) + " bytes, finish stop" +
            (ok ? "" : " (got \"" + s.text + "\")"));
  }

  // 7. an error in OpenAI's shape
  {
    int status = 0;
    const json r = post(cli, "/v1/completions", json{{"model", "no-such-model"}, {"prompt", "hi"}}, &status);
    const bool ok = status == 404 && !r.is_discarded() && r["error"]["type"] == "invalid_request_error" &&
                    r["error"]["code"] == "model_not_found";
    add("unknown model -> 404", ok, ok ? "error.code model_not_found" : "HTTP " + std::to_string(status));
  }

  // 8. all KV blocks back in the pool once the engine is idle (aborted stop-string requests included)
  {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    EngineStats st = engine.stats();
    while (std::chrono::steady_clock::now() < until &&
           (srv.stats().in_flight > 0 || st.running + st.waiting + st.pending > 0 ||
            st.kv.free_blocks != st.kv.total_blocks)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      st = engine.stats();
    }
    const bool ok = st.kv.free_blocks == st.kv.total_blocks && srv.stats().in_flight == 0;
    add("KV blocks all free", ok,
        std::to_string(st.kv.free_blocks) + "/" + std::to_string(st.kv.total_blocks) + " free");
  }
  srv.shutdown(std::chrono::seconds(5));

  bool pass = true;
  std::printf("%-28s %-6s %s\n", "check", "result", "detail");
  for (const Row& r : rows) {
    std::printf("%-28s %-6s %s\n", r.check.c_str(), r.pass ? "PASS" : "FAIL", r.detail.c_str());
    pass = pass && r.pass;
  }
  std::printf("\n%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitPass : kExitFail;
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson13_server",
                       "an OpenAI-compatible HTTP server over the engine, checked over loopback");
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run_lesson(opt); });
}
