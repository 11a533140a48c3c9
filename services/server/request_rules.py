"""The rules a request passes before any model sees it, and the errors it gets otherwise: one set for both servers.

The CPU server (services/server/app.py) and the vLLM app's ingress (services/server/llm_ingress.py) both apply these
and answer with the same OpenAI-shaped error body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

`check_bearer` is the token check, `parse_json_body` the body's size, depth and syntax, `parse_chat_request` the
fields (OpenAI's ranges), `split_model` the `<base>:<adapter>` rule, `parse_messages` the roles, parts and images,
`check_prompt_tokens` the prompt size once a caller has counted it. Everything raises `RequestError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.storage.ids import check_adapter_id

# Sampling at a temperature this close to 0 divides logits into inf/NaN; 0 itself means greedy.
MIN_TEMPERATURE = 0.01
INT64_MAX = 2**63 - 1
# No chat request nests deeper than a handful of levels; deeper bodies are refused before they are walked.
MAX_JSON_DEPTH = 32
# A 15-turn episode is about 30 content parts: a request with more is refused before any part is read.
MAX_CONTENT_PARTS = 256


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """Returns the OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request this server reads (others are accepted and ignored), with
    OpenAI's ranges."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=512)
    messages: list[dict] = Field(min_length=1, max_length=1024)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this mass")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False


def json_depth_exceeds(value, limit: int) -> bool:
    """Returns True when a parsed JSON value nests deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


async def read_body(request, max_bytes: int) -> bytes:
    """Returns a request's body, refusing (413) one over max_bytes as soon as its header or its bytes say so: a body
    that is too large is never read whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, f"request body is {declared} bytes; this server accepts at most {max_bytes} "
                                "(server.max_request_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(413, f"request body is over {max_bytes} bytes; this server accepts at most {max_bytes} "
                                    "(server.max_request_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_body(raw: bytes, max_bytes: int):
    """Returns a request body's JSON; RequestError 413 when it is too large, 400 when it is not JSON or nests too
    deeply to be a chat request."""
    import json

    if len(raw) > max_bytes:
        raise RequestError(413, f"request body is {len(raw)} bytes; this server accepts at most {max_bytes} "
                                "(server.max_request_bytes)")
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise RequestError(400, f"request body nests too deeply to parse (a chat request needs a few levels; this "
                                f"server reads at most {MAX_JSON_DEPTH})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if json_depth_exceeds(payload, MAX_JSON_DEPTH):
        raise RequestError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels: a chat request needs a few")
    return payload


@dataclass
class ChatLimits:
    """The server's per-request limits (from the `server` config section)."""

    max_images_per_request: int
    max_image_bytes: int
    max_prompt_tokens: int
    # Decode only the newest this many images (what the model is shown; older ones are dropped unread). None: all.
    keep_images: int | None = None

    @classmethod
    def from_server(cls, server, keep_images: int | None = None) -> ChatLimits:
        """Returns the limits of a `server` config section."""
        return cls(server.max_images_per_request, server.max_image_bytes, server.max_prompt_tokens, keep_images)


def no_adapter_store(adapter_id: str) -> RequestError:
    """The 404 for an adapter asked of a server that has no S3_URI to load adapters from."""
    return RequestError(404, f"adapter {adapter_id!r} not found: this server has no S3_URI for adapters",
                        "not_found_error", param="model", code="model_not_found")


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Raises RequestError 401 unless the Authorization header carries the server's token (none set: open)."""
    if api_key and authorization != f"Bearer {api_key}":
        raise RequestError(401, "missing or wrong bearer token (Authorization: Bearer $SERVER_API_KEY)",
                           "authentication_error", code="invalid_api_key")


def validated(model: type[BaseModel], body) -> BaseModel:
    """Returns body validated as `model`; RequestError 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise RequestError(400, f"{param or 'body'}: {error['msg']}", param=param) from None


def parse_chat_request(body, streams: bool = False, penalties: bool = False) -> ChatRequest:
    """Returns the validated request; RequestError (400) naming the first bad field otherwise.

    `streams` / `penalties`: whether the server behind can stream and apply presence/frequency penalties (vLLM can;
    the CPU server refuses them rather than ignore them)."""
    request = validated(ChatRequest, body)
    if request.stream and not streams:
        raise RequestError(400, "stream=true is not supported by this server: send stream=false (or leave it out) "
                                "and read the whole reply", param="stream")
    if 0 < request.temperature < MIN_TEMPERATURE:
        raise RequestError(400, f"temperature {request.temperature!r} is too small to sample with: use 0 for greedy "
                                f"decoding or a value of at least {MIN_TEMPERATURE}", param="temperature")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if getattr(request, penalty) and not penalties:
            raise RequestError(400, f"{penalty} is not supported by this server: send 0 (or leave it out)",
                               param=penalty)
    return request


def split_model(name: str, base_id: str) -> str | None:
    """Returns the adapter id of `<base>:<adapter>` (None for the base model); RequestError 404/400 otherwise."""
    base, colon, adapter = name.partition(":")
    if base != base_id:
        raise RequestError(404, f"model {name!r} not found: this server serves {base_id!r} and "
                                f"'{base_id}:<adapter_id>'", "not_found_error", param="model", code="model_not_found")
    if not colon:
        return None
    try:
        return check_adapter_id(adapter)
    except ValueError as exc:
        raise RequestError(400, str(exc), param="model") from None


def parse_messages(messages: list[dict], limits: ChatLimits) -> list[dict]:
    """Returns messages as the engine takes them (images decoded); RequestError 400 on a bad role, part or image.

    Every image is checked (a data URI within the size limit, at most max_images_per_request of them), but only the
    newest `limits.keep_images` are decoded: the model is never shown the older ones, which are dropped here."""
    from shared.maze.render import check_data_uri, decode_data_uri

    parts_count = sum(len(m["content"]) if isinstance(m.get("content"), list) else 1 for m in messages)
    if parts_count > MAX_CONTENT_PARTS:
        raise RequestError(400, f"the messages hold {parts_count} content parts; this server reads at most "
                                f"{MAX_CONTENT_PARTS} per request", param="messages")
    clean, images = [], []  # images: (message index, part index, uri, image number) in request order
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        param = f"messages.{index}"
        if role not in ("system", "user", "assistant"):
            raise RequestError(400, f"message role {role!r} is not one of system, user, assistant", param=f"{param}.role")
        if isinstance(content, str):
            clean.append({"role": role, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            raise RequestError(400, "message content must be a string or a list of parts", param=f"{param}.content")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                number = len(images) + 1
                if number > limits.max_images_per_request:
                    raise RequestError(400, f"too many images: at most {limits.max_images_per_request} per request",
                                       param=f"{param}.content")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise RequestError(400, f"image {number}: image_url.url must be a data URI string",
                                       param=f"{param}.content")
                try:
                    check_data_uri(url, limits.max_image_bytes)
                except ValueError as exc:
                    raise RequestError(400, f"image {number}: {exc}", param=f"{param}.content") from None
                images.append((index, len(parts), url, number))
                parts.append(None)  # filled below when decoded, dropped otherwise
            else:
                raise RequestError(400, f"unsupported content part {kind!r}: use text or image_url parts",
                                   param=f"{param}.content")
        clean.append({"role": role, "content": parts})
    keep = len(images) if limits.keep_images is None else min(limits.keep_images, len(images))
    for index, position, url, number in images[len(images) - keep :]:
        try:
            clean[index]["content"][position] = {"type": "image", "image": decode_data_uri(url, limits.max_image_bytes)}
        except ValueError as exc:
            raise RequestError(400, f"image {number}: {exc}", param=f"messages.{index}.content") from None
    for message in clean:
        message["content"] = [part for part in message["content"] if part is not None]
    prompt_chars = sum(len(p["text"]) for m in clean for p in m["content"] if p["type"] == "text")
    # A cheap bound before any tokenizer runs: no prompt this long fits the token limit in practice.
    if prompt_chars > 16 * limits.max_prompt_tokens:
        raise RequestError(413, f"prompt text is {prompt_chars} characters, far beyond the limit of "
                                f"{limits.max_prompt_tokens} tokens (server.max_prompt_tokens): send a shorter prompt",
                           param="messages", code="context_length_exceeded")
    return clean


def check_prompt_tokens(count: int, limits: ChatLimits) -> None:
    """Raises RequestError 413 when the prompt (images included) has more tokens than the limit."""
    if count > limits.max_prompt_tokens:
        raise RequestError(413, f"prompt is {count} tokens (images included); this server accepts at most "
                                f"{limits.max_prompt_tokens} (server.max_prompt_tokens): send a shorter prompt",
                           param="messages", code="context_length_exceeded")
