"""What one host can carry, as its processes see it: CPU cores, available memory, the open-file limit, GPUs.

The controller checks a local mesh against its own host's (monarch_jupyter.kernel.launch.capacity); a host agent
measures its host's when it starts and sends them in its ``AgentHello``, so that ``%mesh scale`` can place new
ranks on hosts that have room (monarch_jupyter.kernel.launch.placement)."""

from __future__ import annotations

import glob
import os
import re
import resource

__all__ = ["host_limits", "visible_gpus"]


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


def visible_gpus() -> int:
    """CUDA devices a process on this host may use, seen without importing torch: the entries of
    ``CUDA_VISIBLE_DEVICES`` up to the first invalid one (CUDA's own rule: ``-1`` or an empty value hides every
    device), else the ``/dev/nvidiaN`` device files (0 without NVIDIA's driver)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        n = 0
        for entry in env.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            n += 1
        return n
    return sum(1 for path in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", path))
