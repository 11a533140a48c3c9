"""Loading a VLM checkpoint and running it: batched generation, and the tensors training needs.

The same code loads the tiny Qwen3-VL and Qwen3-VL-8B (`AutoProcessor` + `AutoModelForImageTextToText`);
nothing here special-cases the tiny model.

Generation has two decoders that give the same greedy replies. `shared` (the default) computes each distinct
state once: the task prompt every context starts with is prefilled once per call, each distinct context once
(a GRPO group's samples start from one maze and often walk together), each distinct picture is encoded once
(until a vision weight changes), and decoding runs one row per distinct (context, reply so far) while every
episode samples its own tokens. `transformers` calls `model.generate` on the whole batch: the reference the
tests and `make bench` compare the fast path with.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from shared.models.chat import ASSISTANT_HEADER, END_OF_TURN, images_of, limit_context
from shared.storage.manifest import ManifestError, verify_manifest

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


@dataclass
class Completion:
    """One generated reply: its text, its token ids (end-of-turn included) and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # set by remote engines when this one request failed after retries
    prompt_ids: list[int] | None = None  # what a local engine's model read before replying (pictures expanded)


Decoder = Literal["shared", "transformers"]
_FRESH_SEEDS = random.Random()  # seeds for unseeded rows (this module's own generator: torch's global one is left alone)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Returns probs [rows, vocab] with every token outside each row's top-p nucleus (the smallest set of most likely
    tokens whose mass reaches top_p) set to 0; the most likely token always stays."""
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = ordered.cumsum(dim=-1) - ordered >= top_p  # the mass before a token already reaches top_p
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


def row_seeds(seed: int | Sequence[int | None] | None, count: int) -> list[int]:
    """Returns one sampling seed per row of a batch: seed + i for an int, the given ones for a list (None: fresh)."""
    if seed is None or isinstance(seed, int):
        given = [None if seed is None else seed + i for i in range(count)]
    else:
        given = list(seed)
        if len(given) != count:
            raise ValueError(f"{len(given)} seeds for {count} conversations")
    return [_FRESH_SEEDS.getrandbits(63) if s is None else int(s) % 2**63 for s in given]
PIXEL_CACHE_IMAGES = 4096  # distinct pictures whose processor output is kept (a few KB each for the tiny model)
PROMPT_CACHE_ENTRIES = 8192  # distinct prompts whose token ids are kept
MIN_SHARED_PREFIX = 16  # shorter common prefixes are prefilled with the rest
MAX_BATCH_ROWS = 512  # conversations per forward pass; bigger batches are run in chunks (bounds the memory)


class LocalEngine:
    """A model in this process that answers batches of conversations (the episode runner's engine)."""

    def __init__(self, model, processor, max_images_in_context: int = 1, name: str = "local", adapter: str | None = None,
                 max_turns_in_context: int | None = None, decoder: Decoder = "shared"):
        self.model = model
        self.processor = processor
        self.max_images = max_images_in_context
        self.context_turns = max_turns_in_context
        self.name = name
        self.adapter = adapter
        self.decoder = decoder
        self._pixels: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._ids: OrderedDict[tuple, list[int]] = OrderedDict()
        self._features: OrderedDict[str, tuple] = OrderedDict()  # picture -> its vision features, see _vision_cache
        self._features_version = None
        tokenizer = processor.tokenizer
        self.stop_ids = [tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.vision_start_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
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
            model = MergedCopy(attach_adapter(model, adapter_dir)).model  # the adapter folded in: the base's speed
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
        return chat_prompt(self.processor, messages, self.max_images, self.context_turns)

    def generate(self, conversations: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 24,
                 seed: int | Sequence[int | None] | None = None, top_p: float = 1.0) -> list[Completion]:
        """Returns one Completion per conversation, generated as one batch (greedy when temperature is 0).

        `seed` makes sampling reproducible: conversation i samples with its own generator, seeded with seed + i (or
        seed[i] when a list is given; None: a fresh seed), so what a conversation samples does not depend on the
        conversations beside it in the batch. `top_p` < 1 samples from the smallest set of tokens holding that mass."""
        if not conversations:
            return []
        seeds = row_seeds(seed, len(conversations))
        if len(conversations) > MAX_BATCH_ROWS:  # per-row seeds: a chunked batch samples what a whole one would
            return [c for i in range(0, len(conversations), MAX_BATCH_ROWS)
                    for c in self.generate(conversations[i : i + MAX_BATCH_ROWS], temperature, max_new_tokens,
                                           seeds[i : i + MAX_BATCH_ROWS], top_p)]
        if self.decoder == "transformers":
            return self._generate_transformers(conversations, temperature, max_new_tokens, seeds, top_p)
        return self._generate_shared(conversations, temperature, max_new_tokens, seeds, top_p)

    def _completion(self, ids: list[int], logprobs: list[float], prompt_ids: list[int]) -> Completion:
        """Returns the Completion for one row of generated ids (cut after its first stop token)."""
        kept = []
        for token in ids:
            kept.append(token)
            if token in self.stop_ids:
                break
        text = self.processor.tokenizer.decode([t for t in kept if t not in self.stop_ids], skip_special_tokens=True)
        # A reply cut off by max_new_tokens inside a multi-byte character ends in undecodable bytes (U+FFFD);
        # drop them as vLLM's detokenizer does, so every engine hands the parser and the next turn's
        # context the same text.
        return Completion(text=text.rstrip("\ufffd"), token_ids=kept, logprobs=logprobs[: len(kept)],
                          prompt_ids=prompt_ids)

    # ---- the shared-prefix decoder -----------------------------------------------------------------

    def _hf_model(self):
        """Returns the transformers model under a peft wrapper (or the model itself)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @staticmethod
    def _picture_key(image) -> str:
        """Returns a digest of a picture's pixels: the one identity the prompt, pixel and feature caches use."""
        return hashlib.blake2b(image.tobytes(), digest_size=16, person=f"{image.mode}{image.size}".encode()[:16]).hexdigest()

    def _pixel_values(self, image, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (pixel_values, image_grid_thw) of one picture, computed once per distinct picture."""
        hit = self._pixels.get(key)
        if hit is None:
            out = self.processor.image_processor(images=[image], return_tensors="pt")
            hit = (out["pixel_values"], out["image_grid_thw"])
            self._pixels[key] = hit
            if len(self._pixels) > PIXEL_CACHE_IMAGES:
                self._pixels.popitem(last=False)
        else:
            self._pixels.move_to_end(key)
        return hit

    @contextlib.contextmanager
    def _vision_cache(self, keys: list[str]):
        """Within this block the model encodes each distinct picture once: features of pictures seen before come
        from a cache, which empties whenever a vision weight changes (an optimizer step or a loaded state dict
        bumps the tensors' version counters). Off when a LoRA sits on the vision tower (adapters can be
        switched or disabled without a write). `keys` name the pictures of the next forward, in order."""
        inner = self._hf_model().model
        if any("lora_" in name for name, _ in inner.visual.named_parameters()):
            yield  # a LoRA on the vision tower can be switched or disabled without a write: no cache
            return
        version = (id(inner.visual), sum(p._version for p in inner.visual.parameters()))
        if version != self._features_version:
            self._features.clear()
            self._features_version = version
        encode = inner.get_image_features  # the model's own method

        def cached(pixel_values, image_grid_thw=None, **kwargs):
            from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

            patches = image_grid_thw.prod(-1).tolist()
            found = [self._features.get(key) for key in keys]
            missing = [i for i, hit in enumerate(found) if hit is None]
            if missing:
                rows = torch.split(pixel_values, patches)
                out = encode(torch.cat([rows[i] for i in missing]), image_grid_thw[missing], **kwargs)
                sizes = [len(features) for features in out.pooler_output]
                deepstack = [torch.split(layer, sizes) for layer in out.deepstack_features]
                for j, i in enumerate(missing):
                    found[i] = (out.pooler_output[j], [layer[j] for layer in deepstack])
            for key, hit in zip(keys, found):  # least recently used last: this call's pictures are the newest
                self._features[key] = hit
                self._features.move_to_end(key)
            while len(self._features) > PIXEL_CACHE_IMAGES:
                self._features.popitem(last=False)
            depth = len(found[0][1])
            return BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(pooled for pooled, _ in found),
                deepstack_features=[torch.cat([layers[d] for _, layers in found]) for d in range(depth)])

        inner.get_image_features = cached  # this instance only, for this block only
        try:
            yield
        finally:
            del inner.get_image_features

    def _prompt_ids(self, text: str, images: list) -> list[int]:
        """Returns the token ids of a prompt (pictures expanded to their grids), remembered per distinct prompt."""
        key = (text, tuple(img.size for img in images))
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = text_ids(self.processor, text, images)
            if len(self._ids) > PROMPT_CACHE_ENTRIES:
                self._ids.popitem(last=False)
        return ids

    def _shared_prefix(self, rows: list[list[int]]) -> int:
        """Returns how many leading tokens every row shares, ending before the first picture (0 if too few)."""
        shortest = min(len(r) for r in rows)
        length = 0
        while length < shortest - 1 and all(r[length] == rows[0][length] for r in rows):
            length += 1
        if self.vision_start_id in rows[0][:length]:
            length = rows[0].index(self.vision_start_id)
        return length if length >= MIN_SHARED_PREFIX else 0

    def _prefix_kv(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Returns each layer's (keys, values) for a text-only prefix (one row; recomputed per call, since the
        weights, LoRA included, may have changed since the last)."""
        from transformers import DynamicCache

        ids = torch.tensor([prefix], device=self.model.device)
        positions = torch.arange(len(prefix), device=self.model.device).view(1, 1, -1).expand(3, 1, -1)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _prefill(self, prompts: list[tuple[str, list, tuple[str, ...]]]):
        """Runs distinct prompts (text, pictures, picture keys) once; returns (last logits, KV cache, next position
        [3, rows], attention mask).

        The text prefix every prompt shares (the task prompt) is computed once, in one row; the rest of each
        prompt follows it after padding, so every row ends on its last token."""
        from transformers import DynamicCache

        device = self.model.device
        rows = [self._prompt_ids(text, images) for text, images, _ in prompts]
        shared = self._shared_prefix(rows)
        width = max(len(r) for r in rows) - shared
        input_ids = torch.full((len(rows), shared + width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, row in enumerate(rows):
            input_ids[i, :shared] = torch.tensor(row[:shared], dtype=torch.long)
            input_ids[i, shared + width - (len(row) - shared):] = torch.tensor(row[shared:], dtype=torch.long)
            attention[i, :shared] = 1
            attention[i, shared + width - (len(row) - shared):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        mm_types = (input_ids == self.processor.image_token_id).long()
        picture_keys = [key for _, _, keys in prompts for key in keys]
        pictures = [self._pixel_values(image, key)
                    for _, images, keys in prompts for image, key in zip(images, keys)]
        vision = {}
        if pictures:
            vision = {"pixel_values": torch.cat([p for p, _ in pictures]).to(device),
                      "image_grid_thw": torch.cat([g for _, g in pictures]).to(device)}
        positions, _ = self._hf_model().model.get_rope_index(input_ids, image_grid_thw=vision.get("image_grid_thw"),
                                                 attention_mask=attention, mm_token_type_ids=mm_types)
        cache = DynamicCache(config=self.model.config)
        if shared:
            for layer, (keys, values) in enumerate(self._prefix_kv(rows[0][:shared])):
                cache.update(keys.expand(len(rows), -1, -1, -1).contiguous(),
                             values.expand(len(rows), -1, -1, -1).contiguous(), layer)
        with self._vision_cache(picture_keys):
            out = self.model(input_ids=input_ids[:, shared:], attention_mask=attention,
                             position_ids=positions[:, :, shared:], mm_token_type_ids=mm_types[:, shared:],
                             past_key_values=cache, use_cache=True, logits_to_keep=1, **vision)
        return out.logits[:, -1].float(), cache, positions[:, :, -1] + 1, attention

    @torch.inference_mode()
    def _generate_shared(self, conversations, temperature, max_new_tokens, seed, top_p=1.0) -> list[Completion]:
        """Decodes distinct states only: episodes with the same context and the same reply so far are one state
        (one cache row, one forward); each episode still samples its own next token from its state's logits."""
        prompts = [self.prompt(messages) for messages in conversations]
        keys, distinct, state = {}, [], []
        for text, images in prompts:
            pictures = tuple(self._picture_key(img) for img in images)
            if (text, pictures) not in keys:
                keys[(text, pictures)] = len(distinct)
                distinct.append((text, images, pictures))
            state.append(keys[(text, pictures)])
        logits, cache, next_position, attention = self._prefill(distinct)  # one row per state
        device = self.model.device
        state = torch.tensor(state, device=device)  # each episode's state
        generators = [torch.Generator(device=device).manual_seed(row) for row in seed] if temperature > 0 else []
        stop = torch.tensor(self.stop_ids, device=device)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        tokens, logprobs = [], []
        scale = temperature if temperature > 0 else 1.0
        for step in range(max_new_tokens):
            mine = logits[state]  # [episodes, vocab]
            scores = mine.clone()
            if self.suppress_ids:
                scores[:, self.suppress_ids] = -float("inf")
            if temperature > 0:  # each episode draws from its own generator: its tokens depend on its seed alone
                probs = torch.softmax(scores / temperature, dim=-1)
                if top_p < 1.0:
                    probs = nucleus(probs, top_p)
                chosen = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
            else:
                chosen = scores.argmax(dim=-1)
            chosen = torch.where(finished, torch.full_like(chosen, self.pad_id), chosen)
            tokens.append(chosen)
            logprobs.append(torch.log_softmax(mine / scale, dim=-1).gather(1, chosen[:, None]).squeeze(1))
            finished |= torch.isin(chosen, stop)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            # The next states: each distinct (state, token) of the episodes still writing, in order of first use.
            children: dict[tuple[int, int], int] = {}
            next_state = [children.setdefault(pair, len(children)) if not done else 0
                          for pair, done in zip(zip(state.tolist(), chosen.tolist()), finished.tolist())]
            parents = torch.tensor([parent for parent, _ in children], device=device)
            fed = torch.tensor([token for _, token in children], device=device)
            if len(children) != len(attention) or not torch.equal(parents, torch.arange(len(attention), device=device)):
                cache.reorder_cache(parents)
                attention, next_position = attention[parents], next_position[:, parents]
            state = torch.tensor(next_state, device=device)
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(input_ids=fed[:, None], attention_mask=attention, position_ids=(next_position + step)[:, :, None],
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
        ids = torch.stack(tokens, dim=1).tolist()
        lps = torch.stack(logprobs, dim=1).tolist()
        return [self._completion(row, row_lp, self._prompt_ids(*prompt)) for row, row_lp, prompt in zip(ids, lps, prompts)]

    @torch.inference_mode()
    def score_replies(self, conversations: list[list[dict]], candidates: list[list[str]]) -> list[list[float]]:
        """Returns, per conversation, the log-probability (temperature 1) of each of its candidate replies, end of
        turn included: the model's teacher-forced score of each answer it could give, e.g. each maze action.

        Each distinct context is prefilled once; its candidates are then decoded side by side, one row each."""
        tokenizer = self.processor.tokenizer
        end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if not conversations:
            return []
        count = len(candidates[0])
        if any(len(c) != count for c in candidates) or len(candidates) != len(conversations):
            raise ValueError("score_replies needs the same number of candidates for every conversation")
        step = max(1, MAX_BATCH_ROWS // count)
        if len(conversations) > step:
            return [row for i in range(0, len(conversations), step)
                    for row in self.score_replies(conversations[i : i + step], candidates[i : i + step])]
        prompts = [self.prompt(messages) for messages in conversations]
        keys, distinct, state, replies = {}, [], [], []
        for (text, images), options in zip(prompts, candidates):
            pictures = tuple(self._picture_key(img) for img in images)
            if (text, pictures, tuple(options)) not in keys:
                keys[(text, pictures, tuple(options))] = len(distinct)
                distinct.append((text, images, pictures))
                replies.append([tokenizer(r, add_special_tokens=False)["input_ids"] + [end] for r in options])
            state.append(keys[(text, pictures, tuple(options))])
        logits, cache, next_position, attention = self._prefill(distinct)
        device = self.model.device
        rows = [ids for options in replies for ids in options]  # state s, candidate c -> row s * count + c
        parents = torch.arange(len(distinct), device=device).repeat_interleave(count)
        cache.reorder_cache(parents)
        attention, next_position, current = attention[parents], next_position[:, parents], logits[parents]
        width = max(len(ids) for ids in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=device)
        valid = torch.zeros((len(rows), width), device=device)
        for i, ids in enumerate(rows):
            tokens[i, : len(ids)] = torch.tensor(ids, device=device)
            valid[i, : len(ids)] = 1
        total = torch.zeros(len(rows), device=device)
        for j in range(width):
            total += torch.log_softmax(current, dim=-1).gather(1, tokens[:, j : j + 1]).squeeze(1) * valid[:, j]
            if j == width - 1:
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = self.model(input_ids=tokens[:, j : j + 1], attention_mask=attention,
                             position_ids=(next_position + j)[:, :, None], past_key_values=cache, use_cache=True)
            current = out.logits[:, -1].float()
        scores = total.view(len(distinct), count).tolist()
        return [scores[s] for s in state]

    # ---- the reference decoder: transformers' generate on the whole batch ---------------------------

    @torch.no_grad()
    def _generate_transformers(self, conversations, temperature, max_new_tokens, seed, top_p=1.0) -> list[Completion]:
        texts, images = [], []
        for messages in conversations:
            text, imgs = self.prompt(messages)
            texts.append(text)
            images.extend(imgs)
        inputs = self.processor(text=texts, images=images or None, return_tensors="pt", padding=True)
        inputs = inputs.to(self.model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p) if temperature > 0 else dict(do_sample=False)
        # model.generate samples the whole batch from torch's global generator: seeded with the first row's seed,
        # inside a fork so the process's own random state is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed[0])
            out = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                suppress_tokens=self.suppress_ids, return_dict_in_generate=True, output_logits=True, **sampling,
            )
        new_tokens = out.sequences[:, inputs["input_ids"].shape[1]:]
        scale = temperature if temperature > 0 else 1.0
        logprobs = torch.stack([torch.log_softmax(step.float() / scale, dim=-1) for step in out.logits], dim=1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
        return [self._completion(row, row_lp, ids)
                for row, row_lp, ids in zip(new_tokens.tolist(), token_logprobs.tolist(), prompt_ids)]


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


def chat_prompt(processor, messages: list[dict], max_images: int, max_turns: int | None = None) -> tuple[str, list]:
    """Returns (prompt text, images) as a model sees a conversation before it replies: the context policy
    (`limit_context`) applied, then the chat template with the generation prompt. Every engine and the SFT use it."""
    messages = limit_context(messages, max_images, max_turns)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, images_of(messages)


def reply_sample(processor, context: list[dict], reply: str, max_images: int, max_turns: int | None = None) -> TrainingSample:
    """Returns one supervised turn (SFT): the context exactly as an engine builds it before replying, then `reply`
    and its end of turn, with the loss on those tokens only (the layout of an RL sample)."""
    text, images = chat_prompt(processor, context, max_images, max_turns)
    prompt_ids = text_ids(processor, text, images)
    tokenizer = processor.tokenizer
    response = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    return TrainingSample(input_ids=prompt_ids + response, response_mask=[0] * len(prompt_ids) + [1] * len(response),
                          images=images)


def encode_turn(engine: LocalEngine, messages: list[dict], completion: Completion) -> TrainingSample:
    """Returns what the engine saw before replying, plus its reply, as one training sample (RL)."""
    if completion.prompt_ids is not None:  # a local engine says what its model read: only the pictures are needed
        prompt_ids = completion.prompt_ids
        images = images_of(limit_context(messages, engine.max_images, engine.context_turns))
    else:
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
