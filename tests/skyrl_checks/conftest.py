"""tests/skyrl_checks runs in .venv-skyrl (Python 3.12), where SkyRL 0.4.0 itself is installed.

flash-attn is there without its CUDA kernels (built with FLASH_ATTENTION_SKIP_CUDA_BUILD, one of SkyRL's own
build settings): SkyRL's model wrapper imports only its padding helpers, and its Triton entry point lets
`import flash_attn` succeed on a machine without CUDA.
"""

import os

os.environ.setdefault("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
