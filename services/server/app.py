"""The CPU server: a Ray Serve deployment with a FastAPI ingress on transformers + peft.

Same routes and model-id rules as the GPU app (Ray Serve LLM): `GET /v1/models`, `POST /v1/chat/completions`
with `model` = `<base>` or `<base>:<adapter>`, `GET /healthz`. Adapters are fetched from S3 on first use
into a local cache and kept in an LRU of `max_num_adapters_per_replica` (`@serve.multiplexed`), one entry per
adapter version: each adapter's manifest is re-checked (by ETag) every `adapter_revalidate_s`, so a re-pointed
alias is served within that time. Every request passes `request_rules` (validation, prompt size in tokens)
before it joins a batch (`@serve.batch`); each batch runs grouped by adapter, and a request that fails in a
batch fails alone: its neighbours are retried one by one and get their answers.
"""


import asyncio
import copy
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.server.request_rules import (
    ChatLimits,
    ChatRequest,
    RequestError,
    check_bearer,
    check_prompt_tokens,
    error_body,
    no_adapter_store,
    parse_chat_request,
    parse_json_body,
    parse_messages,
    read_body,
    split_model,
)

# The schema is served at /openapi.json and /docs by routes of the deployment, behind the token when one is set.
api = FastAPI(title="maze-grpo server", description="OpenAI-compatible chat completions for maze VLM policies",
              docs_url=None, redoc_url=None, openapi_url=None)


async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(status_code=exc.status_code, content=error_body(str(exc.detail), kind), headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    return JSONResponse(status_code=400, content=error_body(f"{'.'.join(map(str, first['loc']))}: {first['msg']}"))


async def _request_error(request: Request, exc: RequestError):
    return JSONResponse(status_code=exc.status, content=exc.body())


async def _server_error(request: Request, exc: Exception):
    return JSONResponse(status_code=500, content=error_body(f"internal error: {type(exc).__name__}", "server_error"))


# Registered before `serve.ingress` wraps the app, so the deployment answers with these bodies.
api.add_exception_handler(StarletteHTTPException, _http_error)
api.add_exception_handler(RequestValidationError, _validation_error)
api.add_exception_handler(RequestError, _request_error)
api.add_exception_handler(Exception, _server_error)

CHAT_BODY_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatRequest.model_json_schema()}}}}


@dataclass(frozen=True)
class AdapterVersion:
    """One version of an adapter id: the files its manifest listed when this replica last checked."""

    adapter_id: str
    version: str
    etag: str
    checked_at: float

    @property
    def key(self) -> str:
        """The multiplexed-LRU key, and the adapter's name inside the peft model (no '.': peft forbids it)."""
        return f"{re.sub(r'[^A-Za-z0-9_-]', '_', self.adapter_id)}__{self.version}"


class AdapterHandle:
    """A LoRA adapter loaded into the replica's peft model; evicting it from the LRU unloads it."""

    def __init__(self, server, name: str):
        self.server, self.name = server, name

    def __del__(self):
        self.server.unload_adapter(self.name)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=128)
@serve.ingress(api)
class MazeServer:
    def __init__(self, cfg_dict: dict, model_dir: str, api_key: str | None = None):
        import torch
        from peft import LoraConfig, get_peft_model

        from shared.config import RunConfig
        from shared.models.inference import LocalEngine
        from shared.models.loading import load_model, lora_target_regex

        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.cfg = RunConfig.model_validate(cfg_dict)
        self.base_id = self.cfg.model.base_model_id
        self.limits = ChatLimits.from_server(self.cfg.server, keep_images=self.cfg.model.max_images_in_context)
        model, processor = load_model(model_dir, self.cfg.model.dtype)
        # A placeholder adapter (zero delta) makes the model a PeftModel from the start, so real adapters
        # can be loaded and deleted by name; base requests run with adapters disabled.
        placeholder = LoraConfig(r=1, target_modules=lora_target_regex(self.cfg.lora.target_modules), init_lora_weights=True)
        self.model = get_peft_model(model, placeholder, adapter_name="__base__")
        self.model.eval()
        # The policy is served with the context it was trained in: whatever history a client sends, the model sees
        # the task prompt, the last model.max_turns_in_context exchanges and the last max_images_in_context pictures.
        self.engine = LocalEngine.for_model(self.cfg, self.model, processor, name=self.base_id)
        # Prompts are counted on their own thread with their own tokenizer (a tokenizer is not safe to share
        # across threads), so a request refused for its size never waits behind a batch being generated.
        self.count_processor = copy.deepcopy(processor)
        self.count_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="count")
        # Bodies are parsed and their images decoded off the event loop, one at a time: a client sending the largest
        # accepted request delays the others' parsing by that request's share, never the loop itself.
        self.parse_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")
        self.store = None
        if self.cfg.storage.s3_uri:
            from shared.storage.adapters import AdapterStore

            self.store = AdapterStore.from_config(self.cfg)
        self.api_key = api_key
        self.in_lru: set[str] = set()
        self.adapter_folders: dict[str, str] = {}  # peft adapter name -> its verified local folder
        self.versions: dict[str, AdapterVersion] = {}  # adapter id -> the version last seen in S3
        # Every use or change of the peft model runs on this one thread: loads, evictions and batches
        # never interleave.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # The LRU size comes from the config, so the multiplexed loader is made here (as a closure:
        # Ray keeps its LRU on the decorated function object, which a bound method cannot carry).
        async def load_adapter(key: str) -> AdapterHandle:
            return await self._load_adapter(key)

        self.get_adapter = serve.multiplexed(max_num_models_per_replica=self.cfg.server.max_num_adapters_per_replica)(
            load_adapter)

    # ---- adapters ----------------------------------------------------------------------------------

    async def _current_version(self, adapter_id: str) -> AdapterVersion:
        """Returns the adapter's version in S3, re-checking its manifest's ETag at most every adapter_revalidate_s."""
        from shared.storage.adapters import adapter_version

        known = self.versions.get(adapter_id)
        now = time.monotonic()
        if known is not None and now - known.checked_at < self.cfg.server.adapter_revalidate_s:
            return known
        loop = asyncio.get_running_loop()
        etag = await loop.run_in_executor(None, self.store.manifest_etag, adapter_id)
        if known is not None and etag == known.etag:
            current = AdapterVersion(adapter_id, known.version, etag, now)
        else:
            manifest = await loop.run_in_executor(None, self.store.manifest, adapter_id)
            current = AdapterVersion(adapter_id, adapter_version(manifest), etag, now)
        self.versions[adapter_id] = current
        return current

    async def _load_adapter(self, key: str) -> AdapterHandle:
        """Fetches one adapter version from S3 (verified against its manifest) and loads it beside the base model."""
        adapter_id, _, version = key.rpartition("@")
        loop = asyncio.get_running_loop()
        manifest = await loop.run_in_executor(None, self.store.manifest, adapter_id)
        local = await loop.run_in_executor(None, self.store.fetch, adapter_id, manifest)
        name = AdapterVersion(adapter_id, local.name, "", 0.0).key  # the version the files really are
        await loop.run_in_executor(self.model_thread, self._attach, name, str(local))
        return AdapterHandle(self, name)

    def _attach(self, name: str, folder: str) -> None:
        if name not in self.model.peft_config:
            self.model.load_adapter(folder, adapter_name=name)
        self.adapter_folders[name] = folder
        self.in_lru.add(name)

    def _detach(self, name: str) -> None:
        if name not in self.in_lru and name in self.model.peft_config:
            self.model.set_adapter("__base__")
            self.model.delete_adapter(name)

    def unload_adapter(self, name: str) -> None:
        """Called when the LRU evicts an adapter: queue its removal on the model thread."""
        self.in_lru.discard(name)
        self.model_thread.submit(self._detach, name)

    async def _adapter(self, adapter_id: str) -> tuple[str, str]:
        """Returns (peft adapter name, fingerprint) of the adapter's current version, loaded; RequestError if absent."""
        from botocore.exceptions import BotoCoreError, ClientError

        from shared.storage.adapters import AdapterChanging, AdapterNotFound
        from shared.storage.manifest import ManifestError

        if self.store is None:
            raise no_adapter_store(adapter_id)
        try:
            version = await self._current_version(adapter_id)
            handle = await self.get_adapter(f"{adapter_id}@{version.version}")
        except AdapterNotFound as exc:
            raise RequestError(404, str(exc), "not_found_error", param="model", code="model_not_found") from None
        except AdapterChanging as exc:
            raise RequestError(503, str(exc), "server_error") from None
        except ManifestError as exc:  # a manifest naming files outside its folder, or not a manifest at all
            raise RequestError(502, f"adapter {adapter_id!r} refused: {exc}", "server_error", param="model") from None
        except (BotoCoreError, ClientError) as exc:
            raise RequestError(503, f"the adapter store (S3) did not answer for {adapter_id!r}: {exc}; try again",
                               "server_error") from None
        return handle.name, f"{adapter_id}@{handle.name.rpartition('__')[2]}"

    # ---- routes ------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization"), self.api_key)

    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "model": self.base_id}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        self._authorize(request)
        return api.openapi()

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        self._authorize(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=api.title)

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        adapters = []
        if self.store is not None:
            from botocore.exceptions import BotoCoreError, ClientError

            try:
                adapters = await asyncio.get_running_loop().run_in_executor(None, self.store.list)
            except (BotoCoreError, ClientError) as exc:  # S3 refused or failed: say so rather than list fewer models
                raise RequestError(503, f"the adapter store (S3) did not answer the listing: {exc}; try again",
                                   "server_error") from None
        ids = [self.base_id] + [f"{self.base_id}:{a}" for a in adapters]
        return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": "maze-grpo"} for i in ids]}

    @api.post("/v1/chat/completions", openapi_extra=CHAT_BODY_SCHEMA)
    async def chat(self, request: Request):
        self._authorize(request)
        raw = await read_body(request, self.cfg.server.max_request_bytes)
        loop = asyncio.get_running_loop()
        body, adapter_id, messages = await loop.run_in_executor(self.parse_thread, self._parse, raw)
        prompt_tokens = await loop.run_in_executor(self.count_thread, self._prompt_tokens, messages)
        check_prompt_tokens(prompt_tokens, self.limits)
        adapter_name, fingerprint = (None, "base") if adapter_id is None else await self._adapter(adapter_id)
        max_tokens = min(body.max_tokens or self.cfg.server.max_new_tokens, self.cfg.server.max_new_tokens)
        completion = await self.generate_batched((adapter_name, messages, body.temperature, max_tokens, body.seed,
                                                  body.top_p))
        if isinstance(completion, Exception):  # this request failed on its own; its batch neighbours did not
            raise RequestError(500, f"generation failed: {type(completion).__name__}: {str(completion)[:300]}",
                               "server_error")
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "finish_reason": "stop" if completion.token_ids and completion.token_ids[-1] in self.engine.stop_ids else "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(completion.token_ids),
                      "total_tokens": prompt_tokens + len(completion.token_ids)},
        }

    def _parse(self, raw: bytes) -> tuple[ChatRequest, str | None, list[dict]]:
        """Returns (the validated request, its adapter id or None, its messages with the shown images decoded)."""
        body = parse_chat_request(parse_json_body(raw, self.cfg.server.max_request_bytes))
        return body, split_model(body.model, self.base_id), parse_messages(body.messages, self.limits)

    def _prompt_tokens(self, messages: list[dict]) -> int:
        """Returns the prompt's length in tokens as the model sees it: the served profile's context policy applied
        to the client's history, image tokens included."""
        from shared.models.chat import chat_prompt, text_ids

        try:
            text, images = chat_prompt(self.count_processor, messages, self.engine.max_images, self.engine.context_turns)
            return len(text_ids(self.count_processor, text, images))
        except Exception as exc:  # the chat template refused these messages: this request's fault alone
            raise RequestError(400, f"messages cannot be formatted for the model: {type(exc).__name__}: "
                                    f"{str(exc)[:200]}", param="messages") from None

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def generate_batched(self, requests: list[tuple]) -> list:
        """Returns one Completion (or the Exception that request alone raised) per request.

        One engine call per (adapter, temperature, max_tokens, top_p) group, each request sampling with its own seed (so
        its reply does not depend on its batch neighbours); when a group's call fails, its requests are run one by
        one, so only the request that fails gets the error.
        """
        results: list = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, (adapter_name, _, temperature, max_tokens, _, top_p) in enumerate(requests):
            groups.setdefault((adapter_name, temperature, max_tokens, top_p), []).append(index)
        loop = asyncio.get_running_loop()
        for (adapter_name, temperature, max_tokens, top_p), indices in groups.items():
            chunks = [indices]
            try:
                completions = await loop.run_in_executor(self.model_thread, self._generate, adapter_name,
                                                         [requests[i][1] for i in indices], temperature, max_tokens,
                                                         [requests[i][4] for i in indices], top_p)
                for i, completion in zip(indices, completions):
                    results[i] = completion
                continue
            except Exception as exc:
                if len(indices) == 1:
                    results[indices[0]] = exc
                    continue
                chunks = [[i] for i in indices]
            for (i,) in chunks:
                try:
                    (results[i],) = await loop.run_in_executor(self.model_thread, self._generate, adapter_name,
                                                               [requests[i][1]], temperature, max_tokens,
                                                               [requests[i][4]], top_p)
                except Exception as exc:
                    results[i] = exc
        return results

    def _generate(self, adapter_name, conversations, temperature, max_tokens, seeds, top_p=1.0):
        if adapter_name is None:
            with self.model.disable_adapter():
                return self.engine.generate(conversations, temperature, max_tokens, seeds, top_p=top_p)
        if adapter_name not in self.model.peft_config:
            # Evicted from the LRU by a newer adapter after this request loaded it: reload this version's files.
            self.model.load_adapter(self.adapter_folders[adapter_name], adapter_name=adapter_name)
        try:
            self.model.set_adapter(adapter_name)
            return self.engine.generate(conversations, temperature, max_tokens, seeds, top_p=top_p)
        finally:
            self._detach(adapter_name)  # only if the LRU let go of it meanwhile
