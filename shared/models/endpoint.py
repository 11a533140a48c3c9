"""An engine that plays through any OpenAI-compatible chat endpoint (our server, vLLM, Ray Serve LLM).

Each turn, every live episode's conversation goes out as one request, concurrently. A request that
is refused, times out or returns garbage is retried with backoff; after the last try that maze gets
a Completion with `error` set (scored failed, reason recorded) and the rest of the run goes on.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from shared.maze.render import data_uri
from shared.models.chat import limit_context
from shared.models.contract import Completion, row_seeds


def to_openai_messages(messages: list[dict]) -> list[dict]:
    """Returns messages with PIL images turned into `image_url` data-URI parts (the wire format)."""
    wire = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    parts.append({"type": "image_url", "image_url": {"url": data_uri(np.asarray(part["image"]))}})
                else:
                    parts.append(part)
            content = parts
        wire.append({"role": message["role"], "content": content})
    return wire


# A chat reply is a few KB: a larger response body is refused before it is read whole, and reply text past
# MAX_REPLY_CHARS is cut before anything parses or stores it (the action is read from the reply's end, within it).
MAX_RESPONSE_BYTES = 1 << 20
MAX_REPLY_CHARS = 8192


class ReplyRefused(ValueError):
    """A response the engine will not read: over the size cap, or past the request's deadline."""


class OpenAIEngine:
    """Chat completions over HTTP, one concurrent request per live episode.

    Each request, its retries included, has a total deadline (`deadline_s`): an endpoint that answers slowly, or one
    byte at a time, costs at most that long per maze, never forever.
    """

    def __init__(self, base_url: str, model_name: str, api_key: str | None = None, max_images_in_context: int = 1,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5, concurrency: int = 64,
                 max_turns_in_context: int | None = None, deadline_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.name = model_name
        self.adapter = model_name.split(":", 1)[1] if ":" in model_name else None
        self.max_images = max_images_in_context
        self.context_turns = max_turns_in_context
        self.retries, self.backoff_s = retries, backoff_s
        self.timeout_s, self.deadline_s = timeout_s, deadline_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.pool = ThreadPoolExecutor(max_workers=concurrency)

    def check(self) -> None:
        """Raises ConnectionError naming the URL when the endpoint does not answer /models."""
        try:
            self.client.get(f"{self.base_url}/models").raise_for_status()
        except httpx.HTTPError as exc:
            raise ConnectionError(f"endpoint {self.base_url} is not reachable ({exc}); start it with `make serve`") from None

    def served_models(self) -> set[str]:
        """Returns the model ids the endpoint lists (/models: the base and every adapter it can serve); ConnectionError
        naming the URL when it does not answer."""
        try:
            response = self.client.get(f"{self.base_url}/models")
            response.raise_for_status()
            return {str(entry.get("id")) for entry in response.json().get("data", []) if isinstance(entry, dict)}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise ConnectionError(f"endpoint {self.base_url} did not list its models ({exc})") from None

    def _post(self, body: dict, deadline: float) -> tuple[int, bytes]:
        """Returns (status, body bytes) of one chat request; ReplyRefused past the size cap or the deadline."""
        remaining = deadline - time.monotonic()
        timeout = httpx.Timeout(max(min(self.timeout_s, remaining), 0.01))
        with self.client.stream("POST", f"{self.base_url}/chat/completions", json=body, timeout=timeout) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ReplyRefused(f"the response is over {MAX_RESPONSE_BYTES} bytes: refused unread")
                if time.monotonic() > deadline:
                    break
                chunks.append(chunk)
            if time.monotonic() > deadline:
                raise ReplyRefused(f"endpoint {self.base_url} sent no complete reply within {self.deadline_s:g} s "
                                   "(the request deadline: --request-deadline)")
            return response.status_code, b"".join(chunks)

    def _one(self, messages: list[dict], temperature: float, max_new_tokens: int, seed: int | None) -> Completion:
        body = {"model": self.name, "messages": to_openai_messages(limit_context(messages, self.max_images, self.context_turns)),
                "temperature": temperature, "max_tokens": max_new_tokens}
        if seed is not None:
            body["seed"] = seed
        error = "no attempt made"
        deadline = time.monotonic() + self.deadline_s
        for attempt in range(self.retries + 1):
            try:
                status, raw = self._post(body, deadline)
                if status >= 500 or status == 429:
                    error = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                elif status >= 400:
                    return Completion("", [], error=f"HTTP {status}: {raw[:200].decode(errors='replace')}")
                else:
                    text = json.loads(raw)["choices"][0]["message"]["content"]
                    if not isinstance(text, str):
                        raise TypeError(f"content is {type(text).__name__}, not text")
                    return Completion(text=text[-MAX_REPLY_CHARS:] if len(text) > MAX_REPLY_CHARS else text,
                                      token_ids=[])
            except ReplyRefused as exc:
                return Completion("", [], error=str(exc))
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries and time.monotonic() + self.backoff_s * 2**attempt < deadline:
                time.sleep(self.backoff_s * 2**attempt)
            else:
                break
        return Completion("", [], error=f"gave up after {attempt + 1} tries: {error}")

    def generate(self, conversations, temperature=0.0, max_new_tokens=24, seed=None) -> list[Completion]:
        """Returns one Completion per conversation; request i carries seed + i (or seed[i]; none when seed is None)."""
        seeds = [None] * len(conversations) if seed is None else row_seeds(seed, len(conversations))
        futures = [self.pool.submit(self._one, c, temperature, max_new_tokens, s) for c, s in zip(conversations, seeds)]
        return [f.result() for f in futures]
