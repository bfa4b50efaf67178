"""This process's memory as Linux reports it (/proc/self), for the memory benchmarks: resident bytes now and at peak,
measured after handing freed heap memory back, so that memory freed earlier cannot hide a rise."""
from __future__ import annotations

import ctypes


def status(key: str) -> int:
    """A /proc/self/status entry in bytes (VmRSS: resident now, VmHWM: peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def resident() -> int:
    """Resident bytes after returning freed heap memory to the system."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status("VmRSS")


def reset_peak() -> int:
    """``resident()``, with the peak resident size reset to it (Linux >= 4.0): VmHWM then measures from here."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
