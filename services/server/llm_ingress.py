"""The front door of the vLLM app: Ray Serve LLM's OpenAI ingress plus this project's request rules.

`MazeIngress` (handed to `build_openai_app` through `ingress_cls_config`) reads each body itself and applies what
the CPU server applies (services/server/request_rules.py), answering with the same error body, then its own
adapter rules: a manifest in S3, a rank the engine takes, aliases resolved. See docs/server.md.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

# Ray Serve LLM's public API where it has one; the model list's types and Ray's own HTTP error are not exported there.
from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard, ModelList, OpenAIHTTPException
from ray.serve.llm.ingress import OpenAiIngress
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

from services.server.llm import cause_line
from services.server.request_rules import (
    ChatLimits,
    RequestError,
    check_bearer,
    no_adapter_store,
    parse_chat_request,
    parse_json_body,
    parse_messages,
    read_body,
    split_model,
    validated,
)
from shared.config import ServerConfig, from_environment
from shared.storage.adapters import AdapterNotFound, AdapterStore
from shared.storage.manifest import ManifestError


def _answer(exc: RequestError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


def _authorized(method):
    """Wraps an ingress route so it first checks the bearer token (FastAPI still sees the route's signature): every
    route of the app, ours and Ray's, goes through it."""

    @functools.wraps(method)
    async def route(self, *args, **kwargs):
        request = kwargs.get("request") or next(a for a in args if isinstance(a, Request))
        try:
            check_bearer(request.headers.get("authorization"), self.api_key)
        except RequestError as exc:
            return _answer(exc)
        return await method(self, *args, **kwargs)

    return route


class MazeIngress(OpenAiIngress):
    def __init__(self, llm_deployments, model_cards, *, lora_paths=None, api_key: str | None = None,
                 limits: dict | None = None, s3_uri: str | None = None, endpoint_url: str | None = None,
                 cache_dir: str | None = None, region: str | None = None, **kwargs):
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths, **kwargs)
        self.api_key = api_key or from_environment("server.api_key")
        self.server = ServerConfig(**(limits or {}))  # the limits `ingress_config` passes; any left out: the defaults
        self.chat_limits = ChatLimits.from_server(self.server)
        self.base_id = next(iter(model_cards))
        self.store = AdapterStore(s3_uri, endpoint_url, cache_dir, region=region) if s3_uri else None

    # ---- rules ---------------------------------------------------------------------------------------

    async def resolve_model(self, model: str | None) -> str:
        """Returns the model id the engine should serve: the base, or `<base>:<adapter>` with aliases resolved."""
        model = model or self.base_id
        adapter_id = split_model(model, self.base_id)
        if adapter_id is None:
            return model
        if self.store is None:
            raise no_adapter_store(adapter_id)
        manifest = await self._manifest(adapter_id)
        rank, max_rank = manifest.get("rank"), self.server.max_lora_rank
        if rank is not None and max_rank is not None and int(rank) > max_rank:
            raise RequestError(400, f"adapter {adapter_id!r} has LoRA rank {rank}, above this server's max_lora_rank "
                                    f"{max_rank}: re-export it with a smaller rank or raise server.max_lora_rank",
                               param="model")
        target = manifest.get("alias_of")
        if target and target != adapter_id:
            try:
                if (await self._manifest(target)).get("files") == manifest.get("files"):
                    return f"{self.base_id}:{target}"
            except RequestError:
                pass  # the alias outlived its target: serve the alias's own files
        return model

    async def _manifest(self, adapter_id: str) -> dict:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.store.manifest, adapter_id)
        except AdapterNotFound as exc:
            raise RequestError(404, str(exc), "not_found_error", param="model", code="model_not_found") from None
        except ManifestError as exc:  # a manifest naming files outside its folder, or not a manifest at all
            raise RequestError(502, f"adapter {adapter_id!r} refused: {exc}", "server_error", param="model") from None

    def cap_tokens(self, body) -> None:
        """Caps the reply length at server.max_new_tokens (vLLM reads max_completion_tokens first)."""
        cap = self.server.max_new_tokens
        if getattr(body, "max_completion_tokens", None) is not None:
            body.max_completion_tokens = min(body.max_completion_tokens, cap)
        body.max_tokens = cap if body.max_tokens is None else min(body.max_tokens, cap)

    async def _serve(self, request: Request, body_type, route) -> Any:
        """Reads and checks the body by the shared rules, then hands it to Ray's route; a refusal is one line of
        OpenAI-shaped JSON."""
        asked = "?"
        try:
            max_bytes = self.server.max_request_bytes
            payload = parse_json_body(await read_body(request, max_bytes), max_bytes)
            if body_type is ChatCompletionRequest:
                checked = parse_chat_request(payload, streams=True, penalties=True)
                parse_messages(checked.messages, self.chat_limits)
            asked = payload.get("model") if isinstance(payload, dict) and isinstance(payload.get("model"), str) else "?"
            resolved = await self.resolve_model(payload.get("model") if isinstance(payload, dict) else None)
            body = validated(body_type, {**payload, "model": resolved})
            self.cap_tokens(body)
            try:
                return await route(body, request)
            except OpenAIHTTPException as exc:  # Ray's own refusals (a prompt too long, a bad parameter)
                raise RequestError(exc.status_code, f"{_what(asked)}: {cause_line(exc.message)}", exc.type) from None
            except Exception as exc:  # the engine failed this request (e.g. an adapter it cannot load)
                if "VLLMValidationError" in f"{type(exc).__name__}: {exc}":  # vLLM refused the request (too long)
                    raise RequestError(400, f"{_what(asked)}: {cause_line(str(exc))}") from None
                raise RequestError(500, f"{_what(asked)}: {cause_line(str(exc))}", "server_error") from None
        except RequestError as exc:
            return _answer(exc)

    # ---- routes (the names Ray's route table expects; each reads its own body) ----------------------

    @_authorized
    async def chat(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, super().chat)

    @_authorized
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, super().completions)

    @_authorized
    async def models(self, request: Request) -> ModelList:
        """Lists the base model and every complete adapter (one with a manifest) in S3."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            adapters = []
            if self.store is not None:
                try:
                    adapters = await asyncio.get_running_loop().run_in_executor(None, self.store.list)
                except (BotoCoreError, ClientError) as exc:
                    raise RequestError(503, f"the adapter store (S3) did not answer the listing: {exc}; try again",
                                       "server_error") from None
        except RequestError as exc:
            return _answer(exc)
        base = self._model_cards[self.base_id]
        cards = [base] + [ModelCard(id=f"{self.base_id}:{a}", object="model", owned_by=base.owned_by,
                                    permission=list(base.permission), metadata=dict(base.metadata)) for a in adapters]
        return ModelList(data=cards)

    @_authorized
    async def model_data(self, model: str, request: Request) -> ModelCard:
        try:
            resolved = await self.resolve_model(model)
        except RequestError as exc:
            return _answer(exc)
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
