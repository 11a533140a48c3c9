"""The tensors training needs: one model call as a sample (context + reply, which tokens are the model's), batches
of them, and the log-probabilities of the replies. The SFT and GRPO both train on these (docs/trainer.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.models.chat import END_OF_TURN, chat_prompt, images_of, limit_context, text_ids
from shared.models.contract import Completion, TokenizingEngine


@dataclass
class TrainingSample:
    """One model call as training sees it: prompt + response ids, which tokens are the model's, images."""

    input_ids: list[int]
    response_mask: list[int]  # 1 on tokens the model generated (assistant tokens), 0 on prompt/observations
    images: list
    advantage: float = 0.0
    old_logprobs: list[float] | None = None  # per response token, from the sampler


def reply_sample(processor, context: list[dict], reply: str, max_images: int, max_turns: int | None = None) -> TrainingSample:
    """Returns one supervised turn (SFT): the context exactly as an engine builds it before replying, then `reply`
    and its end of turn, with the loss on those tokens only (the layout of an RL sample)."""
    text, images = chat_prompt(processor, context, max_images, max_turns)
    prompt_ids = text_ids(processor, text, images)
    tokenizer = processor.tokenizer
    response = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    return TrainingSample(input_ids=prompt_ids + response, response_mask=[0] * len(prompt_ids) + [1] * len(response),
                          images=images)


def encode_turn(engine: TokenizingEngine, messages: list[dict], completion: Completion) -> TrainingSample:
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
