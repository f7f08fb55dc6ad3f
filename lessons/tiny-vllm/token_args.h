// Token-level arguments shared by tokenize, detokenize, generate and chat (implemented in tokenize.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer.h"

namespace tvllm::cli {

// --tokenizer FILE or --model DIR (DIR/tokenizer.json): exactly one. InputError otherwise.
Tokenizer load_tokenizer(const std::string& tokenizer_file, const std::string& model_dir);

// Token ids typed by a user: "1 2 3", "1,2,3" or "[1, 2, 3]". InputError naming `what` and the bad entry.
std::vector<int32_t> parse_ids(std::string_view text, const std::string& what);

}  // namespace tvllm::cli
