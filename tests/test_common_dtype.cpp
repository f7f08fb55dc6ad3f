#include <gtest/gtest.h>
#include "common/dtype.h"
TEST(Dtype, Placeholder) { EXPECT_EQ(tvllm::dtype_size(tvllm::DType::BF16), 2u); }
