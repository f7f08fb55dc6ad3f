// Lesson 13: what server.cpp (start, stop, routes) and server_generate.cpp (generation requests: admission,
// the token stream, whole and streamed responses) share. Private to the server; not part of its API.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "server.h"

namespace tvllm::server {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline std::string dump(const OrderedJson& j) {
  return j.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

// SplitMix64: a seed for a request that brought none (sampled requests differ from each other, as at OpenAI).
inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One admitted request: what the handler thread and the engine thread share.
struct OpenAiServer::Flight {
  int64_t engine_id = -1;
  GenerationRequest request;
  std::vector<int32_t> prompt;
  EventQueue queue;  // the engine thread pushes, the handler pops
  Clock::time_point arrival;
  std::atomic<bool> stopped_by_string{false};  // the handler matched a stop string and aborted the rest
  std::atomic<bool> engine_finished{false};    // the Finished event was delivered
  // Engine thread only (on_event).
  bool got_first = false;
  int64_t tokens = 0;
  Clock::time_point first_token, last_token;
};

}  // namespace tvllm::server
