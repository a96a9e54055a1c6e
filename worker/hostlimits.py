"""What one host can carry, as its processes see it: CPU cores, available memory, the open-file limit.

The controller checks a local mesh against its own host's (monarch_jupyter.kernel.launch.capacity); a host agent
measures its host's when it starts and sends them in its ``AgentHello``, so that ``%mesh scale`` can place new
ranks on hosts that have room (monarch_jupyter.kernel.launch.placement)."""

from __future__ import annotations

import os
import resource

__all__ = ["host_limits"]


def host_limits() -> tuple[int, int, int]:
    """(CPU cores this process may use, bytes of memory available (0: unknown), the soft limit of open files per
    process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:  # not Linux: no memory check
        pass
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return cores, available, files if files != resource.RLIM_INFINITY else 1 << 30
