"""vllm-env's last install step: imports what the vLLM server imports, then fills vLLM's model-info cache.

    .venv-vllm/bin/python envs/vllm-cpu/check.py

The imports fail here, not at a server's start, when the venv is broken, and they write the bytecode every later
vLLM process reads. The cache: each engine start asks vLLM's model registry what the model's class supports, and on
a miss vLLM answers in a new process that imports vLLM again (about 11 CPU-seconds here; the vLLM tests' two servers
start together, so a fresh machine paid it twice). It runs the class inspection in another process only so that
the caller never initializes CUDA, which a CPU build never does, so this process answers it itself (about 1
CPU-second), into the cache file vLLM writes (VLLM_CACHE_ROOT/modelinfos, keyed by the model module's hash: a
vLLM upgrade makes it stale, and vLLM then inspects again).
"""

import sys

import ray.serve.llm  # noqa: F401
import torchvision  # noqa: F401
import vllm  # noqa: F401
from vllm.model_executor.models import registry

ARCHITECTURE = "Qwen3VLForConditionalGeneration"  # the tiny model's and Qwen3-VL-8B's


def main() -> None:
    model = registry.ModelRegistry.models.get(ARCHITECTURE)
    if model is None:
        sys.exit(f"error: this vLLM ({vllm.__version__}) does not register {ARCHITECTURE}: the served model needs it")
    in_a_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda inspect: inspect()
    try:
        model.inspect_model_cls()
    finally:
        registry._run_in_subprocess = in_a_subprocess

    def miss(_):
        raise RuntimeError("missed")

    registry._run_in_subprocess = miss  # what a server's start does next: read it back
    try:
        model.inspect_model_cls()
    except RuntimeError:
        print(f"warning: vLLM did not read back its model-info cache for {ARCHITECTURE} (is VLLM_CACHE_ROOT writable?): "
              "each engine start inspects it again", file=sys.stderr)
    finally:
        registry._run_in_subprocess = in_a_subprocess


if __name__ == "__main__":
    main()
