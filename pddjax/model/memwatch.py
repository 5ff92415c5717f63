"""Peak host memory of a stretch of code (a model load), sampled from /proc/self/status.

RssAnon is the process's own memory (numpy arrays); RssFile counts the memory-mapped file pages
it touched (safetensors are read through mmap), which the kernel can drop at will. Both are
sampled every few milliseconds on a daemon thread; off Linux only ru_maxrss is known.
"""

from __future__ import annotations

import resource
import sys
import threading

MB = 1 << 20


def sample() -> dict[str, int]:
    """{"anon": bytes, "file": bytes} now (zeros where /proc is not there)."""
    out = {"anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    out["anon" if line.startswith("RssAnon") else "file"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class PeakMemory:
    """`with PeakMemory() as m: ...`, then m.summary(): MB before and at the peak."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.before = self.peak = sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pddjax-memwatch", daemon=True)

    def _take(self) -> None:
        now = sample()
        self.peak = {k: max(self.peak[k], now[k]) for k in now}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def __enter__(self) -> PeakMemory:
        self.before = self.peak = sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def summary(self) -> dict[str, float]:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        maxrss_b = maxrss if sys.platform == "darwin" else maxrss * 1024
        return {"anon_before_mb": round(self.before["anon"] / MB, 1), "anon_peak_mb": round(self.peak["anon"] / MB, 1),
                "file_peak_mb": round(self.peak["file"] / MB, 1),
                "process_max_rss_mb": round(maxrss_b / MB, 1)}
