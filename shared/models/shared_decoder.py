"""The shared-state decoder: generation that computes each distinct state once, with greedy replies equal to
`model.generate`'s.

The task prompt every context starts with is prefilled once per call, each distinct context once (a GRPO group's
samples start from one maze and often walk together), each distinct picture is encoded once (until a vision
weight changes), and decoding runs one row per distinct (context, reply so far) while every episode samples its
own tokens. It leans on transformers' Qwen3-VL internals (`get_rope_index`, `get_image_features`, `DynamicCache`
layers, tensor version counters), which is why the project pins transformers exactly. See docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict

import torch

from shared.models.chat import END_OF_TURN, text_ids

PIXEL_CACHE_IMAGES = 4096  # distinct pictures whose processor output is kept (a few KB each for the tiny model)
PROMPT_CACHE_ENTRIES = 8192  # distinct prompts whose token ids are kept
MIN_SHARED_PREFIX = 16  # shorter common prefixes are prefilled with the rest


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Returns probs [rows, vocab] with every token outside each row's top-p nucleus (the smallest set of most likely
    tokens whose mass reaches top_p) set to 0; the most likely token always stays."""
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = ordered.cumsum(dim=-1) - ordered >= top_p  # the mass before a token already reaches top_p
    # Kept explicitly: a top_p too small for float32 (1e-300 rounds to 0) would otherwise mask every token.
    outside[..., 0] = False
    return probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))


class SharedStateDecoder:
    """Generates and scores for one model (a plain model, or one under a PEFT wrapper), with its caches."""

    def __init__(self, model, processor, stop_ids: list[int], suppress_ids: list[int], pad_id: int):
        self.model, self.processor = model, processor
        self.stop_ids, self.suppress_ids, self.pad_id = stop_ids, suppress_ids, pad_id
        self.vision_start_id = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self._pixels: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._ids: OrderedDict[tuple, list[int]] = OrderedDict()
        self._features: OrderedDict[str, tuple] = OrderedDict()  # picture -> its vision features, see _vision_cache
        self._features_version = None

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
    def generate(self, prompts: list[tuple[str, list]], temperature: float, max_new_tokens: int, seeds: list[int],
                 top_p: float = 1.0) -> list[tuple[list[int], list[float], list[int]]]:
        """Returns (token ids, their log-probabilities, prompt ids) per prompt (text, pictures).

        Decodes distinct states only: episodes with the same context and the same reply so far are one state
        (one cache row, one forward); each episode still samples its own next token from its state's logits, with
        its own generator (seeds[i]), so what it draws does not depend on the rows beside it."""
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
        generators = [torch.Generator(device=device).manual_seed(row) for row in seeds] if temperature > 0 else []
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
        return [(row, row_lp, self._prompt_ids(*prompt)) for row, row_lp, prompt in zip(ids, lps, prompts)]

    @torch.inference_mode()
    def score(self, prompts: list[tuple[str, list]], candidates: list[list[str]]) -> list[list[float]]:
        """Returns, per prompt (text, pictures), the log-probability (temperature 1) of each of its candidate replies,
        end of turn included. Each distinct prompt is prefilled once; its candidates are then read side by side, one
        row each, in one forward over all their tokens (teacher-forced: a reply's tokens are known, so nothing is
        decoded one token at a time; each step would copy the whole cache once more)."""
        tokenizer = self.processor.tokenizer
        end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        count = len(candidates[0])
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
        # Token j's log-probability: from the prompt's last logits for j = 0, from the reply's token j - 1 after.
        # The padding after a short reply comes after its tokens, so causal attention keeps it out of their scores.
        following = current[:, None]
        if width > 1:
            attention = torch.cat([attention, torch.ones_like(tokens[:, :-1])], dim=1)
            positions = next_position[:, :, None] + torch.arange(width - 1, device=device)
            out = self.model(input_ids=tokens[:, :-1], attention_mask=attention, position_ids=positions,
                             past_key_values=cache, use_cache=True)
            following = torch.cat([following, out.logits.float()], dim=1)
        per_token = torch.log_softmax(following, dim=-1).gather(2, tokens[:, :, None]).squeeze(2)
        scores = (per_token * valid).sum(dim=1).view(len(distinct), count).tolist()
        return [scores[s] for s in state]
