"""Applications gpucr is exercised on: each is a plain CUDA program that knows nothing of gpucr and
speaks a line protocol (commands on stdin, one JSON object per answer on stdout), so tests, the demo
and the benchmark can drive it from outside and check its state before, during and after."""
from __future__ import annotations

from typing import Callable, ContextManager

# Where an app's GPU data is allocated: a context manager factory (tms_app passes a
# torch_memory_saver region; by default the data goes where the allocator puts it).
Place = Callable[[], ContextManager[object]]
