// Lesson 13: the OpenAI wire format. What a request body may say, what a response looks like, and how an error
// is reported, as plain functions over JSON: no sockets here, so every rule is unit-tested on its own
// (tests/test_13_protocol.cpp).
//
//   POST /v1/completions        {"model", "prompt": "text" | [ids], "max_tokens", "stop", "stream", ...}
//   POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_completion_tokens", ...}
//
//   non-streaming  one JSON object: {"id", "object", "created", "model", "choices": [...], "usage": {...}}
//   streaming      server-sent events, one JSON chunk per event, then the end marker:
//                    data: {"id": ..., "object": "text_completion", "choices": [{"text": "Hel", ...}]}\n\n
//                    data: {"id": ..., "choices": [{"text": "", "finish_reason": "length"}]}\n\n
//                    data: [DONE]\n\n
//   an error       a 4xx/5xx status and {"error": {"message", "type", "param", "code"}}
//
// The shapes are OpenAI's (platform.openai.com/docs/api-reference), so the official clients parse them
// unchanged; vLLM's extensions top_k, ignore_eos, return_token_ids and chat_template_kwargs (enable_thinking
// only) are accepted too.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "chat_template.h"  // ChatMessage
#include "sampling.h"       // SamplingParams
#include "sequence.h"       // FinishReason

namespace tvllm::server {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;  // responses keep OpenAI's key order (easier to read, diff, test)

// ---- errors ---------------------------------------------------------------------------------------------

// A request the server refuses, with the HTTP status and OpenAI's error fields. Thrown anywhere a request is
// handled; the server turns it into the response (error_json). param and code may be empty (JSON null).
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param;  // the request field at fault ("temperature", "messages[1].content")
  std::string code;   // a machine-readable reason ("model_not_found", "context_length_exceeded")
};

// OpenAI's error "type" for an HTTP status: 429 "rate_limit_error", 5xx "server_error", every other 4xx
// "invalid_request_error" (what OpenAI answers for a bad body, an unknown model and a bad API key alike).
std::string_view error_type_for_status(int status);
// {"error": {"message", "type", "param", "code"}}: param and code null when empty.
OrderedJson error_json(int status, std::string_view message, std::string_view param = {},
                       std::string_view code = {});
inline OrderedJson error_json(const ApiError& e) { return error_json(e.status, e.what(), e.param, e.code); }

// ---- requests -------------------------------------------------------------------------------------------

enum class Endpoint { Completions, ChatCompletions };

// A request body, parsed and type-checked: everything that can be judged without the model. What needs the
// model (the name, the vocabulary, the context) the server checks next.
struct GenerationRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;
  // completions: the prompt, as text or as token ids (exactly one of them)
  std::optional<std::string> prompt_text;
  std::optional<std::vector<int64_t>>
      prompt_ids;  // int64: an id outside int32 must still be reported as such
  // chat: the conversation
  std::vector<ChatMessage> messages;
  std::optional<int64_t>
      max_tokens;  // max_completion_tokens wins over max_tokens; absent: the server decides
  SamplingParams sampling{1.0f, 0, 1.0f, 0};  // OpenAI's defaults: temperature 1, top_p 1 (top_k off)
  bool seed_given = false;  // without a seed the server draws one: sampled requests differ, as at OpenAI
  std::vector<std::string> stop;  // up to 4 stop strings
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  bool ignore_eos = false;        // vLLM: do not stop at EOS (benchmarks)
  bool return_token_ids = false;  // vLLM: choices[0].prompt_token_ids and token_ids (non-streaming)
  // chat: vLLM's chat_template_kwargs {"enable_thinking": false}: the template variable of that name (Qwen3's
  // hybrid thinking; true, the template's default, when absent). A template without that switch never reads
  // it, so it renders the same prompt, as apply_chat_template(..., enable_thinking=False) does in transformers.
  bool enable_thinking = true;
};

// Parses a body (ApiError 400 with the param at fault: malformed JSON, a wrong type, a value out of range, a
// list of several prompts, n != 1, a feature we do not have such as logprobs or tools).
GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint);

// ---- responses ------------------------------------------------------------------------------------------

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  OrderedJson to_json() const;  // {"prompt_tokens", "completion_tokens", "total_tokens"}
};

// What every response and chunk of one request shares.
struct ResponseIds {
  std::string id;       // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};
// "cmpl-" or "chatcmpl-" and 24 random hex digits.
std::string new_response_id(Endpoint endpoint);

// OpenAI's finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens or the context). Others: "".
std::string_view finish_reason_text(FinishReason reason);

// The non-streaming response: {"id", "object": "text_completion" | "chat.completion", "created", "model",
// "choices": [{"index": 0, "text" | "message": {"role": "assistant", "content"}, "logprobs": null,
// "finish_reason"}], "usage"}. token_ids (return_token_ids): prompt and generated ids in the choice.
OrderedJson completion_response(Endpoint endpoint, const ResponseIds& ids, std::string_view text,
                                std::string_view finish_reason, const Usage& usage,
                                const std::vector<int32_t>* prompt_ids = nullptr,
                                const std::vector<int32_t>* output_ids = nullptr);

// The server-sent events of one streaming response, in order:
//   start()          chat: the first chunk, delta {"role": "assistant", "content": ""}; completions: nothing
//   text(piece)      one chunk with the new text (nothing for an empty piece); text_with_ids adds the ids
//   finish(reason)   the chunk with the finish_reason (empty text / delta {}), then, when include_usage, a chunk
//                    with "choices": [] and the usage, then "data: [DONE]"
//   error(e)         instead of finish: data: {"error": {...}}, then "data: [DONE]" (OpenAI's mid-stream error)
// With include_usage every chunk before the last carries "usage": null, as OpenAI sends it.
class StreamChunks {
 public:
  StreamChunks(Endpoint endpoint, ResponseIds ids, bool include_usage);
  std::string start() const;
  std::string text(std::string_view piece) const;
  // The same chunk, always written, with choices[0].token_ids (return_token_ids, or a model without tokenizer).
  std::string text_with_ids(std::string_view piece, const std::vector<int32_t>& ids) const;
  std::string finish(std::string_view finish_reason, const Usage& usage) const;
  std::string error(const ApiError& e) const;

  // One event: "data: " + payload + "\n\n".
  static std::string event(std::string_view payload);

 private:
  // One chunk as an event: the shared fields, one choice holding `content` (completions: the text; chat: the
  // delta's content, with the role when `role` is set) and finish_reason (null when empty).
  std::string chunk(std::string_view content, bool role, bool empty_delta,
                    std::string_view finish_reason) const;

  Endpoint endpoint_;
  ResponseIds ids_;
  bool include_usage_;
};

}  // namespace tvllm::server
