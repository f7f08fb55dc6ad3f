// lesson14_performance: placeholder until the lesson executable lands.
#include "common/lesson.h"

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson14_performance", "Decode at the memory roofline");
  return cli.run(argc, argv, [](const tvllm::LessonOptions&) { return tvllm::kExitPass; });
}
