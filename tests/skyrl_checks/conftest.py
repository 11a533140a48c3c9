"""tests/skyrl_checks runs in .venv-skyrl (Python 3.12), where SkyRL 0.4.0 itself is installed.

flash-attn is there without its CUDA kernels (built with FLASH_ATTENTION_SKIP_CUDA_BUILD, one of SkyRL's own
build settings): SkyRL's model wrapper imports only its padding helpers, and its Triton entry point lets
`import flash_attn` succeed on a machine without CUDA.
"""

import os

import pytest

from shared.net import free_port

os.environ.setdefault("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")


@pytest.fixture(scope="module")
def one_process_group():
    """A one-process gloo group, in which SkyRL's writers (rank 0 of 1) run as on the cluster."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
