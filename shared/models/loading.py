"""Loading a VLM checkpoint and its LoRA adapters: what every engine and the trainer start from.

The same code loads the tiny Qwen3-VL and Qwen3-VL-8B (`AutoProcessor` + `AutoModelForImageTextToText`);
nothing here special-cases the tiny model. See docs/trainer.md and docs/evaluator.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.models import ModelLoadError, check_adapter_dir, check_model_dir
from shared.storage.manifest import ManifestError, verify_manifest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Returns (model, processor) from an HF checkpoint folder; ModelLoadError says what is wrong."""
    model_dir = check_model_dir(model_dir)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if (model_dir / "manifest.json").exists():
        try:
            verify_manifest(model_dir)
        except ManifestError as exc:
            raise ModelLoadError(f"model at {model_dir} is corrupt: {exc}") from None
    try:  # transformers says what is missing (a processor's or the weights' file) in an OSError
        processor = AutoProcessor.from_pretrained(model_dir)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device)
    except OSError as exc:
        raise ModelLoadError(f"cannot load the model at {model_dir}: {exc}") from None
    processor.tokenizer.padding_side = "left"
    model.eval()
    return model, processor


def lora_target_regex(modules: list[str], language_model_only: bool = True) -> str:
    """Returns peft's target_modules regex: the named linear layers, in the language model only by default."""
    names = "|".join(modules)
    scope = r".*language_model.*\." if language_model_only else r".*\."
    return rf"{scope}({names})"


def attach_adapter(model, adapter_dir: str | Path, trainable: bool = False):
    """Returns the model wrapped with the LoRA adapter in adapter_dir (validated first)."""
    from peft import PeftModel

    adapter_dir = check_adapter_dir(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    try:
        json.loads(config_path.read_text())
        from safetensors import safe_open

        with safe_open(str(weights_path), "pt") as handle:
            list(handle.keys())
    except Exception as exc:
        raise ModelLoadError(f"adapter at {adapter_dir} is corrupt ({exc}); re-export it") from None
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


class MergedCopy:
    """A plain copy of a PEFT model's base for inference, whose LoRA-targeted weights hold base + the adapter's delta.

    Its outputs are PEFT's unmerged LoRA's (to float rounding) at the base model's speed: PEFT computes each
    adapted layer as two extra matmuls plus Python around every module, about 1.5x slower on the tiny model.
    `refresh()` copies the adapter's current weights in (after an update or a load), `refresh(enabled=False)`
    the base alone."""

    def __init__(self, peft_model):
        import copy

        self.peft_model = peft_model
        self.model = copy.deepcopy(peft_model).merge_and_unload()
        self.model.eval()
        modules = dict(self.model.named_modules())
        self.layers = [(layer, modules[name.removeprefix("base_model.model.")])
                       for name, layer in peft_model.named_modules() if hasattr(layer, "get_delta_weight")]

    @torch.no_grad()
    def refresh(self, enabled: bool = True) -> None:
        for layer, target in self.layers:
            weight = layer.base_layer.weight
            if enabled:
                weight = weight + sum(layer.get_delta_weight(name) for name in layer.active_adapters
                                      if name in layer.lora_A)
            target.weight.copy_(weight)
