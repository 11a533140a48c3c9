"""Loading a VLM checkpoint and running it: batched generation, and the tensors training needs.

The same code loads the tiny Qwen3-VL and Qwen3-VL-8B (`AutoProcessor` + `AutoModelForImageTextToText`);
nothing here special-cases the tiny model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.models.chat import ASSISTANT_HEADER, END_OF_TURN, images_of, limit_context
from shared.storage import ManifestError, verify_manifest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model or adapter folder that cannot be used, with what to do about it."""


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Returns (model, processor) from an HF checkpoint folder; ModelLoadError says what is wrong."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ModelLoadError(
            f"no model at {model_dir} (config.json missing): build it with `make tiny-model`/`make sft`, "
            "or point model.path at an HF checkpoint on the shared volume"
        )
    if (model_dir / "manifest.json").exists():
        try:
            verify_manifest(model_dir)
        except ManifestError as exc:
            raise ModelLoadError(f"model at {model_dir} is corrupt: {exc}") from None
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device)
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

    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    if not config_path.exists() or not weights_path.exists():
        raise ModelLoadError(f"no LoRA adapter at {adapter_dir}: expected adapter_config.json and adapter_model.safetensors")
    try:
        json.loads(config_path.read_text())
        from safetensors import safe_open

        with safe_open(str(weights_path), "pt") as handle:
            list(handle.keys())
    except Exception as exc:
        raise ModelLoadError(f"adapter at {adapter_dir} is corrupt ({exc}); re-export it") from None
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


@dataclass
class Completion:
    """One generated reply: its text, its token ids (end-of-turn included) and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # set by remote engines when this one request failed after retries


class LocalEngine:
    """A model in this process that answers batches of conversations (the episode runner's engine)."""

    def __init__(self, model, processor, max_images_in_context: int = 1, name: str = "local", adapter: str | None = None,
                 max_turns_in_context: int | None = None):
        self.model = model
        self.processor = processor
        self.max_images = max_images_in_context
        self.max_turns = max_turns_in_context
        self.name = name
        self.adapter = adapter
        tokenizer = processor.tokenizer
        self.stop_ids = [tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        # A reply must never contain vision placeholders: an <|image_pad|> in a reply would shift every image
        # feature of the training batch that replays it ("Image features and image tokens do not match").
        vision = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        self.suppress_ids = [i for i in (tokenizer.convert_tokens_to_ids(t) for t in vision)
                             if i is not None and i != tokenizer.unk_token_id]

    @classmethod
    def from_dir(cls, model_dir, adapter_dir=None, dtype="float32", max_images_in_context=1, device="cpu",
                 max_turns_in_context=None):
        model, processor = load_model(model_dir, dtype, device)
        if adapter_dir:
            model = attach_adapter(model, adapter_dir)
            model.eval()
        return cls(model, processor, max_images_in_context, name=str(model_dir),
                   adapter=str(adapter_dir) if adapter_dir else None, max_turns_in_context=max_turns_in_context)

    @classmethod
    def from_config(cls, cfg, model_dir, adapter_dir=None, device="cpu"):
        """Returns an engine for model_dir (+ adapter) with the profile's dtype and context limits."""
        return cls.from_dir(model_dir, adapter_dir, cfg.model.dtype, cfg.model.max_images_in_context, device,
                            cfg.model.max_turns_in_context)

    @classmethod
    def for_model(cls, cfg, model, processor, name: str, adapter: str | None = None):
        """Returns an engine around an already-loaded model, with the profile's context limits."""
        return cls(model, processor, cfg.model.max_images_in_context, name=name, adapter=adapter,
                   max_turns_in_context=cfg.model.max_turns_in_context)

    def prompt(self, messages: list[dict]) -> tuple[str, list]:
        """Returns (prompt text, images) exactly as the model sees a conversation before it replies."""
        messages = limit_context(messages, self.max_images, self.max_turns)
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, images_of(messages)

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 24,
                 seed: int | None = None) -> list[Completion]:
        """Returns one Completion per conversation, generated as one left-padded batch."""
        if not conversations:
            return []
        texts, images = [], []
        for messages in conversations:
            text, imgs = self.prompt(messages)
            texts.append(text)
            images.extend(imgs)
        inputs = self.processor(text=texts, images=images or None, return_tensors="pt", padding=True)
        inputs = inputs.to(self.model.device)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        out = self.model.generate(
            **inputs, max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids, return_dict_in_generate=True, output_logits=True, **sampling,
        )
        new_tokens = out.sequences[:, inputs["input_ids"].shape[1]:]
        scale = temperature if temperature > 0 else 1.0
        logprobs = torch.stack([torch.log_softmax(step.float() / scale, dim=-1) for step in out.logits], dim=1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row, row_logprobs in zip(new_tokens.tolist(), token_logprobs.tolist()):
            ids = []
            for token in row:
                ids.append(token)
                if token in self.stop_ids:
                    break
            text = self.processor.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)
            # A reply cut off by max_new_tokens inside a multi-byte character ends in undecodable bytes (U+FFFD);
            # drop them as vLLM's detokenizer does, so every engine hands the parser and the next turn's
            # context the same text.
            text = text.rstrip("\ufffd")
            completions.append(Completion(text=text, token_ids=ids, logprobs=row_logprobs[: len(ids)]))
        return completions


# ---- training tensors -----------------------------------------------------------------------------


@dataclass
class TrainingSample:
    """One model call as training sees it: prompt + response ids, which tokens are the model's, images."""

    input_ids: list[int]
    response_mask: list[int]  # 1 on tokens the model generated (assistant tokens), 0 on prompt/observations
    images: list
    advantage: float = 0.0
    old_logprobs: list[float] | None = None  # per response token, from the sampler


def assistant_mask(processor, input_ids: list[int]) -> list[int]:
    """Returns 1 for every assistant token (reply text and its <|im_end|>), 0 elsewhere."""
    tokenizer = processor.tokenizer
    header = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    mask = [0] * len(input_ids)
    i = 0
    while i < len(input_ids):
        if input_ids[i : i + len(header)] == header:
            j = i + len(header)
            while j < len(input_ids) and input_ids[j] != end:
                mask[j] = 1
                j += 1
            if j < len(input_ids):
                mask[j] = 1  # the model also learns to end its turn
            i = j + 1
        else:
            i += 1
    return mask


def image_token_count(processor, image) -> int:
    """Returns how many <|image_pad|> tokens the processor gives an image (its merged patch grid)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = processor.image_processor
    height, width = smart_resize(image.height, image.width, factor=ip.patch_size * ip.merge_size,
                                 min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
    return (height // ip.patch_size) * (width // ip.patch_size) // ip.merge_size**2


def text_ids(processor, text: str, images: list) -> list[int]:
    """Returns the token ids the processor would give (text, images), without computing pixel values."""
    pad = processor.image_token
    pieces = text.split(pad)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"prompt has {len(pieces) - 1} image placeholders but {len(images)} images")
    expanded = pieces[0] + "".join(pad * image_token_count(processor, img) + piece for img, piece in zip(images, pieces[1:]))
    return processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]


def encode_conversation(processor, messages: list[dict], max_images: int, max_turns: int | None = None) -> TrainingSample:
    """Returns a whole conversation (assistant turns included) as ids + assistant mask + images (SFT)."""
    messages = limit_context(messages, max_images, max_turns)
    text = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    images = images_of(messages)
    ids = text_ids(processor, text, images)
    return TrainingSample(input_ids=ids, response_mask=assistant_mask(processor, ids), images=images)


def encode_turn(engine: LocalEngine, messages: list[dict], completion: Completion) -> TrainingSample:
    """Returns what the engine saw before replying, plus its reply, as one training sample (RL)."""
    text, images = engine.prompt(messages)
    prompt_ids = text_ids(engine.processor, text, images)
    return TrainingSample(
        input_ids=prompt_ids + completion.token_ids,
        response_mask=[0] * len(prompt_ids) + [1] * len(completion.token_ids),
        images=images,
        old_logprobs=completion.logprobs,
    )


def collate(processor, samples: list[TrainingSample], device="cpu") -> dict:
    """Returns a right-padded batch: input_ids, attention_mask, response_mask, pixel_values, image_grid_thw."""
    width = max(len(s.input_ids) for s in samples)
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    input_ids = torch.full((len(samples), width), pad, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    response = torch.zeros((len(samples), width), dtype=torch.float32)
    old = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention[row, :n] = 1
        response[row, :n] = torch.tensor(sample.response_mask, dtype=torch.float32)
        if sample.old_logprobs is not None:
            positions = [i for i, m in enumerate(sample.response_mask) if m]
            old[row, positions] = torch.tensor(sample.old_logprobs[: len(positions)], dtype=torch.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention, "response_mask": response, "old_logprobs": old,
             "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32)}
    images = [img for s in samples for img in s.images]
    # M-RoPE needs to know which tokens are image tokens (1) vs text (0).
    batch["mm_token_type_ids"] = (input_ids == processor.image_token_id).long()
    if images:
        vision = processor.image_processor(images=images, return_tensors="pt")
        batch["pixel_values"] = vision["pixel_values"]
        batch["image_grid_thw"] = vision["image_grid_thw"]
    return {k: v.to(device) for k, v in batch.items()}


def token_logprobs(model, batch: dict, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (logprobs, entropy), each [B, L]: position t scores token t given tokens < t (0 at t=0)."""
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw") if k in batch}
    logits = model(**kwargs).logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch["input_ids"][:, 1:]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zeros = torch.zeros_like(logp[:, :1])
    return torch.cat([zeros, logp], dim=1), torch.cat([zeros, entropy], dim=1)
