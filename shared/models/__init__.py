"""The policy model: building the tiny Qwen3-VL, loading models and adapters, generating replies.

This package's own module is light (no torch): a command checks the folders it was given here, so a wrong path
answers in a second, not after the seconds torch and transformers take to import."""

from __future__ import annotations

from pathlib import Path

# The environment of a vLLM engine on CPU (the server's app with server.accelerator=cpu, the rollout engine). vLLM runs
# the model eagerly once LoRA is on, but its sampler still wraps two helpers in torch.compile (a sampled token's rank
# for `logprobs`, sampling without a seed): the first requests that need them compile C++ with TorchInductor, 16.5
# CPU-seconds and 16 s on a fresh machine here against 0.16 s eager (docs/experiments.md), the same logprobs. Eager,
# each is one comparison or one argmax over the vocabulary.
VLLM_CPU_ENV = {"TORCHDYNAMO_DISABLE": "1"}


class ModelLoadError(RuntimeError):
    """A model or adapter folder that cannot be used, with what to do about it."""


def check_model_dir(model_dir: str | Path) -> Path:
    """Returns model_dir as a Path; ModelLoadError unless it holds an HF checkpoint's config.json."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ModelLoadError(
            f"no model at {model_dir} (config.json missing): build it with `make tiny-model`/`make sft`, "
            "or point model.path at an HF checkpoint on the shared volume"
        )
    return model_dir


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """Returns adapter_dir as a Path; ModelLoadError unless it holds a LoRA export's config and weights."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").exists() or not (adapter_dir / "adapter_model.safetensors").exists():
        raise ModelLoadError(f"no LoRA adapter at {adapter_dir}: expected adapter_config.json and adapter_model.safetensors")
    return adapter_dir
