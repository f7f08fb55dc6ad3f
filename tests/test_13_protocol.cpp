// Lesson 13 without sockets: the OpenAI wire format (request parsing, responses, SSE chunks, errors), the stop-string
// matcher, the Prometheus metrics and the bench's URL and percentile rules.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_serve.h"
#include "common/errors.h"
#include "metrics.h"
#include "protocol.h"
#include "stop_strings.h"
#include "tokenizer.h"

namespace tvllm::server {
namespace {

using nlohmann::json;

GenerationRequest parse(const json& body, Endpoint e = Endpoint::Completions) {
  return parse_generation_request(body.dump(), e);
}

// The status, code and param of the ApiError a body raises ("" when it parses).
std::string refusal(const std::string& body, Endpoint e = Endpoint::Completions) {
  try {
    parse_generation_request(body, e);
  } catch (const ApiError& err) {
    return std::to_string(err.status) + " " + err.code + " " + err.param;
  }
  return "";
}

// ---- errors ---------------------------------------------------------------------------------------------------

TEST(Protocol13, ErrorTypes) {
  EXPECT_EQ(error_type_for_status(400), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(401), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(404), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(405), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(413), "invalid_request_error");
  EXPECT_EQ(error_type_for_status(429), "rate_limit_error");
  EXPECT_EQ(error_type_for_status(500), "server_error");
  EXPECT_EQ(error_type_for_status(503), "server_error");
}

TEST(Protocol13, ErrorJson) {
  const auto j = error_json(400, "bad temperature", "temperature", "invalid_value");
  EXPECT_EQ(j.dump(),
            R"({"error":{"message":"bad temperature","type":"invalid_request_error","param":"temperature",)"
            R"("code":"invalid_value"}})");
  const auto k = error_json(ApiError(503, "going away"));
  EXPECT_TRUE(k["error"]["param"].is_null());
  EXPECT_TRUE(k["error"]["code"].is_null());
  EXPECT_EQ(k["error"]["type"], "server_error");
}

// ---- requests -------------------------------------------------------------------------------------------------

TEST(Protocol13, ParsesACompletionRequest) {
  const GenerationRequest r = parse({{"model", "m"},
                                     {"prompt", "Hello"},
                                     {"max_tokens", 7},
                                     {"temperature", 0.5},
                                     {"top_p", 0.9},
                                     {"top_k", 40},
                                     {"seed", -3},
                                     {"stop", "\n"},
                                     {"stream", true},
                                     {"stream_options", {{"include_usage", true}}},
                                     {"user", "u1"},
                                     {"ignore_eos", true},
                                     {"n", 1}});
  EXPECT_EQ(r.model, "m");
  ASSERT_TRUE(r.prompt_text.has_value());
  EXPECT_EQ(*r.prompt_text, "Hello");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.sampling.seed, static_cast<uint64_t>(-3));
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});
  EXPECT_TRUE(r.stream && r.include_usage && r.ignore_eos);
}

TEST(Protocol13, DefaultsAreOpenAis) {
  const GenerationRequest r =
      parse({{"model", "m"}, {"prompt", "x"}, {"temperature", nullptr}, {"stop", nullptr}});
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);  // OpenAI samples by default
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FALSE(r.seed_given);
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.stream);
}

TEST(Protocol13, PromptForms) {
  EXPECT_EQ(parse({{"model", "m"}, {"prompt", {1, 2, 3}}}).prompt_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(parse({{"model", "m"}, {"prompt", {"only one"}}}).prompt_text, "only one");
  EXPECT_EQ(parse({{"model", "m"}, {"prompt", {{4, 5}}}}).prompt_ids, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(refusal(R"({"model":"m","prompt":["a","b"]})"), "400 invalid_value prompt");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":[]})"), "400 invalid_value prompt");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":[1.5]})"), "400 invalid_type prompt[0]");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":[1,"x"]})"), "400 invalid_type prompt[1]");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":{"a":1}})"), "400 invalid_type prompt");
  EXPECT_EQ(refusal(R"({"model":"m"})"), "400 missing_required_parameter prompt");
}

TEST(Protocol13, ChatMessages) {
  const GenerationRequest r =
      parse({{"model", "m"},
             {"messages",
              {{{"role", "developer"}, {"content", "Be brief."}},
               {{"role", "user"},
                {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
               {{"role", "assistant"}, {"content", nullptr}}}},
             {"max_tokens", 3},
             {"max_completion_tokens", 5}},
            Endpoint::ChatCompletions);
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "a\nb");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.max_tokens, 5);  // max_completion_tokens wins
  const Endpoint c = Endpoint::ChatCompletions;
  EXPECT_EQ(refusal(R"({"model":"m","messages":[]})", c), "400 invalid_value messages");
  EXPECT_EQ(refusal(R"({"model":"m","messages":[{"role":"tool","content":"x"}]})", c),
            "400 invalid_value messages[0].role");
  EXPECT_EQ(refusal(R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})", c),
            "400 unsupported_parameter messages[0].content[0].type");
  EXPECT_EQ(refusal(R"({"model":"m","messages":[{"role":"user"}]})", c),
            "400 missing_required_parameter messages[0].content");
  EXPECT_EQ(refusal(R"({"model":"m","messages":"hi"})", c), "400 invalid_type messages");
  EXPECT_EQ(refusal(R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true})", c),
            "400 unsupported_parameter logprobs");
  EXPECT_EQ(
      refusal(R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", c),
      "400 unsupported_parameter tools");
}

// vLLM's chat_template_kwargs: enable_thinking (Qwen3's switch) is read, bad types and other variables are 400s
// that name the field, and the message says what to send instead.
TEST(Protocol13, ChatTemplateKwargs) {
  const Endpoint c = Endpoint::ChatCompletions;
  const json chat = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}};
  EXPECT_TRUE(parse(chat, c).enable_thinking);  // absent: the template's default
  json body = chat;
  body["chat_template_kwargs"] = {{"enable_thinking", false}};
  EXPECT_FALSE(parse(body, c).enable_thinking);
  body["chat_template_kwargs"] = {{"enable_thinking", true}};
  EXPECT_TRUE(parse(body, c).enable_thinking);
  body["chat_template_kwargs"] = json::object();
  EXPECT_TRUE(parse(body, c).enable_thinking);
  body["chat_template_kwargs"] = nullptr;  // null is "not given", as for every field
  EXPECT_TRUE(parse(body, c).enable_thinking);

  const std::string base = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":{"enable_thinking":"false"}})", c),
            "400 invalid_type chat_template_kwargs.enable_thinking");
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":{"enable_thinking":0}})", c),
            "400 invalid_type chat_template_kwargs.enable_thinking");
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":{"enable_thinking":null}})", c),
            "400 invalid_type chat_template_kwargs.enable_thinking");
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":[true]})", c), "400 invalid_type chat_template_kwargs");
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":"enable_thinking=false"})", c),
            "400 invalid_type chat_template_kwargs");
  EXPECT_EQ(refusal(base + R"("chat_template_kwargs":{"enable_thinking":false,"date_string":"1 Jan"}})", c),
            "400 unsupported_parameter chat_template_kwargs.date_string");
  try {
    parse_generation_request(base + R"("chat_template_kwargs":{"enable_thinking":"no"}})", c);
    ADD_FAILURE() << "a string enable_thinking was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(std::string(e.what()), "'chat_template_kwargs.enable_thinking' must be a boolean, got string");
  }
  try {
    parse_generation_request(base + R"("chat_template_kwargs":{"thinking":false}})", c);
    ADD_FAILURE() << "an unknown template variable was accepted";
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("only chat template variable this server renders is enable_thinking"),
              std::string::npos)
        << e.what();
  }
}

TEST(Protocol13, RefusesBadFields) {
  const std::string base = R"({"model":"m","prompt":"x",)";
  EXPECT_EQ(refusal("{"), "400 invalid_json ");
  EXPECT_EQ(refusal("[1,2]"), "400 invalid_json ");
  EXPECT_EQ(refusal("\"\xff\""), "400 invalid_json ");  // not UTF-8
  EXPECT_EQ(refusal(R"({"prompt":"x"})"), "400 missing_required_parameter model");
  EXPECT_EQ(refusal(R"({"model":7,"prompt":"x"})"), "400 invalid_type model");
  EXPECT_EQ(refusal(base + R"("temperature":"hot"})"), "400 invalid_type temperature");
  EXPECT_EQ(refusal(base + R"("temperature":2.5})"), "400 invalid_value temperature");
  EXPECT_EQ(refusal(base + R"("temperature":-0.1})"), "400 invalid_value temperature");
  EXPECT_EQ(refusal(base + R"("top_p":0})"), "400 invalid_value top_p");
  EXPECT_EQ(refusal(base + R"("top_p":1.01})"), "400 invalid_value top_p");
  EXPECT_EQ(refusal(base + R"("top_k":-2})"), "400 invalid_value top_k");
  EXPECT_EQ(refusal(base + R"("top_k":2.5})"), "400 invalid_type top_k");
  EXPECT_EQ(refusal(base + R"("max_tokens":0})"), "400 invalid_value max_tokens");
  EXPECT_EQ(refusal(base + R"("max_tokens":"9"})"), "400 invalid_type max_tokens");
  EXPECT_EQ(refusal(base + R"("max_tokens":1e3})"), "400 invalid_type max_tokens");
  EXPECT_EQ(refusal(base + R"("n":2})"), "400 invalid_value n");
  EXPECT_EQ(refusal(base + R"("stop":["a","b","c","d","e"]})"), "400 invalid_value stop");
  EXPECT_EQ(refusal(base + R"("stop":[1]})"), "400 invalid_type stop[0]");
  EXPECT_EQ(refusal(base + R"("stop":""})"), "400 invalid_value stop");
  EXPECT_EQ(refusal(base + R"("stream":"yes"})"), "400 invalid_type stream");
  EXPECT_EQ(refusal(base + R"("stream_options":{"include_usage":true}})"),
            "400 invalid_value stream_options");
  EXPECT_EQ(refusal(base + R"("seed":"1"})"), "400 invalid_type seed");
  EXPECT_EQ(refusal(base + R"("user":5})"), "400 invalid_type user");
  EXPECT_EQ(refusal(base + R"("logprobs":2})"), "400 unsupported_parameter logprobs");
  EXPECT_EQ(refusal(base + R"("echo":true})"), "400 unsupported_parameter echo");
  EXPECT_EQ(refusal(base + R"("presence_penalty":0.5})"), "400 unsupported_parameter presence_penalty");
  EXPECT_EQ(refusal(base + R"("presence_penalty":0})"), "");  // the default: accepted
  EXPECT_EQ(refusal(base + R"("frequency_penalty":9})"), "400 invalid_value frequency_penalty");
  EXPECT_EQ(refusal(base + R"("logit_bias":{"5":1}})"), "400 unsupported_parameter logit_bias");
  EXPECT_EQ(refusal(base + R"("some_new_field":1})"), "");  // unknown fields: ignored, as OpenAI does
  // A deeply nested body: refused, not a stack overflow.
  EXPECT_EQ(refusal(std::string(100000, '[') + std::string(100000, ']')), "400 invalid_json ");
}

// ---- responses and chunks -------------------------------------------------------------------------------------

TEST(Protocol13, CompletionResponseShape) {
  const ResponseIds ids{"cmpl-1", 1700000000, "tiny"};
  const auto c = completion_response(Endpoint::Completions, ids, "Hi", "stop", Usage{3, 2});
  EXPECT_EQ(
      c.dump(),
      R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny","choices":[{"index":0,)"
      R"("text":"Hi","logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,)"
      R"("total_tokens":5}})");
  const auto m = completion_response(Endpoint::ChatCompletions, ids, "Yo", "length", Usage{1, 1});
  EXPECT_EQ(m["object"], "chat.completion");
  EXPECT_EQ(m["choices"][0]["message"].dump(), R"({"role":"assistant","content":"Yo"})");
  EXPECT_EQ(new_response_id(Endpoint::Completions).rfind("cmpl-", 0), 0u);
  EXPECT_EQ(new_response_id(Endpoint::ChatCompletions).size(), 9u + 24u);
}

TEST(Protocol13, StreamChunksCompletions) {
  const StreamChunks s(Endpoint::Completions, ResponseIds{"cmpl-1", 5, "tiny"}, false);
  EXPECT_EQ(s.start(), "");
  EXPECT_EQ(s.text(""), "");
  EXPECT_EQ(
      s.text("He"),
      "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":5,\"model\":\"tiny\",\"choices\":"
      "[{\"index\":0,\"text\":\"He\",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
  EXPECT_EQ(
      s.finish("length", Usage{2, 3}),
      "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":5,\"model\":\"tiny\",\"choices\":"
      "[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n");
}

TEST(Protocol13, StreamChunksChatWithUsage) {
  const StreamChunks s(Endpoint::ChatCompletions, ResponseIds{"chatcmpl-1", 5, "tiny"}, true);
  const std::string head =
      "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"tiny\",";
  EXPECT_EQ(s.start(), head +
                           "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                           "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n");
  EXPECT_EQ(s.text("é"), head +
                             "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"é\"},\"logprobs\":null,"
                             "\"finish_reason\":null}],\"usage\":null}\n\n");
  EXPECT_EQ(
      s.finish("stop", Usage{4, 1}),
      head +
          "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],"
          "\"usage\":null}\n\n" +
          head +
          "\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5}}\n\n"
          "data: [DONE]\n\n");
  const std::string e = s.error(ApiError(503, "bye", {}, "shutting_down"));
  EXPECT_EQ(e,
            "data: {\"error\":{\"message\":\"bye\",\"type\":\"server_error\",\"param\":null,\"code\":"
            "\"shutting_down\"}}\n\ndata: [DONE]\n\n");
}

// ---- stop strings ---------------------------------------------------------------------------------------------

// Feeds pieces one at a time; returns what came out, joined with '|' between pushes.
std::string feed(StopMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (size_t i = 0; i < pieces.size(); ++i) out += (i ? "|" : "") + m.push(pieces[i]);
  return out;
}

TEST(Protocol13, StopMatcherHoldsBackPossibleStarts) {
  StopMatcher m({"User:"});
  EXPECT_EQ(feed(m, {"Hi! ", "Us", "er:", " more"}), "Hi! |||");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.flush(), "");
  StopMatcher n({"User:"});
  EXPECT_EQ(feed(n, {"Hi! ", "Us", "ing it"}), "Hi! ||Using it");  // "Us" released once it cannot be a stop
  EXPECT_FALSE(n.stopped());
  StopMatcher k({"User:"});
  EXPECT_EQ(feed(k, {"a U"}), "a ");
  EXPECT_EQ(k.flush(), "U");  // the end of the generation releases what was held
}

TEST(Protocol13, StopMatcherEarliestOfSeveral) {
  StopMatcher m({"cd", "b"});
  EXPECT_EQ(m.push("abcd"), "a");  // "b" comes first
  StopMatcher n({"xyz", "yz"});
  EXPECT_EQ(n.push("axyzb"), "a");
  StopMatcher inside({"\n\n"});
  EXPECT_EQ(feed(inside, {"one\n", "\ntwo"}), "one|");  // the stop spans two pieces
  StopMatcher none({});
  EXPECT_EQ(feed(none, {"all", " of", " it"}), "all| of| it");
}

TEST(Protocol13, StopMatcherKeepsUtf8Whole) {
  StopMatcher m({"éx"});
  EXPECT_EQ(m.push("caf\xc3\xa9"), "caf");  // "é" could start "éx": held as a whole character
  EXPECT_EQ(m.push("!"), "\xc3\xa9!");
}

TEST(Protocol13, OutputTextMatchesDecode) {
  const Tokenizer tok = Tokenizer::from_file(std::string(TVLLM_TINY_MODEL_DIR) + "/tokenizer.json");
  const std::vector<int32_t> ids = tok.encode("The capital of Portugal is Lisbon. It is big.", false);
  OutputText all(&tok, {});
  std::string text;
  for (int32_t id : ids) text += all.push(id);
  text += all.finish();
  EXPECT_EQ(text, tok.decode(ids, true));
  EXPECT_EQ(all.tokens(), static_cast<int64_t>(ids.size()));
  OutputText cut(&tok, {"Lisbon"});
  text.clear();
  for (int32_t id : ids) text += cut.push(id);
  EXPECT_TRUE(cut.stopped());
  EXPECT_EQ(text, "The capital of Portugal is ");
  EXPECT_LT(cut.tokens(), static_cast<int64_t>(ids.size()));
}

// ---- metrics and the bench's rules ----------------------------------------------------------------------------

TEST(Protocol13, HistogramIsCumulative) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.1);  // le is inclusive
  h.observe(0.5);
  h.observe(7.0);
  EXPECT_EQ(h.render("x", "help"),
            "# HELP x help\n# TYPE x histogram\nx_bucket{le=\"0.1\"} 2\nx_bucket{le=\"1\"} 3\n"
            "x_bucket{le=\"+Inf\"} 4\nx_sum 7.65\nx_count 4\n");
}

TEST(Protocol13, MetricsPage) {
  ServerMetrics m;
  m.record_finished(Outcome::Stop, 10, 5, 0.02, 0.004, 0.05);
  m.record_finished(Outcome::Abort, 3, 0, -1, -1, 0.01);
  m.record_rejected(429);
  EngineStats e;
  e.kv.total_blocks = 8;
  e.kv.free_blocks = 6;
  e.running = 2;
  const std::string page = m.render(e, 2, 0);
  for (const char* line :
       {"tvllm_requests_total{outcome=\"stop\"} 1\n", "tvllm_requests_total{outcome=\"abort\"} 1\n",
        "tvllm_requests_rejected_total{status=\"429\"} 1\n", "tvllm_prompt_tokens_total 13\n",
        "tvllm_generation_tokens_total 5\n", "tvllm_kv_blocks_used 2\n", "tvllm_kv_blocks_free 6\n",
        "tvllm_num_requests_running 2\n", "tvllm_time_to_first_token_seconds_count 1\n",
        "tvllm_time_per_output_token_seconds_bucket{le=\"0.005\"} 1\n",
        "# TYPE tvllm_time_to_first_token_seconds histogram\n"})
    EXPECT_NE(page.find(line), std::string::npos) << line;
}

// Counts print as integers ("10", not %g's "1e+01"), however large; fractions keep their shortest form.
TEST(Protocol13, MetricsPrintIntegersAsIntegers) {
  ServerMetrics m;
  for (int i = 0; i < 10; ++i) m.record_finished(Outcome::Length, 123456789, 1000000, 0.5, 0.25, 2.0);
  for (int i = 0; i < 12; ++i) m.record_rejected(400);
  EngineStats e;
  e.kv.total_blocks = 8192;
  e.kv.free_blocks = 8192;
  e.steps = 1234567;
  const std::string page = m.render(e, 0, 0);
  for (const char* line :
       {"tvllm_requests_total{outcome=\"length\"} 10\n", "tvllm_requests_rejected_total{status=\"400\"} 12\n",
        "tvllm_prompt_tokens_total 1234567890\n", "tvllm_generation_tokens_total 10000000\n",
        "tvllm_kv_blocks_total 8192\n", "tvllm_engine_steps_total 1234567\n",
        "tvllm_time_to_first_token_seconds_count 10\n", "tvllm_time_to_first_token_seconds_sum 5\n",
        "tvllm_e2e_request_latency_seconds_sum 20\n", "tvllm_time_per_output_token_seconds_sum 2.5\n",
        "tvllm_time_to_first_token_seconds_bucket{le=\"10\"} 10\n", "tvllm_kv_cache_usage_ratio 0\n"})
    EXPECT_NE(page.find(line), std::string::npos) << line;
  EXPECT_EQ(page.find("e+"), std::string::npos) << page;
}

TEST(Protocol13, BenchUrlIsLoopbackOnly) {
  EXPECT_EQ(parse_loopback_url("http://127.0.0.1:8000").port, 8000);
  EXPECT_EQ(parse_loopback_url("http://localhost:9/v1").host, "localhost");
  EXPECT_EQ(parse_loopback_url("http://[::1]:8000/").host, "::1");
  EXPECT_EQ(parse_loopback_url("http://127.1.2.3:80").host, "127.1.2.3");
  for (const char* bad :
       {"http://10.0.0.1:8000", "http://example.com:80", "https://127.0.0.1:8000", "http://127.0.0.1",
        "http://127.0.0.1:99999", "http://0.0.0.0:8000", "127.0.0.1:8000"})
    EXPECT_THROW(parse_loopback_url(bad), InputError) << bad;
}

TEST(Protocol13, Percentiles) {
  const LatencySummary s = summarize({4, 1, 3, 2, 5});
  EXPECT_DOUBLE_EQ(s.p50, 3);
  EXPECT_DOUBLE_EQ(s.mean, 3);
  EXPECT_DOUBLE_EQ(s.p99, 4.96);  // numpy.percentile([1..5], 99)
  EXPECT_EQ(summarize({}).n, 0);
}

}  // namespace
}  // namespace tvllm::server
