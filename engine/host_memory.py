"""How much host memory a new allocation can get: RAM, the memory cgroup's limit and RLIMIT_AS
(what the planner's checks and a fine-tune's delta are held against)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

HOST_MEMORY_CHECK_ENV = "MEGASLIDE_HOST_MEMORY_CHECK"


def available_ram_bytes() -> int:
    """RAM available to a new allocation without swapping (Linux `MemAvailable`; elsewhere the
    physical RAM)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_available() -> tuple[int, str]:
    """Host bytes a new allocation can get, and the limit that bounds it: the least of the RAM
    available (`MemAvailable`), what the process's memory cgroup has left (a container's limit,
    its reclaimable page cache counted as free) and what RLIMIT_AS leaves of the address space.
    """
    limits = {"MemAvailable": available_ram_bytes()}
    cgroup = _cgroup_memory_left()
    if cgroup is not None:
        limits["the memory cgroup's limit"] = cgroup
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits["RLIMIT_AS"] = max(0, soft - _address_space_used())
    bound = min(limits, key=limits.get)
    return limits[bound], bound


def _cgroup_memory_left() -> int | None:
    """Limit minus usage (less the inactive page cache, which the kernel reclaims first) of the
    memory cgroup this process is in, v2 or v1; None without a limit."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        root = Path("/sys/fs/cgroup")
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        # v2 says "max"; v1 says a number near 2**63 (rounded down to pages) for no limit.
        if limit == "max" or int(limit) >= 2**62:
            return None
        stat = (root / limit_file).with_name("memory.stat")
        inactive = 0
        try:
            for line in stat.read_text().splitlines():
                key, value = line.split()
                if key in ("inactive_file", "total_inactive_file"):
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + inactive)
    return None


def _address_space_used() -> int:
    """This process's virtual address space in bytes (what RLIMIT_AS counts)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
