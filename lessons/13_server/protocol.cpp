// The OpenAI wire format (protocol.h): parsing request bodies, building responses, chunks and errors.
#include "protocol.h"

#include <cmath>
#include <random>

#include "common/exercise.h"

namespace tvllm::server {

namespace {

// Every dump of a response: bytes that are not UTF-8 (a parse error quoting the client's bytes) become U+FFFD
// instead of an exception.
std::string dump(const OrderedJson& j) {
  return j.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

std::string type_name(const Json& v) { return v.type_name(); }

[[noreturn]] void wrong_type(const std::string& param, const std::string& expected, const Json& got) {
  throw ApiError(400, "'" + param + "' must be " + expected + ", got " + type_name(got), param,
                 "invalid_type");
}
[[noreturn]] void bad_value(const std::string& param, const std::string& message) {
  throw ApiError(400, "'" + param + "': " + message, param, "invalid_value");
}
[[noreturn]] void unsupported(const std::string& param, const std::string& message) {
  throw ApiError(400, "'" + param + "' is not supported by this server: " + message, param,
                 "unsupported_parameter");
}

// The field, or nullptr when it is absent or null (OpenAI treats an explicit null as "not given").
const Json* field(const Json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

// An integer, as JSON writes it (1, not 1.0): a float where an integer belongs is a client bug worth a 400.
std::optional<int64_t> get_int(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    const auto u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) bad_value(key, "too large");
    return static_cast<int64_t>(u);
  }
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  return v->get<int64_t>();
}

std::optional<double> get_number(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  return v->get<double>();
}

std::optional<std::string> get_string(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
}

// Token ids: a non-empty array of integers.
std::vector<int64_t> get_ids(const Json& array, const std::string& param) {
  if (array.empty()) bad_value(param, "the prompt is empty (no token ids)");
  std::vector<int64_t> ids;
  ids.reserve(array.size());
  for (size_t i = 0; i < array.size(); ++i) {
    const Json& v = array[i];
    const std::string p = param + "[" + std::to_string(i) + "]";
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      ids.push_back(u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u));
    } else if (v.is_number_integer()) {
      ids.push_back(v.get<int64_t>());
    } else {
      wrong_type(p, "a token id (an integer)", v);
    }
  }
  return ids;
}

// prompt: "text" | [ids] | ["text"] | [[ids]]. A list of several prompts is OpenAI's batch form: refused here
// (one prompt per request; send several requests, the engine batches them anyway).
void parse_prompt(const Json& body, GenerationRequest& r) {
  const Json* p = field(body, "prompt");
  if (!p) throw ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter");
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
    return;
  }
  if (!p->is_array()) wrong_type("prompt", "a string or an array of token ids", *p);
  if (p->empty()) bad_value("prompt", "the prompt is empty");
  const Json& first = (*p)[0];
  if (first.is_number()) {
    r.prompt_ids = get_ids(*p, "prompt");
    return;
  }
  if (p->size() > 1)
    bad_value("prompt", "a list of " + std::to_string(p->size()) +
                            " prompts: this server takes one prompt per request (send one request each)");
  if (first.is_string()) {
    r.prompt_text = first.get<std::string>();
  } else if (first.is_array()) {
    r.prompt_ids = get_ids(first, "prompt[0]");
  } else {
    wrong_type("prompt[0]", "a string or an array of token ids", first);
  }
}

// messages: [{"role", "content": "text" | [{"type": "text", "text"}], "name"?}]
void parse_messages(const Json& body, GenerationRequest& r) {
  const Json* m = field(body, "messages");
  if (!m) throw ApiError(400, "'messages' is required", "messages", "missing_required_parameter");
  if (!m->is_array()) wrong_type("messages", "an array of messages", *m);
  if (m->empty()) bad_value("messages", "at least one message is required");
  for (size_t i = 0; i < m->size(); ++i) {
    const Json& msg = (*m)[i];
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) wrong_type(p, "an object", msg);
    const std::optional<std::string> role = get_string(msg, "role");
    if (!role) throw ApiError(400, "'" + p + ".role' is required", p + ".role", "missing_required_parameter");
    ChatMessage out;
    // "developer" is OpenAI's newer name for the system role.
    out.role = *role == "developer" ? "system" : *role;
    if (out.role != "system" && out.role != "user" && out.role != "assistant")
      bad_value(p + ".role", "'" + *role + "' is not supported (system, developer, user or assistant)");
    if (const Json* tc = field(msg, "tool_calls"); tc && !tc->empty())
      unsupported(p + ".tool_calls", "no tools");
    const Json* content = field(msg, "content");
    if (!content) {
      if (out.role != "assistant")
        throw ApiError(400, "'" + p + ".content' is required", p + ".content", "missing_required_parameter");
    } else if (content->is_string()) {
      out.content = content->get<std::string>();
    } else if (content->is_array()) {
      // Text parts, joined with newlines as vLLM does; images and audio are not for this model.
      for (size_t k = 0; k < content->size(); ++k) {
        const Json& part = (*content)[k];
        const std::string pp = p + ".content[" + std::to_string(k) + "]";
        if (!part.is_object()) wrong_type(pp, "a content part object", part);
        const std::optional<std::string> type = get_string(part, "type");
        if (type != "text") unsupported(pp + ".type", "only \"text\" parts (this model reads text)");
        const std::optional<std::string> text = get_string(part, "text");
        if (!text)
          throw ApiError(400, "'" + pp + ".text' is required", pp + ".text", "missing_required_parameter");
        if (k > 0) out.content += "\n";
        out.content += *text;
      }
    } else {
      wrong_type(p + ".content", "a string or an array of content parts", *content);
    }
    r.messages.push_back(std::move(out));
  }
}

}  // namespace

// ---- errors ---------------------------------------------------------------------------------------------

std::string_view error_type_for_status(int status) {
  // The openai Python client picks its exception class (BadRequestError, RateLimitError, ...) from the status;
  // "type" is what a human reads in the body.
  if (status == 429) return "rate_limit_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

OrderedJson error_json(int status, std::string_view message, std::string_view param, std::string_view code) {
  OrderedJson e;
  e["message"] = message;
  e["type"] = error_type_for_status(status);
  e["param"] = param.empty() ? OrderedJson(nullptr) : OrderedJson(param);
  e["code"] = code.empty() ? OrderedJson(nullptr) : OrderedJson(code);
  OrderedJson j;
  j["error"] = std::move(e);
  return j;
}

// ---- requests -------------------------------------------------------------------------------------------

GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint) {
  // nlohmann's parser stops at a NUL byte as at the end of its input (C strings end there): without this,
  // '{"model": ...}' followed by a NUL and anything at all would be accepted. A NUL is never valid JSON outside
  // a string, and inside one it must be escaped (\u0000).
  if (body.find('\0') != std::string_view::npos)
    throw ApiError(400, "the request body is not valid JSON: it contains a NUL byte", {}, "invalid_json");
  Json j;
  try {
    j = Json::parse(body);  // strict JSON; strings must be UTF-8
  } catch (const Json::exception& e) {
    throw ApiError(400, std::string("the request body is not valid JSON: ") + e.what(), {}, "invalid_json");
  }
  if (!j.is_object())
    throw ApiError(400, "the request body must be a JSON object, got " + type_name(j), {}, "invalid_json");

  GenerationRequest r;
  r.endpoint = endpoint;
  const std::optional<std::string> model = get_string(j, "model");
  if (!model) throw ApiError(400, "'model' is required", "model", "missing_required_parameter");
  r.model = *model;
  const bool chat = endpoint == Endpoint::ChatCompletions;
  if (chat)
    parse_messages(j, r);
  else
    parse_prompt(j, r);

  // Lengths. Chat: max_completion_tokens (the new name) wins over max_tokens (deprecated there).
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (!chat && std::string_view(key) == "max_completion_tokens") continue;
    if (const std::optional<int64_t> n = get_int(j, key)) {
      if (*n < 1) bad_value(key, "must be >= 1, got " + std::to_string(*n));
      r.max_tokens = *n;
    }
  }

  // Sampling: OpenAI's ranges (temperature [0, 2], top_p (0, 1]); top_k as vLLM (-1 or 0: off).
  if (const std::optional<double> t = get_number(j, "temperature")) {
    if (!(*t >= 0.0 && *t <= 2.0)) bad_value("temperature", "must be in [0, 2], got " + std::to_string(*t));
    r.sampling.temperature = static_cast<float>(*t);
  }
  if (const std::optional<double> p = get_number(j, "top_p")) {
    if (!(*p > 0.0 && *p <= 1.0)) bad_value("top_p", "must be in (0, 1], got " + std::to_string(*p));
    r.sampling.top_p = static_cast<float>(*p);
  }
  if (const std::optional<int64_t> k = get_int(j, "top_k")) {
    if (*k < -1 || *k > INT32_MAX)
      bad_value("top_k", "must be -1 or 0 (off) or a positive count, got " + std::to_string(*k));
    r.sampling.top_k = static_cast<int>(*k);
  }
  if (const std::optional<int64_t> s = get_int(j, "seed")) {
    r.sampling.seed = static_cast<uint64_t>(*s);  // any integer; negative ones wrap (still reproducible)
    r.seed_given = true;
  }

  // Stop strings: one, or a list of up to 4 (OpenAI's limit), none empty.
  if (const Json* s = field(j, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 4) bad_value("stop", "at most 4 stop strings, got " + std::to_string(s->size()));
      for (size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) wrong_type("stop[" + std::to_string(i) + "]", "a string", (*s)[i]);
        r.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *s);
    }
    for (const std::string& text : r.stop)
      if (text.empty()) bad_value("stop", "a stop string must not be empty");
  }

  if (const std::optional<int64_t> n = get_int(j, "n"); n && *n != 1)
    bad_value("n", "only n = 1 is supported (one choice per request), got " + std::to_string(*n));
  r.stream = get_bool(j, "stream").value_or(false);
  if (const Json* so = field(j, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (!r.stream) bad_value("stream_options", "only allowed when 'stream' is true");
    r.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  (void)get_string(j, "user");  // accepted (OpenAI's end-user id), type-checked, not used
  r.ignore_eos = get_bool(j, "ignore_eos").value_or(false);
  r.return_token_ids = get_bool(j, "return_token_ids").value_or(false);

  // What this server does not do: refused plainly rather than silently ignored.
  // A value OpenAI and vLLM refuse (out of range, wrong type) is a 400 of its own, before "not supported".
  if (chat) {
    if (get_bool(j, "logprobs").value_or(false)) unsupported("logprobs", "no log-probabilities");
    if (const std::optional<int64_t> n = get_int(j, "top_logprobs")) {
      if (*n < 0 || *n > 20) bad_value("top_logprobs", "must be in [0, 20], got " + std::to_string(*n));
      if (*n > 0) unsupported("top_logprobs", "no log-probabilities");
    }
    for (const char* key : {"tools", "functions"}) {
      const Json* list = field(j, key);
      if (list && !list->is_array()) wrong_type(key, "an array", *list);
      if (list && !list->empty()) unsupported(key, "no tool or function calls");
    }
    // vLLM's chat_template_kwargs: variables handed to the Jinja template. We render templates as code, not
    // Jinja (lesson 09), so only the variable we implement is accepted; any other would be silently lost.
    if (const Json* kw = field(j, "chat_template_kwargs")) {
      if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
      for (const auto& [key, value] : kw->items()) {
        const std::string p = "chat_template_kwargs." + key;
        if (key != "enable_thinking")
          unsupported(p, "the only chat template variable this server renders is enable_thinking");
        if (!value.is_boolean()) wrong_type(p, "a boolean", value);
        r.enable_thinking = value.get<bool>();
      }
    }
    if (const Json* rf = field(j, "response_format")) {
      if (!rf->is_object()) wrong_type("response_format", "an object", *rf);
      if (get_string(*rf, "type").value_or("text") != "text")
        unsupported("response_format", "only {\"type\": \"text\"}");
    }
  } else {
    if (const std::optional<int64_t> n = get_int(j, "logprobs")) {
      if (*n < 0 || *n > 5) bad_value("logprobs", "must be in [0, 5], got " + std::to_string(*n));
      if (*n > 0) unsupported("logprobs", "no log-probabilities");
    }
    if (get_bool(j, "echo").value_or(false)) unsupported("echo", "the prompt is not echoed");
    if (get_int(j, "best_of").value_or(1) != 1) unsupported("best_of", "only best_of = 1");
    if (!get_string(j, "suffix").value_or("").empty()) unsupported("suffix", "no insertion");
  }
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    const std::optional<double> v = get_number(j, key);
    if (v && !(*v >= -2.0 && *v <= 2.0)) bad_value(key, "must be in [-2, 2]");
    if (v && *v != 0.0) unsupported(key, "no penalties (0 only)");
  }
  if (const Json* lb = field(j, "logit_bias")) {
    if (!lb->is_object()) wrong_type("logit_bias", "an object (token id -> bias)", *lb);
    if (!lb->empty()) unsupported("logit_bias", "no logit bias");
  }
  return r;
}

// ---- responses ------------------------------------------------------------------------------------------

OrderedJson Usage::to_json() const {
  OrderedJson u;
  u["prompt_tokens"] = prompt_tokens;
  u["completion_tokens"] = completion_tokens;
  u["total_tokens"] = prompt_tokens + completion_tokens;
  return u;
}

std::string new_response_id(Endpoint endpoint) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id = endpoint == Endpoint::Completions ? "cmpl-" : "chatcmpl-";
  for (int i = 0; i < 24; ++i) id += hex[rng() & 15];
  return id;
}

std::string_view finish_reason_text(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
    default:
      return "";
  }
}

OrderedJson completion_response(Endpoint endpoint, const ResponseIds& ids, std::string_view text,
                                std::string_view finish_reason, const Usage& usage,
                                const std::vector<int32_t>* prompt_ids,
                                const std::vector<int32_t>* output_ids) {
  const bool chat = endpoint == Endpoint::ChatCompletions;
  OrderedJson choice;
  choice["index"] = 0;
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason;
  if (prompt_ids) choice["prompt_token_ids"] = *prompt_ids;
  if (output_ids) choice["token_ids"] = *output_ids;
  OrderedJson j;
  j["id"] = ids.id;
  j["object"] = chat ? "chat.completion" : "text_completion";
  j["created"] = ids.created;
  j["model"] = ids.model;
  j["choices"] = OrderedJson::array({std::move(choice)});
  j["usage"] = usage.to_json();
  return j;
}

StreamChunks::StreamChunks(Endpoint endpoint, ResponseIds ids, bool include_usage)
    : endpoint_(endpoint), ids_(std::move(ids)), include_usage_(include_usage) {}

std::string StreamChunks::event(std::string_view payload) {
  std::string e;
  e.reserve(payload.size() + 8);
  e += "data: ";
  e += payload;
  e += "\n\n";
  return e;
}

std::string StreamChunks::chunk(std::string_view content, bool role, bool empty_delta,
                                std::string_view finish_reason) const {
  // --- exercise 13.1: the SSE chunk writer ------------------------------------------------------------------
  // Task: one streamed chunk as a server-sent event, in OpenAI's shape and key order:
  //   {"id", "object", "created", "model", "choices": [{"index": 0, <content>, "logprobs": null,
  //    "finish_reason"}]}
  //   object is "text_completion" (completions) or "chat.completion.chunk" (chat). <content> is "text": content
  //   for completions; for chat it is "delta": {} when empty_delta, else {"role": "assistant" (only when role),
  //   "content": content}. finish_reason is null when empty. When include_usage_, the chunk also ends with
  //   "usage": null. Return it as event(payload) with the JSON dumped by dump() (never throws on bad UTF-8).
  // Hint: OrderedJson keeps keys in insertion order; OrderedJson(nullptr) is JSON null; OrderedJson::object()
  //   is {} (a default-constructed json is null, not {}).
  // Tests: Protocol13.StreamChunks* Server13.StreamingEqualsNonStreaming Server13.ChatStreaming
  // --- solution ---
  const bool chat = endpoint_ == Endpoint::ChatCompletions;
  OrderedJson choice;
  choice["index"] = 0;
  if (chat) {
    OrderedJson delta = OrderedJson::object();
    if (!empty_delta) {
      if (role) delta["role"] = "assistant";
      delta["content"] = content;
    }
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = content;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason.empty() ? OrderedJson(nullptr) : OrderedJson(finish_reason);
  OrderedJson c;
  c["id"] = ids_.id;
  c["object"] = chat ? "chat.completion.chunk" : "text_completion";
  c["created"] = ids_.created;
  c["model"] = ids_.model;
  c["choices"] = OrderedJson::array({std::move(choice)});
  if (include_usage_) c["usage"] = nullptr;
  return event(dump(c));
  // --- end of exercise 13.1 ---
}

std::string StreamChunks::start() const {
  if (endpoint_ != Endpoint::ChatCompletions) return {};
  return chunk("", /*role=*/true, /*empty_delta=*/false, {});
}

std::string StreamChunks::text(std::string_view piece) const {
  if (piece.empty()) return {};
  return chunk(piece, false, false, {});
}

std::string StreamChunks::text_with_ids(std::string_view piece, const std::vector<int32_t>& ids) const {
  // chunk()'s event with choices[0].token_ids added (vLLM's return_token_ids in a stream).
  const std::string e = chunk(piece, false, false, {});
  OrderedJson j = OrderedJson::parse(e.substr(6, e.size() - 8));
  j["choices"][0]["token_ids"] = ids;
  return event(dump(j));
}

std::string StreamChunks::finish(std::string_view finish_reason, const Usage& usage) const {
  std::string out = chunk("", false, /*empty_delta=*/true, finish_reason);
  if (include_usage_) {
    OrderedJson u;
    u["id"] = ids_.id;
    u["object"] = endpoint_ == Endpoint::ChatCompletions ? "chat.completion.chunk" : "text_completion";
    u["created"] = ids_.created;
    u["model"] = ids_.model;
    u["choices"] = OrderedJson::array();
    u["usage"] = usage.to_json();
    out += event(dump(u));
  }
  out += event("[DONE]");
  return out;
}

std::string StreamChunks::error(const ApiError& e) const {
  return event(dump(error_json(e))) + event("[DONE]");
}

}  // namespace tvllm::server
