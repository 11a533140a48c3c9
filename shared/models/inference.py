"""Running a model on conversations in this process: the engines that keep the contract of
shared/models/contract.py with a model of their own.

`ChatEngine` is what the two `TokenizingEngine`s share, `LocalEngine` (this process, transformers) and `VllmEngine`
(shared/models/vllm_engine.py). See docs/trainer.md and docs/evaluator.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from shared.models.chat import END_OF_TURN, chat_prompt
from shared.models.contract import Completion, row_seeds
from shared.models.loading import MergedCopy, attach_adapter, load_model
from shared.models.shared_decoder import SharedStateDecoder

Decoder = Literal["shared", "transformers"]
MAX_BATCH_ROWS = 512  # conversations per forward pass; bigger batches are run in chunks (bounds the memory)


class ChatEngine:
    """What LocalEngine and VllmEngine share: the processor, the context policy, the prompt, the stop and the
    forbidden token ids."""

    def __init__(self, processor, max_images_in_context: int = 1, max_turns_in_context: int | None = None,
                 name: str = "local", adapter: str | None = None):
        self.processor = processor
        self.max_images, self.context_turns = max_images_in_context, max_turns_in_context
        self.name, self.adapter = name, adapter
        tokenizer = processor.tokenizer
        self.stop_ids = [tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        # A reply must never contain vision placeholders: an <|image_pad|> in a reply would shift every image
        # feature of the training batch that replays it ("Image features and image tokens do not match").
        vision = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        self.suppress_ids = [i for i in (tokenizer.convert_tokens_to_ids(t) for t in vision)
                             if i is not None and i != tokenizer.unk_token_id]

    def prompt(self, messages: list[dict]) -> tuple[str, list]:
        """Returns (prompt text, images) exactly as the model sees a conversation before it replies."""
        return chat_prompt(self.processor, messages, self.max_images, self.context_turns)


class LocalEngine(ChatEngine):
    """A model in this process that answers batches of conversations (the episode runner's engine).

    `decoder="shared"` (the default) is the shared-state decoder (shared/models/shared_decoder.py);
    `"transformers"` calls `model.generate` on the whole batch: the reference the tests and `make bench` compare
    the fast path with. Both give the same greedy replies."""

    def __init__(self, model, processor, max_images_in_context: int = 1, name: str = "local", adapter: str | None = None,
                 max_turns_in_context: int | None = None, decoder: Decoder = "shared"):
        super().__init__(processor, max_images_in_context, max_turns_in_context, name, adapter)
        self.model, self.decoder = model, decoder
        self.shared = SharedStateDecoder(model, processor, self.stop_ids, self.suppress_ids, self.pad_id)

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
        rows = self.shared.generate([self.prompt(m) for m in conversations], temperature, max_new_tokens, seeds, top_p)
        return [self._completion(ids, logprobs, prompt_ids) for ids, logprobs, prompt_ids in rows]

    def score_replies(self, conversations: list[list[dict]], candidates: list[list[str]]) -> list[list[float]]:
        """Returns, per conversation, the log-probability (temperature 1) of each of its candidate replies, end of
        turn included: the model's teacher-forced score of each answer it could give, e.g. each maze action."""
        if not conversations:
            return []
        count = len(candidates[0])
        if any(len(c) != count for c in candidates) or len(candidates) != len(conversations):
            raise ValueError("score_replies needs the same number of candidates for every conversation")
        step = max(1, MAX_BATCH_ROWS // count)
        return [row for i in range(0, len(conversations), step)
                for row in self.shared.score([self.prompt(m) for m in conversations[i : i + step]],
                                             candidates[i : i + step])]

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
