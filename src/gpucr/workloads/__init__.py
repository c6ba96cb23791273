"""Applications gpucr is exercised on: each is a plain CUDA program that knows nothing of gpucr and
speaks a line protocol (commands on stdin, one JSON object per answer on stdout), so tests, the demo
and the benchmark can drive it from outside and check its state before, during and after."""
