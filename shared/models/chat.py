"""Multi-turn, multi-image conversations: the message format every engine speaks, and Qwen3-VL's template.

Messages are OpenAI-style: `{"role": ..., "content": [{"type": "text", "text": ...},
{"type": "image", "image": PIL.Image}]}`; `image_url` parts with data URIs are accepted too, so a
conversation received by the server and one built by the episode runner render identically.
"""

from __future__ import annotations

from PIL import Image

from shared.maze.render import decode_data_uri

# Qwen3-VL's chat format: <|im_start|>role\n ... <|im_end|>\n, images as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands <|image_pad|> per image grid).
QWEN3VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
END_OF_TURN = "<|im_end|>"


def user_turn(text: str, image: Image.Image | None) -> dict:
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image", "image": image})
    return {"role": "user", "content": content}


def assistant_turn(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _is_image(part: dict) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def limit_images(messages: list[dict], max_images: int) -> list[dict]:
    """Returns messages keeping only the last `max_images` images; older turns keep their text.

    The memory guard for long multi-image episodes: context grows by text only.
    """
    seen = 0
    kept: list[dict] = []
    for message in reversed(messages):
        content = message["content"]
        if isinstance(content, list) and any(_is_image(p) for p in content):
            parts = []
            for part in reversed(content):
                if _is_image(part):
                    seen += 1
                    if seen > max_images:
                        continue
                parts.append(part)
            message = {**message, "content": parts[::-1]}
        kept.append(message)
    return kept[::-1]


def limit_turns(messages: list[dict], max_turns: int | None) -> list[dict]:
    """Returns messages keeping the task prompt (first user turn's text) and the last `max_turns` exchanges.

    An exchange is an assistant reply plus the user turn that answers it; None keeps everything.
    """
    if max_turns is None:
        return messages
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(replies) <= max_turns:
        return messages
    first = messages[0]
    cut = replies[-max_turns]
    if isinstance(first["content"], list):
        first = {**first, "content": [p for p in first["content"] if not _is_image(p)]}
    return [first, *messages[cut:]]


def limit_context(messages: list[dict], max_images: int, max_turns: int | None = None) -> list[dict]:
    """Returns the context a model sees: the last `max_turns` exchanges, then the last `max_images` images."""
    return limit_images(limit_turns(messages, max_turns), max_images)


def images_of(messages: list[dict], max_image_bytes: int = 4 * 1024 * 1024) -> list[Image.Image]:
    """Returns the images of a conversation in order (data URIs decoded); ValueError on a bad one."""
    images = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            continue
        for part in content:
            if not _is_image(part):
                continue
            if part["type"] == "image":
                images.append(part["image"])
            else:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(decode_data_uri(url, max_image_bytes))
    return images


def image_token_count(processor, image) -> int:
    """Returns how many <|image_pad|> tokens the processor gives an image (its merged patch grid)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = processor.image_processor
    height, width = smart_resize(image.height, image.width, factor=ip.patch_size * ip.merge_size,
                                 min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
    return (height // ip.patch_size) * (width // ip.patch_size) // ip.merge_size**2


def text_ids(processor, text: str, images: list) -> list[int]:
    """Returns the token ids the processor would give (text, images), without computing pixel values."""
    pad = processor.image_token
    pieces = text.split(pad)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"prompt has {len(pieces) - 1} image placeholders but {len(images)} images")
    expanded = pieces[0] + "".join(pad * image_token_count(processor, img) + piece for img, piece in zip(images, pieces[1:]))
    return processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]


def chat_prompt(processor, messages: list[dict], max_images: int, max_turns: int | None = None) -> tuple[str, list]:
    """Returns (prompt text, images) as a model sees a conversation before it replies: the context policy
    (`limit_context`) applied, then the chat template with the generation prompt. Every engine and the SFT use it."""
    messages = limit_context(messages, max_images, max_turns)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, images_of(messages)
