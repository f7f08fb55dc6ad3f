// Test helpers for lesson 13: a few calls of cpp-httplib's client that speak to the server as a real client does
// (JSON bodies, server-sent events read as they arrive). Header-only; used by tests/test_13_*.cpp.
#pragma once

#include <httplib.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tvllm::testing_http {

using nlohmann::json;

struct Reply {
  int status = 0;  // 0: no answer (connection refused, reset)
  std::string body;
  json j;  // the body parsed (discarded when it is not JSON)
  std::string error;
};

inline Reply to_reply(const httplib::Result& r) {
  Reply out;
  if (!r) {
    out.error = httplib::to_string(r.error());
    return out;
  }
  out.status = r->status;
  out.body = r->body;
  out.j = json::parse(r->body, nullptr, false);
  return out;
}

inline httplib::Client client(int port, int read_timeout_s = 60) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(read_timeout_s);
  return c;
}

inline Reply post(int port, const std::string& path, const std::string& body,
                  const httplib::Headers& headers = {}) {
  httplib::Client c = client(port);
  return to_reply(c.Post(path, headers, body, "application/json"));
}
inline Reply post(int port, const std::string& path, const json& body, const httplib::Headers& headers = {}) {
  return post(port, path, body.dump(), headers);
}
inline Reply get(int port, const std::string& path, const httplib::Headers& headers = {}) {
  httplib::Client c = client(port);
  return to_reply(c.Get(path, headers));
}

// A streamed response, event by event.
struct Stream {
  int status = 0;
  std::string error;             // connection-level
  std::vector<json> chunks;      // every "data: {...}" event, parsed, in order
  std::vector<std::string> raw;  // every event as sent (comments included)
  bool done = false;             // "data: [DONE]" came, as the last event
  bool bad_framing = false;      // an event after [DONE], or a data line that is not JSON
  std::string body;              // for an error status: the JSON error body
  std::chrono::steady_clock::time_point first_text;

  // The text of the stream: choices[0].text (completions) or choices[0].delta.content (chat), joined.
  std::string text() const {
    std::string t;
    for (const json& c : chunks) {
      if (!c.contains("choices") || c["choices"].empty()) continue;
      const json& ch = c["choices"][0];
      if (ch.contains("text")) t += ch["text"].get<std::string>();
      if (ch.contains("delta") && ch["delta"].contains("content") && ch["delta"]["content"].is_string())
        t += ch["delta"]["content"].get<std::string>();
    }
    return t;
  }
  std::string finish_reason() const {
    for (const json& c : chunks)
      if (c.contains("choices") && !c["choices"].empty() && !c["choices"][0]["finish_reason"].is_null())
        return c["choices"][0]["finish_reason"].get<std::string>();
    return "";
  }
  const json* usage_chunk() const {
    for (const json& c : chunks)
      if (c.contains("usage") && c["usage"].is_object()) return &c;
    return nullptr;
  }
  const json* error_chunk() const {
    for (const json& c : chunks)
      if (c.contains("error")) return &c;
    return nullptr;
  }
};

// POSTs with "stream": true. on_event (optional) sees each event; returning false drops the connection there
// (a client that leaves mid-stream).
inline Stream post_stream(int port, const std::string& path, json body,
                          const std::function<bool(const Stream&)>& on_event = {},
                          const httplib::Headers& headers = {}) {
  body["stream"] = true;
  Stream s;
  std::string buffer;
  httplib::Client c = client(port);
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = headers;
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (s.body.size() < 65536) s.body.append(data, n);
    buffer.append(data, n);
    for (size_t pos; (pos = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, pos);
      buffer.erase(0, pos + 2);
      s.raw.push_back(event);
      if (event.rfind("data: ", 0) != 0) continue;  // an SSE comment (keep-alive)
      if (s.done) s.bad_framing = true;
      const std::string d = event.substr(6);
      if (d == "[DONE]") {
        s.done = true;
        continue;
      }
      json j = json::parse(d, nullptr, false);
      if (j.is_discarded()) {
        s.bad_framing = true;
        continue;
      }
      if (s.first_text == std::chrono::steady_clock::time_point{})
        s.first_text = std::chrono::steady_clock::now();
      s.chunks.push_back(std::move(j));
      if (on_event && !on_event(s)) return false;
    }
    return true;
  };
  const httplib::Result r = c.send(req);
  if (r) {
    s.status = r->status;
  } else {
    s.error = httplib::to_string(r.error());
  }
  return s;
}

}  // namespace tvllm::testing_http
