"""Thread safety of the agent, under ThreadSanitizer on simcuda: many application threads allocate,
free, use their own VMM memory and ask for status while a controller runs checkpoint/restore cycles.
scripts/tsan-build builds the agent, simcuda and the stress app (tests/apps/stress_app.c) with
-fsanitize=thread; ThreadSanitizer's report of any data race or lock-order inversion fails the test."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

import gpucr

ROOT = Path(__file__).resolve().parent.parent
NOT_BUILDABLE = 3   # scripts/tsan-build: this compiler cannot build with -fsanitize=thread


@pytest.fixture(scope="module")
def tsan_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tsan")
    r = subprocess.run([str(ROOT / "scripts" / "tsan-build"), str(out)], capture_output=True, text=True)
    if r.returncode == NOT_BUILDABLE:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _stderr_reader(proc: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


def test_threads_allocating_freeing_and_asking_status_during_cycles(tsan_build):
    env = dict(os.environ, LD_PRELOAD=str(tsan_build / "libgpucr.so"),
               TSAN_OPTIONS="halt_on_error=0 exitcode=0 second_deadlock_stack=1 report_signal_unsafe=0")
    proc = subprocess.Popen([str(tsan_build / "stress_app")], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = _stderr_reader(proc)
    try:
        assert proc.stdout.readline().strip() == "READY", "".join(err)
        for _ in range(6):
            gpucr.checkpoint(proc.pid, timeout=60)
            gpucr.restore(proc.pid, timeout=60)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        verdict = proc.stdout.readline().split()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = "".join(err)
    assert "WARNING: ThreadSanitizer" not in report, _races(report)
    assert verdict and verdict[0] == "OK", f"{verdict}\n{report[-4000:]}"
    assert int(verdict[1]) > 0 and int(verdict[2]) > 0, "the threads allocated and asked for status during the cycles"


def _races(report: str) -> str:
    """Each ThreadSanitizer warning's title and summary line, then the first report in full."""
    lines = [l for l in report.splitlines() if l.startswith(("WARNING: ThreadSanitizer", "SUMMARY: ThreadSanitizer"))]
    first = report[report.find("WARNING: ThreadSanitizer"):]
    return "\n".join(lines) + "\n\n" + first[:6000]
