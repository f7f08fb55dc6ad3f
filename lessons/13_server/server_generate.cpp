// The OpenAI-compatible server (server.h), generation requests: the prompt's ids, admission (429 / 503), the
// engine's events into a request's queue, and the response, whole or as a server-sent event stream.
#include "server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <sstream>

#include "common/errors.h"
#include "common/exercise.h"
#include "connections.h"
#include "server_internal.h"
#include "stop_strings.h"

namespace tvllm::server {

// ---- generation requests ----------------------------------------------------------------------------------

const Tokenizer& OpenAiServer::tokenizer() const {
  if (!tokenizer_)
    throw ApiError(400, "this model has no tokenizer.json: send the prompt as token ids", "prompt",
                   "no_tokenizer");
  return *tokenizer_;
}

std::vector<int32_t> OpenAiServer::prompt_ids(const GenerationRequest& r) const {
  const int64_t vocab = engine_.weights().config.vocab_size;
  if (r.endpoint == Endpoint::Completions) {
    if (r.prompt_text)
      return tokenizer().encode(*r.prompt_text, /*add_special_tokens=*/true);  // BOS first, as HF
    std::vector<int32_t> ids;
    ids.reserve(r.prompt_ids->size());
    for (size_t i = 0; i < r.prompt_ids->size(); ++i) {
      const int64_t id = (*r.prompt_ids)[i];
      if (id < 0 || id >= vocab)
        throw ApiError(400,
                       "prompt token " + std::to_string(i) + " is " + std::to_string(id) +
                           ", outside the vocabulary [0, " + std::to_string(vocab) + ")",
                       "prompt", "invalid_value");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  }
  if (!tokenizer_)
    throw ApiError(400, "this model has no tokenizer.json: chat needs one; send token ids to /v1/completions",
                   "messages", "no_tokenizer");
  if (!chat_template_)
    throw ApiError(400, "this model has no chat template: use /v1/completions with a prompt", "messages",
                   "no_chat_template");
  std::string text;
  try {
    text = chat_template_->render(r.messages, /*add_generation_prompt=*/true, {}, r.enable_thinking);
  } catch (const InputError& e) {
    throw ApiError(400, std::string("the conversation cannot be rendered: ") + e.what(), "messages",
                   "invalid_value");
  }
  return tokenizer().encode(text, /*add_special_tokens=*/false);  // the template printed BOS itself
}

std::optional<ApiError> admission_refusal(const AdmissionLoad& load) {
  // --- exercise 13.3: admission (backpressure) ----------------------------------------------------------------
  // Task: decide whether one more generation request may enter. While load.draining, refuse it with
  //   ApiError(503, <message>, {}, "shutting_down"). Otherwise refuse it with ApiError(429, <message>, {},
  //   "queue_full") when the waiting room is full (awaiting_first >= max_waiting) or the whole house is
  //   (in_flight >= max_sequences + max_waiting: those running plus those waiting); else return std::nullopt.
  //   The 429 message should say what is full and that the client may retry (the server adds Retry-After).
  // Hint: waiting for a slot inside the server would hide the overload from the client and hold an HTTP worker
  //   per request; an immediate 429 lets the client (or a load balancer) back off or go elsewhere.
  // Tests: Server13Admission.Decisions Server13Backpressure.FullQueueIs429 Server13Hostile.RetryAfterOn429
  // --- solution ---
  if (load.draining) return ApiError(503, "the server is shutting down", {}, "shutting_down");
  if (load.awaiting_first >= load.max_waiting || load.in_flight >= load.max_sequences + load.max_waiting)
    return ApiError(429,
                    "the server is busy: " + std::to_string(load.awaiting_first) +
                        " request(s) are waiting to start and " + std::to_string(load.in_flight) +
                        " are in flight (limit --max-waiting " + std::to_string(load.max_waiting) +
                        "); retry later",
                    {}, "queue_full");
  return std::nullopt;
  // --- end of exercise 13.3 ---
}

std::shared_ptr<OpenAiServer::Flight> OpenAiServer::admit(std::vector<int32_t> prompt,
                                                          const GenerationRequest& r, int64_t max_tokens) {
  auto f = std::make_shared<Flight>();
  f->request = r;
  f->prompt = prompt;
  f->arrival = Clock::now();
  RequestParams params;
  params.sampling = r.sampling;
  params.max_tokens = max_tokens;
  params.ignore_eos = r.ignore_eos;
  // Held across submit() so that the engine's Finished (which erases the entry) cannot come first.
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::optional<ApiError> refusal = admission_refusal(
          {draining_, awaiting_first_, in_flight_, config_.max_waiting, engine_.limits().max_sequences}))
    throw *refusal;
  try {
    f->engine_id =
        engine_.submit(std::move(prompt), params, [this, f](const EngineEvent& e) { on_event(f, e); });
  } catch (const InputError& e) {
    throw ApiError(400, e.what(), {}, "invalid_value");
  }
  ++in_flight_;
  ++awaiting_first_;
  flights_[f->engine_id] = f;
  return f;
}

void OpenAiServer::on_event(const std::shared_ptr<Flight>& f, const EngineEvent& e) {
  // The engine thread: bookkeeping, then hand the event to the request's handler. Never blocks on a socket.
  const Clock::time_point now = Clock::now();
  if (e.kind == EngineEvent::Kind::Token) {
    if (!f->got_first) {
      f->got_first = true;
      f->first_token = now;
      std::lock_guard<std::mutex> lock(mutex_);
      --awaiting_first_;
    }
    f->last_token = now;
    ++f->tokens;
  } else {
    Outcome outcome = Outcome::Error;
    if (f->stopped_by_string || e.reason == FinishReason::Stop)
      outcome = Outcome::Stop;
    else if (e.reason == FinishReason::Length)
      outcome = Outcome::Length;
    else if (e.reason == FinishReason::Abort)
      outcome = Outcome::Abort;
    const double ttft = f->got_first ? seconds_between(f->arrival, f->first_token) : -1.0;
    const double tpot =
        f->tokens >= 2 ? seconds_between(f->first_token, f->last_token) / static_cast<double>(f->tokens - 1)
                       : -1.0;
    metrics_.record_finished(outcome, e.usage.prompt_tokens, e.usage.completion_tokens, ttft, tpot,
                             seconds_between(f->arrival, now));
    if (config_.log) {
      std::ostringstream line;
      line << "request " << e.request_id << ": " << outcome_name(outcome) << ", " << e.usage.prompt_tokens
           << " prompt + " << e.usage.completion_tokens << " generated tokens";
      if (ttft >= 0) line << ", TTFT " << ttft * 1e3 << " ms";
      if (tpot >= 0) line << ", TPOT " << tpot * 1e3 << " ms";
      if (!e.error.empty()) line << ": " << e.error;
      log_line(line.str());
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!f->got_first) --awaiting_first_;
      f->got_first = true;
      --in_flight_;
      flights_.erase(f->engine_id);
      f->engine_finished = true;
    }
    idle_cv_.notify_all();
  }
  f->queue.push(e);
}

void OpenAiServer::handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  check_auth(req);
  if (draining_) throw ApiError(503, "the server is shutting down", {}, "shutting_down");
  GenerationRequest r = parse_generation_request(req.body, endpoint);
  if (r.model != config_.model_name)
    throw ApiError(
        404, "The model `" + r.model + "` does not exist (this server serves `" + config_.model_name + "`)",
        "model", "model_not_found");
  std::vector<int32_t> prompt = prompt_ids(r);

  // The context: prompt + completion must fit (the engine's max_context, vLLM's --max-model-len).
  const int64_t context = engine_.limits().max_context;
  const auto P = static_cast<int64_t>(prompt.size());
  const char* prompt_param = endpoint == Endpoint::Completions ? "prompt" : "messages";
  if (P >= context)
    throw ApiError(400,
                   "This model's maximum context length is " + std::to_string(context) +
                       " tokens. However, your prompt has " + std::to_string(P) +
                       " tokens, which leaves no room for a completion. Please shorten the prompt.",
                   prompt_param, "context_length_exceeded");
  int64_t max_tokens = 0;
  if (r.max_tokens) {
    max_tokens = *r.max_tokens;
    // Written so that nothing overflows: P + max_tokens would for a max_tokens near 2^63 (undefined behaviour,
    // and a sum that wraps negative passes the test). The message adds them as unsigned: that fits.
    if (max_tokens > context - P)
      throw ApiError(400,
                     "This model's maximum context length is " + std::to_string(context) +
                         " tokens. However, you requested " +
                         std::to_string(static_cast<uint64_t>(P) + static_cast<uint64_t>(max_tokens)) +
                         " tokens (" +
                         std::to_string(P) + " in the prompt, " + std::to_string(max_tokens) +
                         " for the completion). Please reduce the length of the prompt or the completion.",
                     endpoint == Endpoint::Completions ? "max_tokens" : "max_completion_tokens",
                     "context_length_exceeded");
  } else {
    max_tokens =
        endpoint == Endpoint::Completions ? std::min(config_.default_max_tokens, context - P) : context - P;
  }
  if (!r.seed_given)
    r.sampling.seed = mix(seed_counter_++ ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count()));

  std::shared_ptr<Flight> f = admit(std::move(prompt), r, max_tokens);
  if (r.stream)
    respond_stream(f, res, req.version == "HTTP/1.0");
  else
    respond_whole(f, res);
}

void OpenAiServer::respond_whole(const std::shared_ptr<Flight>& f, httplib::Response& res) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++active_handlers_;
  }
  struct Done {  // the handler's share of the shutdown wait, released however it leaves
    OpenAiServer* s;
    ~Done() {
      {
        std::lock_guard<std::mutex> lock(s->mutex_);
        --s->active_handlers_;
      }
      s->idle_cv_.notify_all();
    }
  } done{this};
  // If this handler leaves early (an exception), the engine must not go on for nobody.
  struct AbortUnlessFinished {
    OpenAiServer* s;
    const Flight* f;
    ~AbortUnlessFinished() {
      if (!f->engine_finished) s->engine_.abort(f->engine_id);
    }
  } abort_guard{this, f.get()};

  const GenerationRequest& r = f->request;
  OutputText out(tokenizer_, r.stop);
  const bool with_ids = r.return_token_ids || !tokenizer_;
  std::string text;
  std::string_view finish;
  Usage usage{static_cast<int64_t>(f->prompt.size()), 0};
  for (;;) {
    const std::optional<EngineEvent> e = f->queue.pop(std::chrono::milliseconds(200));
    if (!e) continue;  // shutdown aborts through the engine: a Finished(Abort) will come
    if (e->kind == EngineEvent::Kind::Token) {
      text += out.push(e->token);
      if (out.stopped()) {  // a stop string: the rest of the generation is not wanted
        f->stopped_by_string = true;
        engine_.abort(f->engine_id);
        finish = "stop";
        usage.completion_tokens = out.tokens();
        break;
      }
      continue;
    }
    if (e->reason == FinishReason::Stop || e->reason == FinishReason::Length) {
      text += out.finish();
      finish = out.stopped() ? "stop" : finish_reason_text(e->reason);
      usage.completion_tokens = out.stopped() ? out.tokens() : e->usage.completion_tokens;
      break;
    }
    if (e->reason == FinishReason::Abort)
      throw ApiError(503, "the request was aborted: the server is shutting down", {}, "shutting_down");
    throw ApiError(500, "the engine failed this request: " + e->error, {}, "engine_error");
  }
  const std::vector<int32_t> ids(out.ids());
  const ResponseIds rid{new_response_id(r.endpoint), static_cast<int64_t>(std::time(nullptr)),
                        config_.model_name};
  res.set_content(dump(completion_response(r.endpoint, rid, text, finish, usage,
                                           with_ids ? &f->prompt : nullptr, with_ids ? &ids : nullptr)),
                  "application/json");
}

void OpenAiServer::respond_stream(const std::shared_ptr<Flight>& f, httplib::Response& res,
                                  bool close_delimited) {
  struct Stream {
    std::shared_ptr<Flight> flight;
    OutputText out;
    StreamChunks chunks;
    bool
        with_ids;  // one chunk per id, with its token_ids (return_token_ids, or no tokenizer: no text at all)
    std::string piece_chunk(const std::string& piece, int32_t id) const {
      return with_ids ? chunks.text_with_ids(piece, {id}) : chunks.text(piece);
    }
  };
  const GenerationRequest& r = f->request;
  auto st = std::make_shared<Stream>(
      Stream{f, OutputText(tokenizer_, r.stop),
             StreamChunks(r.endpoint,
                          ResponseIds{new_response_id(r.endpoint), static_cast<int64_t>(std::time(nullptr)),
                                      config_.model_name},
                          r.include_usage),
             r.return_token_ids || !tokenizer_});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++active_handlers_;
  }
  res.set_header("Cache-Control", "no-cache");
  // httplib calls the provider on this connection's thread once the headers are out; it writes the whole
  // stream in one call. A failed write means the client is gone: abort, and return false to drop the connection.
  auto provider = [this, st](size_t, httplib::DataSink& sink) {
        // Nothing may escape into httplib's worker thread (it would end the process): any failure drops the
        // connection and aborts the request.
        try {
          Flight& fl = *st->flight;
          const auto write = [&](const std::string& s) {
            return s.empty() || sink.write(s.data(), s.size());
          };
          const auto client_left = [&] {
            engine_.abort(fl.engine_id);  // its KV cache returns to the pool at the next step
            return false;
          };
          if (!write(st->chunks.start())) return client_left();
          Clock::time_point last_write = Clock::now();
          const Usage prompt_only{static_cast<int64_t>(fl.prompt.size()), 0};
          for (;;) {
            const std::optional<EngineEvent> e = fl.queue.pop(std::chrono::milliseconds(100));
            if (!e) {
              // Queued or prefilling: an SSE comment now and then finds a client that left (clients ignore it).
              if (Clock::now() - last_write > std::chrono::seconds(1)) {
                if (!write(": keep-alive\n\n")) return client_left();
                last_write = Clock::now();
              }
              continue;
            }
            last_write = Clock::now();
            if (e->kind == EngineEvent::Kind::Token) {
              const std::string piece = st->out.push(e->token);
              if (st->out.stopped()) {
                fl.stopped_by_string = true;
                engine_.abort(fl.engine_id);
                Usage u = prompt_only;
                u.completion_tokens = st->out.tokens();
                if (!write(st->piece_chunk(piece, e->token) + st->chunks.finish("stop", u))) return false;
                sink.done();
                return true;
              }
              if (!write(st->piece_chunk(piece, e->token))) return client_left();
              continue;
            }
            std::string last;
            if (e->reason == FinishReason::Stop || e->reason == FinishReason::Length) {
              last = st->chunks.text(st->out.finish());
              Usage u = prompt_only;
              u.completion_tokens = st->out.stopped() ? st->out.tokens() : e->usage.completion_tokens;
              last += st->chunks.finish(st->out.stopped() ? "stop" : finish_reason_text(e->reason), u);
            } else if (e->reason == FinishReason::Abort) {
              last = st->chunks.error(
                  ApiError(503, "the request was aborted: the server is shutting down", {}, "shutting_down"));
            } else {
              last = st->chunks.error(
                  ApiError(500, "the engine failed this request: " + e->error, {}, "engine_error"));
            }
            if (!write(last)) return false;
            sink.done();
            return true;
          }
        } catch (const std::exception& e) {
          log_line(std::string("stream of request ") + std::to_string(st->flight->engine_id) +
                   " failed: " + e.what());
          engine_.abort(st->flight->engine_id);
          return false;
        }
      };
  auto release = [this, st](bool) {
        // Called when httplib is done with the response, however it ended: the engine must not go on for nobody.
        if (!st->flight->engine_finished) engine_.abort(st->flight->engine_id);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          --active_handlers_;
        }
        idle_cv_.notify_all();
      };
  // HTTP/1.1: chunked transfer encoding. HTTP/1.0 has none (RFC 9112 forbids sending it to a 1.0 client): the
  // body ends when the connection closes, which the connection layer does after this response.
  if (close_delimited) {
    current_connection().close_after_response = true;
    res.set_content_provider("text/event-stream", std::move(provider), std::move(release));
  } else {
    res.set_chunked_content_provider("text/event-stream", std::move(provider), std::move(release));
  }
}

}  // namespace tvllm::server
