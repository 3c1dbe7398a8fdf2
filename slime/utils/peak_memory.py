"""The peak resident memory of this process during a block: `with PeakRSS() as m: ...`, then `m.rise` in bytes
(exact where /proc/self/clear_refs resets the high-water mark, else sampled every 2 ms)."""

from __future__ import annotations

import threading


class PeakRSS:
    def __enter__(self) -> "PeakRSS":
        import psutil

        self._proc = psutil.Process()
        self.exact = _reset_hwm()
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = None
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.exact:
            self.peak = max(self.peak, _status_bytes("VmHWM"))
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.rise = self.peak - self.start


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") > 0
