// Lesson 14: the small-batch GEMV (placeholder until the kernel lands).
