"""The front door of the vLLM app: Ray Serve LLM's OpenAI ingress plus this project's rules.

Ray's `OpenAiIngress` routes `<base>:<adapter_id>` to the engine and lets the engine fetch the adapter
from `dynamic_lora_loading_path`. It has no auth, no request limits, no notion of the exporter's
manifests, and it caches an adapter by id forever. This subclass (handed to `build_openai_app` through
`ingress_cls_config`) adds, before a request reaches the engine:

- a bearer token on every route when SERVER_API_KEY is set;
- the adapter id rules: valid characters (400), a complete manifest in S3 (404), a rank the engine
  can take (400), and aliases resolved to the export they point at (so a re-pointed alias is served
  from its new weights, never from the engine's cache of the old ones);
- at most `max_images_per_request` images, each an inline data URI of at most `max_image_bytes`
  (the engine would otherwise download any URL it is given), and `max_tokens` capped;
- engine errors cut to one line that names the cause.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

from services.server.llm import cause_line
from services.server.request_rules import MIN_TEMPERATURE
from shared.adapters import AdapterNotFound, AdapterStore
from shared.config import from_environment
from shared.storage.ids import check_adapter_id


class Rejected(Exception):
    """A request this server refuses: answered as OpenAI's error JSON with one line of message."""

    def __init__(self, status_code: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code, self.message, self.kind = status_code, message, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status_code,
                            content={"error": {"message": self.message, "type": self.kind, "code": self.status_code}})


def _authorized(method):
    """Wraps an ingress route so it first checks the bearer token (FastAPI still sees the route's signature)."""

    @functools.wraps(method)
    async def route(self, *args, **kwargs):
        try:
            self.authorize(kwargs.get("request") or next(a for a in args if isinstance(a, Request)))
        except Rejected as exc:
            return exc.response()
        return await method(self, *args, **kwargs)

    return route


class MazeIngress(OpenAiIngress):
    def __init__(self, llm_deployments, model_cards, *, lora_paths=None, api_key: str | None = None,
                 limits: dict | None = None, s3_uri: str | None = None, endpoint_url: str | None = None,
                 cache_dir: str | None = None, region: str | None = None, **kwargs):
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths, **kwargs)
        self.api_key = api_key or from_environment("server.api_key")
        self.limits = dict(limits or {})
        self.base_id = next(iter(model_cards))
        self.store = AdapterStore(s3_uri, endpoint_url, cache_dir, region=region) if s3_uri else None

    # ---- rules ---------------------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise Rejected(401, "missing or wrong bearer token (Authorization: Bearer $SERVER_API_KEY)",
                          "authentication_error")

    async def resolve_model(self, model: str | None) -> str:
        """Returns the model id the engine should serve: the base, or `<base>:<adapter>` with aliases resolved."""
        model = model or self.base_id
        base, has_adapter, adapter_id = model.partition(":")
        if base != self.base_id:
            raise Rejected(404, f"model {model!r} not found: this server serves {self.base_id!r} and "
                               f"'{self.base_id}:<adapter_id>'", "not_found_error")
        if not has_adapter:
            return model
        try:
            check_adapter_id(adapter_id)
        except ValueError as exc:
            raise Rejected(400, str(exc)) from None
        if self.store is None:
            raise Rejected(404, f"adapter {adapter_id!r} not found: this server has no S3_URI for adapters",
                          "not_found_error")
        manifest = await self._manifest(adapter_id)
        rank, max_rank = manifest.get("rank"), self.limits.get("max_lora_rank")
        if rank is not None and max_rank is not None and int(rank) > max_rank:
            raise Rejected(400, f"adapter {adapter_id!r} has LoRA rank {rank}, above this server's max_lora_rank "
                               f"{max_rank}: re-export it with a smaller rank or raise server.max_lora_rank")
        target = manifest.get("alias_of")
        if target and target != adapter_id:
            try:
                if (await self._manifest(target)).get("files") == manifest.get("files"):
                    return f"{base}:{target}"
            except Rejected:
                pass  # the alias outlived its target: serve the alias's own files
        return model

    async def _manifest(self, adapter_id: str) -> dict:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.store.manifest, adapter_id)
        except AdapterNotFound as exc:
            raise Rejected(404, str(exc), "not_found_error") from None

    def check_messages(self, messages: list) -> None:
        """Raises 400 on too many images or an image that is not a small enough inline data URI."""
        max_images = self.limits.get("max_images_per_request")
        max_bytes = self.limits.get("max_image_bytes")
        images = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
            for part in content if isinstance(content, list) else []:
                part = part if isinstance(part, dict) else getattr(part, "model_dump", lambda: {})()
                if part.get("type") != "image_url":
                    continue
                images += 1
                if max_images is not None and images > max_images:
                    raise Rejected(400, f"too many images: at most {max_images} per request")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
                    raise Rejected(400, f"image {images}: not a data URI (send data:image/png;base64,...)")
                size = len(base64.b64decode(url.split(",", 1)[1], validate=False))
                if max_bytes is not None and size > max_bytes:
                    raise Rejected(400, f"image {images}: {size} bytes is over the limit of {max_bytes}")

    def check_sampling(self, body) -> None:
        """Raises 400 on a temperature too close to 0 to sample with, as the transformers server does."""
        temperature = getattr(body, "temperature", None)
        if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
            raise Rejected(400, f"temperature {temperature!r} is too small to sample with: use 0 for greedy decoding "
                                f"or a value of at least {MIN_TEMPERATURE}")

    def cap_tokens(self, body) -> None:
        """Caps the reply length at server.max_new_tokens (vLLM reads max_completion_tokens first)."""
        cap = self.limits.get("max_new_tokens")
        if cap is None:
            return
        if getattr(body, "max_completion_tokens", None) is not None:
            body.max_completion_tokens = min(body.max_completion_tokens, cap)
        body.max_tokens = cap if body.max_tokens is None else min(body.max_tokens, cap)

    async def _serve(self, body, request: Request, route) -> Any:
        """Applies the rules, then hands the request to Ray's route; any refusal is one line of JSON."""
        try:
            self.authorize(request)
            asked = body.model
            body.model = await self.resolve_model(asked)
            if hasattr(body, "messages"):
                self.check_messages(body.messages)
            self.check_sampling(body)
            self.cap_tokens(body)
            try:
                return await route(body, request)
            except OpenAIHTTPException as exc:  # Ray's own refusals (a prompt too long, a bad parameter)
                raise Rejected(exc.status_code, f"{_what(asked)}: {cause_line(exc.message)}", exc.type) from None
            except Exception as exc:  # the engine failed this request (e.g. an adapter it cannot load)
                if "VLLMValidationError" in f"{type(exc).__name__}: {exc}":  # vLLM refused the request (too long)
                    raise Rejected(400, f"{_what(asked)}: {cause_line(str(exc))}") from None
                raise Rejected(500, f"{_what(asked)}: {cause_line(str(exc))}", "server_error") from None
        except Rejected as exc:
            return exc.response()

    # ---- routes (the names and signatures Ray's route table expects) --------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request, super().chat)

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, super().completions)

    async def models(self, request: Request) -> ModelList:
        """Lists the base model and every complete adapter (one with a manifest) in S3."""
        try:
            self.authorize(request)
        except Rejected as exc:
            return exc.response()
        base = self._model_cards[self.base_id]
        adapters = []
        if self.store is not None:
            adapters = await asyncio.get_running_loop().run_in_executor(None, self.store.list)
        cards = [base] + [ModelCard(id=f"{self.base_id}:{a}", object="model", owned_by=base.owned_by,
                                    permission=list(base.permission), metadata=dict(base.metadata)) for a in adapters]
        return ModelList(data=cards)

    async def model_data(self, model: str, request: Request) -> ModelCard:
        try:
            self.authorize(request)
            resolved = await self.resolve_model(model)
        except Rejected as exc:
            return exc.response()
        base = self._model_cards[self.base_id]
        if resolved == self.base_id:
            return base
        return ModelCard(id=model, object="model", owned_by=base.owned_by, permission=list(base.permission),
                         metadata=dict(base.metadata))

    embeddings = _authorized(OpenAiIngress.embeddings)
    transcriptions = _authorized(OpenAiIngress.transcriptions)
    score = _authorized(OpenAiIngress.score)
    tokenize = _authorized(OpenAiIngress.tokenize)
    detokenize = _authorized(OpenAiIngress.detokenize)


def _what(model: str) -> str:
    base, _, adapter_id = model.partition(":")
    return f"adapter {adapter_id!r}" if adapter_id else f"model {base!r}"
