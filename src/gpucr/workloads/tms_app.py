"""A workload whose GPU data lives in a torch_memory_saver region, the peer `gpucr bench` compares
gpucr with: the raw buffer of raw_app, or the weights and KV cache of llm_app, allocated inside one
region with CPU backup, which the app itself pauses and resumes when asked.

    python3 -m gpucr.workloads.tms_app raw_app --gib 30
    python3 -m gpucr.workloads.tms_app llm_app llama3-8b --gpu-util 0.5
    python3 -m gpucr.workloads.tms_app --probe     # the preload library to start it with, or why not

torch_memory_saver (0.0.10) runs in its default hook mode, "preload", as sglang starts it: the
process must be started with its hook library in LD_PRELOAD (`--probe` names it), which catches
the cudaMalloc calls made inside a region and backs them with cuMemCreate/cuMemMap. Its pause
copies each allocation to a pinned host buffer (cudaMemcpy) and unmaps it, keeping the virtual
addresses; its resume maps new memory there and copies back. The CPU backup is kept between cycles
(retain_cpu_backup), as gpucr keeps its staging, so only the first pause pays for pinning it.

Commands: those of the app, and tms_pause | tms_resume (each answers the seconds it took inside the
app and the region's bytes); while paused only tms_resume and info are served, since the region's
addresses are unmapped.

torch and torch_memory_saver are imported where they are used: this module imports without them.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import time
from typing import Any, Callable, Iterator

TAG = "gpucr-bench"
PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"
APPS = ("raw_app", "llm_app")


def probe() -> dict[str, str]:
    """The hook library this host's torch needs in LD_PRELOAD, and the package's version; raises
    ImportError (or RuntimeError, when no build matches torch's CUDA) when it cannot run here."""
    from torch_memory_saver.utils import get_binary_path_from_package
    return {"preload": str(get_binary_path_from_package(PRELOAD_STEM)),
            "version": importlib.metadata.version("torch_memory_saver")}


class Saver:
    """torch_memory_saver's singleton, one region (TAG) with CPU backup, pause and resume timed."""

    def __init__(self) -> None:
        import torch
        from torch_memory_saver import torch_memory_saver
        self.torch, self.tms = torch, torch_memory_saver
        self.tms.retain_cpu_backup = True   # also checks that its hook library is preloaded
        self.paused = False
        self.nbytes = 0                     # the region's, once the app is built in it

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        with self.tms.region(tag=TAG, enable_cpu_backup=True):
            yield

    def measure(self) -> int:
        """What a pause copies and unmaps: the segments of the region's memory pool (torch's
        allocator asked the hook for each one; the default pool's id is (0, 0), and this process
        makes no other pool). Fixed once the app is built: nothing is allocated in it after."""
        self.nbytes = sum(s["total_size"] for s in self.torch.cuda.memory_snapshot()
                          if tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0))
        return self.nbytes

    def _timed(self, act: Callable[[str], None], paused: bool) -> dict[str, Any]:
        if self.paused == paused:
            raise RuntimeError(f"the region is {'paused' if paused else 'resumed'} already")
        self.torch.cuda.synchronize()     # the app's own work is not part of the pause
        t0 = time.perf_counter()
        act(TAG)
        self.torch.cuda.synchronize()     # done when every copy has landed
        s = time.perf_counter() - t0
        self.paused = paused
        return {"seconds": s, "bytes": self.nbytes}

    def describe(self) -> dict[str, Any]:
        return {"region_bytes": self.nbytes, "region_paused": self.paused,
                "tms_version": importlib.metadata.version("torch_memory_saver")}

    def pause(self) -> dict[str, Any]:
        return self._timed(self.tms.pause, True)

    def resume(self) -> dict[str, Any]:
        return self._timed(self.tms.resume, False)


def serve_with(saver: Saver, handle: Callable[[list[str]], dict]) -> Callable[[list[str]], dict]:
    """The app's handler with the pause verbs added and the region told in info, refusing what
    would touch unmapped memory."""
    def tms_handle(words: list[str]) -> dict:
        if words[0] == "tms_pause":
            return saver.pause()
        if words[0] == "tms_resume":
            return saver.resume()
        if words[0] == "info":
            return {**handle(words), **saver.describe()}
        if saver.paused:
            raise RuntimeError(f"'{words[0]}' while the region is paused: send tms_resume first")
        return handle(words)
    return tms_handle


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--probe"]:
        try:
            print(json.dumps(probe()))
        except (ImportError, RuntimeError) as exc:
            sys.exit(f"{type(exc).__name__}: {exc}")
        return
    if not argv or argv[0] not in APPS:
        sys.exit(f"usage: python3 -m gpucr.workloads.tms_app {{{','.join(APPS)}}} ARGS... | --probe")
    from . import llm_app, raw_app
    from .protocol import serve
    app = {"raw_app": raw_app, "llm_app": llm_app}[argv[0]]
    a = app.parser().parse_args(argv[1:])
    saver = Saver()
    handle, ready = app.build(a, place=saver.region)
    saver.measure()
    serve(serve_with(saver, handle), {**ready, **saver.describe()})


if __name__ == "__main__":
    main()
