"""The CPU server: a Ray Serve deployment with a FastAPI ingress on transformers + peft.

Same routes and model-id rules as the GPU app (Ray Serve LLM): `GET /v1/models`, `POST /v1/chat/completions`
with `model` = `<base>` or `<base>:<adapter>`, `GET /healthz`. Adapters are fetched from S3 on first use
into a local cache and kept in an LRU of `max_num_adapters_per_replica` (`@serve.multiplexed`); requests
are batched (`@serve.batch`) and each batch runs grouped by adapter.
"""


import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

api = FastAPI(title="maze-grpo server", description="OpenAI-compatible chat completions for maze VLM policies")


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict] = Field(min_length=1)
    temperature: float = Field(0.0, ge=0, le=5)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None


class AdapterHandle:
    """A LoRA adapter loaded into the replica's peft model; evicting it from the LRU unloads it."""

    def __init__(self, server, adapter_id: str):
        self.server, self.adapter_id = server, adapter_id

    def __del__(self):
        self.server.unload_adapter(self.adapter_id)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> HTTPException:
    return HTTPException(status_code=status, detail={"error": {"message": message, "type": kind}})


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=128)
@serve.ingress(api)
class MazeServer:
    def __init__(self, cfg_dict: dict, model_dir: str, api_key: str | None = None):
        import torch
        from peft import LoraConfig, get_peft_model

        from shared.config import RunConfig
        from shared.models.engine import LocalEngine, load_model, lora_target_regex

        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.cfg = RunConfig.model_validate(cfg_dict)
        self.base_id = self.cfg.model.base_model_id
        model, processor = load_model(model_dir, self.cfg.model.dtype)
        # A placeholder adapter (zero delta) makes the model a PeftModel from the start, so real adapters
        # can be loaded and deleted by name; base requests run with adapters disabled.
        placeholder = LoraConfig(r=1, target_modules=lora_target_regex(self.cfg.lora.target_modules), init_lora_weights=True)
        self.model = get_peft_model(model, placeholder, adapter_name="__base__")
        self.model.eval()
        self.engine = LocalEngine(self.model, processor, max_images_in_context=1_000_000, name=self.base_id)
        self.store = None
        if self.cfg.storage.s3_uri:
            from shared.adapters import AdapterStore

            self.store = AdapterStore.from_config(self.cfg)
        self.api_key = api_key
        self.in_lru: set[str] = set()
        # Every use or change of the peft model runs on this one thread: loads, evictions and batches
        # never interleave.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.first_use_s: dict[str, float] = {}
        # The LRU size comes from the config, so the multiplexed loader is made here (as a closure:
        # Ray keeps its LRU on the decorated function object, which a bound method cannot carry).
        async def load_adapter(adapter_id: str) -> AdapterHandle:
            return await self._load_adapter(adapter_id)

        self.get_adapter = serve.multiplexed(max_num_models_per_replica=self.cfg.server.max_num_adapters_per_replica)(
            load_adapter)

    # ---- adapters ----------------------------------------------------------------------------------

    async def _load_adapter(self, adapter_id: str) -> AdapterHandle:
        """Fetches an adapter from S3 (verified against its manifest) and loads it beside the base model."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        local = await loop.run_in_executor(None, self.store.fetch, adapter_id)
        await loop.run_in_executor(self.model_thread, self._attach, adapter_id, str(local))
        self.first_use_s.setdefault(adapter_id, round(time.perf_counter() - started, 3))
        return AdapterHandle(self, adapter_id)

    def _attach(self, adapter_id: str, folder: str) -> None:
        if adapter_id not in self.model.peft_config:
            self.model.load_adapter(folder, adapter_name=adapter_id)
        self.in_lru.add(adapter_id)

    def _detach(self, adapter_id: str) -> None:
        if adapter_id not in self.in_lru and adapter_id in self.model.peft_config:
            self.model.set_adapter("__base__")
            self.model.delete_adapter(adapter_id)

    def unload_adapter(self, adapter_id: str) -> None:
        """Called when the LRU evicts an adapter: queue its removal on the model thread."""
        self.in_lru.discard(adapter_id)
        self.model_thread.submit(self._detach, adapter_id)

    def _split_model(self, name: str) -> "str | None":
        from shared.storage import check_adapter_id

        base, _, adapter = name.partition(":")
        if base != self.base_id:
            raise _error(404, f"model {name!r} not found: this server serves {self.base_id!r} and "
                              f"'{self.base_id}:<adapter_id>'", "not_found_error")
        if not _:
            return None
        try:
            return check_adapter_id(adapter)
        except ValueError as exc:
            raise _error(400, str(exc)) from None

    # ---- routes ------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise _error(401, "missing or wrong bearer token (Authorization: Bearer $SERVER_API_KEY)", "authentication_error")

    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "model": self.base_id}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        adapters = []
        if self.store is not None:
            adapters = await asyncio.get_running_loop().run_in_executor(None, self.store.list)
        ids = [self.base_id] + [f"{self.base_id}:{a}" for a in adapters]
        return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": "maze-grpo"} for i in ids]}

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        self._authorize(request)
        try:
            body = ChatRequest.model_validate(await request.json())
        except Exception as exc:
            raise HTTPException(status_code=422 if not isinstance(exc, ValueError) or "JSON" not in str(exc) else 400,
                                detail={"error": {"message": f"malformed request: {str(exc)[:300]}",
                                                  "type": "invalid_request_error"}}) from None
        adapter_id = self._split_model(body.model)
        messages = self._validate_messages(body.messages)
        if adapter_id is not None:
            if self.store is None:
                raise _error(404, f"adapter {adapter_id!r} not found: this server has no S3_URI for adapters", "not_found_error")
            from shared.adapters import AdapterNotFound

            try:
                await self.get_adapter(adapter_id)
            except AdapterNotFound as exc:
                raise _error(404, str(exc), "not_found_error") from None
        max_tokens = min(body.max_tokens or self.cfg.server.max_new_tokens, self.cfg.server.max_new_tokens)
        try:
            completion = await self.generate_batched((adapter_id, messages, body.temperature, max_tokens, body.seed))
        except Exception as exc:  # a failed generation fails this request, never the replica
            raise _error(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error") from None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "finish_reason": "stop" if completion.token_ids and completion.token_ids[-1] in self.engine.stop_ids else "length"}],
            "usage": {"completion_tokens": len(completion.token_ids)},
        }

    def _validate_messages(self, messages: list[dict]) -> list[dict]:
        """Returns messages with images decoded; 400 on a bad role, part, image, or too many images."""
        from shared.maze.render import decode_data_uri

        limits = self.cfg.server
        clean, images = [], 0
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if role not in ("system", "user", "assistant"):
                raise _error(400, f"message role {role!r} is not one of system, user, assistant")
            if isinstance(content, str):
                clean.append({"role": role, "content": [{"type": "text", "text": content}]})
                continue
            if not isinstance(content, list):
                raise _error(400, "message content must be a string or a list of parts")
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    images += 1
                    if images > limits.max_images_per_request:
                        raise _error(400, f"too many images: at most {limits.max_images_per_request} per request")
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    try:
                        parts.append({"type": "image", "image": decode_data_uri(url, limits.max_image_bytes)})
                    except ValueError as exc:
                        raise _error(400, f"image {images}: {exc}") from None
                else:
                    raise _error(400, f"unsupported content part {kind!r}: use text or image_url parts")
            clean.append({"role": role, "content": parts})
        return clean

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def generate_batched(self, requests: list[tuple]) -> list:
        """Runs a batch of requests, one engine call per (adapter, temperature, max_tokens, seed) group."""
        results = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, (adapter_id, _, temperature, max_tokens, seed) in enumerate(requests):
            groups.setdefault((adapter_id, temperature, max_tokens, seed), []).append(index)
        loop = asyncio.get_running_loop()
        for (adapter_id, temperature, max_tokens, seed), indices in groups.items():
            conversations = [requests[i][1] for i in indices]
            completions = await loop.run_in_executor(self.model_thread, self._generate, adapter_id, conversations,
                                                     temperature, max_tokens, seed)
            for i, completion in zip(indices, completions):
                results[i] = completion
        return results

    def _generate(self, adapter_id, conversations, temperature, max_tokens, seed):
        if adapter_id is None:
            with self.model.disable_adapter():
                return self.engine.generate(conversations, temperature, max_tokens, seed)
        if adapter_id not in self.model.peft_config:
            # Evicted from the LRU by a newer adapter after this request loaded it: reload from the cache.
            self.model.load_adapter(str(self.store.fetch(adapter_id)), adapter_name=adapter_id)
        try:
            self.model.set_adapter(adapter_id)
            return self.engine.generate(conversations, temperature, max_tokens, seed)
        finally:
            self._detach(adapter_id)  # only if the LRU let go of it meanwhile


async def _json_errors(request: Request, exc: HTTPException):
    detail = exc.detail if isinstance(exc.detail, dict) else {"error": {"message": str(exc.detail), "type": "error"}}
    return JSONResponse(status_code=exc.status_code, content=detail)


api.add_exception_handler(HTTPException, _json_errors)
