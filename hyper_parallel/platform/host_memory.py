"""Host memory statistics: what ``memory_stats`` means on a CPU backend."""

from __future__ import annotations

import os
import resource

from hyper_parallel.platform.contract.common import MemoryStats


def rss_bytes() -> int:
    """The resident set size of this process now, in bytes (from ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The peak resident set size of this process so far, in bytes.

    Linux reports ``ru_maxrss`` in KiB and updates it lazily, so it can trail the
    current RSS for a moment; the larger of the two is the peak.
    """
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes())


def host_memory_stats() -> MemoryStats:
    """``Platform.memory_stats`` of a CPU backend: the resident set size now and its peak."""
    allocated = rss_bytes()
    return MemoryStats(allocated=allocated, peak=max(peak_rss_bytes(), allocated))
