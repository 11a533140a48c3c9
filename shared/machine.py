"""What machine a result came from: CPU model and vector width, torch and its math library, threads.

Floating-point results are bitwise reproducible on the same machine type; another CPU type runs the same code on
the same data in the same order, but its vector units round differently, so its numbers differ. Every run and
evaluation records this beside its results so a reader can tell which case they are in. An evaluation through an
endpoint records the server's address and this client's `host_info()` (services/evaluator): its numbers are the
server's, and the client needs no torch.
"""

from __future__ import annotations

import os
import platform
import re
from functools import lru_cache


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict:
    """Returns {cpu, cores, python, platform}: this machine without torch."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


@lru_cache(maxsize=1)
def machine_info() -> dict:
    """Returns host_info() with {cpu_capability, threads, torch, math_library}: what this process's torch computes on."""
    import torch

    parallel = torch.__config__.parallel_info()
    library = re.search(r"^(Intel\(R\) oneAPI Math Kernel Library Version [^\n]*?)(?: for |\n)", parallel, re.M)
    return {
        **host_info(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the widest vector ISA torch's kernels use
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "math_library": library.group(1) if library else ("MKL" if torch.backends.mkl.is_available() else "none"),
    }
