// The BPE model: one pre-token ("word") in, its token ids out.
//
//   "lower" -> symbols  l o w e r              one per character (byte-level: one per byte)
//   merges, by rank:    (l,o)=3 (lo,w)=7 (e,r)=2 ...
//   apply the best-ranked adjacent pair, again and again:
//     l o w e r  ->  l o w er  ->  lo w er  ->  low er  ->  (no pair left with a merge)  -> [low, er]
//
// The order matters: Hugging Face applies the pair with the LOWEST rank first and, among equal ranks, the
// leftmost one. A priority queue of candidate pairs over a linked list of symbols does that in
// O(n log n): each merge is O(1) in the list and pushes at most two new candidates. (Rescanning the whole
// word for the best pair after every merge is O(n^2): fine for a word of 10 characters, minutes for the
// 100 KB "word" a tokenizer without a pre-tokenizer, Llama 2's, hands the model.)
#include <queue>
#include <string>
#include <string_view>
#include <vector>

#include "common/exercise.h"
#include "tokenizer_internal.h"

namespace tvllm::tok {

namespace {
constexpr size_t kCacheCapacity = 10000;  // words, as HF's BPE cache
constexpr size_t kCachedWordBytes = 256;  // longer words are rare and would fill the cache with one-offs
}  // namespace

void bpe_merge(std::vector<BpeSymbol>& symbols, const MergeMap& merges) {
  // --- exercise 09.2: the merge loop ----------------------------------------------------------------------
  // Task: merge adjacent symbols until no adjacent pair is in `merges`, always applying the pair with the
  //   lowest rank and, among equal ranks, the leftmost one. A merge keeps the left symbol (its id becomes
  //   the merge's new_id), marks the right one removed and unlinks it (prev/next). Do it in O(n log n):
  //   a priority queue of candidates {rank, position of the left symbol, new_id}.
  // Hint: pair_key(left_id, right_id) is the key into `merges`.
  // Hint: a candidate can go stale (its left symbol was removed, or merged into something else, or its
  //   right neighbour changed). When you pop one, look the pair up again and skip it unless it still gives
  //   the same new_id.
  // Hint: after a merge at position p, two new pairs may exist: (prev of p, p) and (p, next of p).
  // Tests: TokenizerBpe.* TokenizerCases.* TokenizerBundled.* TokenizerJson.TheValidOneLoadsAndWorks
  // Tests: lesson09_tokenizer_sampling.cpu
  // Stub:
  //   (void)symbols;
  //   (void)merges;
  //   throw NotWrittenYet("09.2", "the merge loop");
  // --- solution ---
  struct Candidate {
    int32_t rank, pos, new_id;
  };
  // std::priority_queue pops the LARGEST: "a after b" when a has the higher rank, or the same rank further right.
  auto after = [](const Candidate& a, const Candidate& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(after)> queue(after);
  auto push_pair = [&](int32_t pos) {
    const int32_t right = symbols[pos].next;
    if (right < 0) return;
    auto it = merges.find(pair_key(symbols[pos].id, symbols[right].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    BpeSymbol& left = symbols[top.pos];
    if (left.removed || left.next < 0) continue;
    BpeSymbol& right = symbols[left.next];
    auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;  // stale: the pair changed
    left.id = top.new_id;
    right.removed = true;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  // --- end of exercise 09.2 ---
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  std::vector<BpeSymbol> symbols;
  symbols.reserve(word.size());
  auto add = [&](int32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, -1});
    if (n > 0) symbols[n - 1].next = n;
  };
  // An unknown character becomes unk_token; with fuse_unk a run of them becomes one. HF holds the pending
  // unk back until the next known character, so byte-fallback tokens in between come first (kept as is).
  bool unk_pending = false;
  std::string ch;
  for (size_t i = 0; i < word.size();) {
    int len;
    utf8_decode_at(word, i, &len);
    ch.assign(word.data() + i, len);
    i += len;
    if (auto it = vocab.find(ch); it != vocab.end()) {
      if (unk_pending) add(unk_id), unk_pending = false;
      add(it->second);
      continue;
    }
    if (byte_fallback) {  // "€" not in the vocabulary -> <0xE2> <0x82> <0xAC>
      bool all = true;
      for (unsigned char b : ch) all = all && byte_tokens[b] >= 0;
      if (all) {
        for (unsigned char b : ch) add(byte_tokens[b]);
        continue;
      }
    }
    if (unk_id >= 0) {
      if (unk_pending && !fuse_unk) add(unk_id);
      unk_pending = true;
    }  // no unk_token: HF drops the character
  }
  if (unk_pending) add(unk_id);

  bpe_merge(symbols, merges);
  std::vector<int32_t> ids;
  for (const BpeSymbol& s : symbols)
    if (!s.removed) ids.push_back(s.id);
  return ids;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {  // Llama 3: a word that is a token is that token, whatever the merges would give
    if (auto it = vocab.find(std::string(word)); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCachedWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto it = cache_.find(std::string(word)); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(ids));
  }
}

}  // namespace tvllm::tok
