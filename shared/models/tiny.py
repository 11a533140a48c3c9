"""Builds the tiny Qwen3-VL: the real architecture and processor, small enough to train on two CPU cores.

    python -m shared.models.tiny --config configs/tiny-cpu.yaml   (what `make tiny-model` runs)

The tokenizer is a byte-level BPE trained offline on the maze prompts, actions and feedback, with
Qwen3-VL's special tokens; the image processor makes one merged vision token cover one maze cell.
Same seed, same weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from shared.config import RunConfig, command_line, config_from_args
from shared.models.chat import QWEN3VL_CHAT_TEMPLATE
from shared.storage.files import staged_dir
from shared.storage.manifest import is_complete
from shared.storage.volume import SharedVolume

logger = logging.getLogger(__name__)

PATCH_SIZE = 16
MERGE_SIZE = 1  # one patch per maze cell: the merged token is the patch itself
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def tokenizer_corpus() -> list[str]:
    """Returns the text the tokenizer is trained on: every prompt, reply and feedback form the task uses."""
    from shared.maze.actions import format_action
    from shared.maze.core import generate, solve
    from shared.maze.prompt import FEEDBACK_INVALID, FEEDBACK_OK, FEEDBACK_WALL, solver_reply, task_prompt

    lines = [FEEDBACK_OK, FEEDBACK_WALL, FEEDBACK_INVALID, "user\n", "assistant\n", "system\n"]
    actions = [("move", d) for d in range(4)] + [("stop", "stop")]
    for env_id in ("maze_2d/easy", "maze_2d/hard"):
        for seed in range(40):
            maze = generate(env_id, seed)
            for fmt in ("plain", "tagged"):
                for style in ("tuple", "keyword"):
                    lines.append(task_prompt(maze, fmt, style))
                    for action in actions:
                        lines.append(solver_reply(maze, action, fmt, style))
            lines.extend(solver_reply(maze, ("move", d), "tagged") for d in solve(maze))
    lines.extend(format_action(a, s) for a in actions for s in ("tuple", "keyword"))
    return lines * 4


def build_tokenizer(vocab_size: int = 640):
    """Returns a Qwen2Tokenizer (Qwen3-VL's tokenizer class) whose BPE was trained on the maze corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=8192,
    )
    # Attributes Qwen3VLProcessor looks for on its tokenizer.
    tokenizer.chat_template = QWEN3VL_CHAT_TEMPLATE
    return tokenizer


def build_processor(cell_px: int, vocab_size: int = 640):
    """Returns a Qwen3VLProcessor whose merged vision token spans exactly one `cell_px` maze cell."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if cell_px % (PATCH_SIZE * MERGE_SIZE):
        raise ValueError(
            f"env.cell_px={cell_px}: the tiny model needs a multiple of {PATCH_SIZE * MERGE_SIZE} "
            "so one merged vision token covers one maze cell"
        )
    pixels = {"shortest_edge": 4 * cell_px * cell_px, "longest_edge": 32 * 32 * cell_px * cell_px}
    # Per-channel means: with one mean for all channels, grey walls and white floor become scalar
    # multiples of each other and the vision tower's first LayerNorm erases the difference (measured:
    # 12x more wall/floor contrast in the vision tokens with these means).
    common = dict(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2, size=pixels,
                  image_mean=[0.9, 0.5, 0.1], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(**common)
    video_processor = Qwen3VLVideoProcessor(**common)
    tokenizer = build_tokenizer(vocab_size)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=QWEN3VL_CHAT_TEMPLATE)


def tiny_config(tokenizer, hidden: int = 128, layers: int = 4, vision_hidden: int = 128, vision_depth: int = 2,
                init_std: float = 0.02):
    """Returns a Qwen3VLConfig small enough for CPU RL, with the real layout (mrope, deepstack, merger)."""
    from transformers import Qwen3VLConfig

    head_dim = 32
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 3,
            num_hidden_layers=layers,
            num_attention_heads=hidden // head_dim,
            num_key_value_heads=max(1, hidden // head_dim // 2),
            head_dim=head_dim,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            pad_token_id=ids["<|endoftext|>"],
            initializer_range=init_std,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=vision_hidden * 2,
            num_heads=vision_hidden // 32,
            patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=2,
            out_hidden_size=hidden,
            num_position_embeddings=576,
            deepstack_visual_indexes=[0],
            initializer_range=init_std,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        initializer_range=init_std,
    )


NEIGHBOURS = [(0, 1), (-1, 0), (0, -1), (1, 0)]  # (d_row, d_col): right, up, left, down


def init_neighbour_heads(model, contrast: float = 6.0, freqs: int = 3) -> None:
    """Initialises the first vision block's first four heads to look at the right/up/left/down patch.

    A from-scratch vision tower starts with uniform attention and takes thousands of steps to find
    its neighbours; a pretrained ViT sees them from the start. The query/key biases are set so that,
    through the tower's 2D rotary embedding, head h attends to the patch one step in direction h
    (about `contrast` nats above any other patch, using the `freqs` fastest rotary frequencies per
    axis), and its value/output projections are scaled so what it sees is not drowned out.
    """
    import math

    import torch

    visual = model.model.visual
    attn = visual.blocks[0].attn
    heads, head_dim = attn.num_heads, attn.head_dim
    if heads < len(NEIGHBOURS):
        raise ValueError(f"the vision tower needs at least {len(NEIGHBOURS)} heads for the neighbour heads, has {heads}")
    inv_freq = visual.rotary_pos_emb.inv_freq  # per axis; dims [0, n) rotate with the row, [n, 2n) with the column
    n = inv_freq.numel()
    amplitude = math.sqrt(contrast * math.sqrt(head_dim) / float((1 - torch.cos(inv_freq[:freqs])).sum()))
    with torch.no_grad():
        bias = attn.qkv.bias.view(3, heads, head_dim)
        for h, (d_row, d_col) in enumerate(NEIGHBOURS):
            query, key = torch.zeros(head_dim), torch.zeros(head_dim)
            for j in range(head_dim // 2):  # dims j and j + head_dim/2 form one rotary pair
                if j % n >= freqs:
                    continue
                angle = float(inv_freq[j % n]) * (d_row if j < n else d_col)
                key[j] = amplitude
                query[j], query[j + head_dim // 2] = amplitude * math.cos(angle), amplitude * math.sin(angle)
            bias[0, h], bias[1, h] = query, key
        width = attn.qkv.in_features
        used = len(NEIGHBOURS) * head_dim
        attn.qkv.weight.view(3, heads, head_dim, width)[2, : len(NEIGHBOURS)] = torch.randn(len(NEIGHBOURS), head_dim, width) / math.sqrt(width)
        attn.proj.weight[:, :used] = torch.randn(width, used) / math.sqrt(used)


def calibrate_vision_outputs(model, processor, images, scale: float = 3.0) -> None:
    """Data-dependent init of the vision tower's outputs: centred, and each token's deviation of norm `scale`.

    At random init every image token carries one large shared component (maze pictures are mostly
    alike), so to the language model all 81 cells look the same and it cannot learn to find the agent
    (measured: wall perception stays at the prior for 700 steps; with this calibration it is learned).
    """
    import torch

    visual = model.model.visual
    layers = [visual.merger.linear_fc2] + [m.linear_fc2 for m in visual.deepstack_merger_list]
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, k=k: outputs.__setitem__(k, out)) for k, layer in enumerate(layers)]
    try:
        inputs = processor.image_processor(images=images, return_tensors="pt")
        with torch.no_grad():
            model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            for k, layer in enumerate(layers):
                mean = outputs[k].mean(0)
                factor = scale / (outputs[k] - mean).norm(dim=-1).mean()
                layer.bias.copy_((layer.bias - mean) * factor)
                layer.weight.mul_(factor)
    finally:
        for hook in hooks:
            hook.remove()


def calibration_images(cfg: RunConfig, count: int = 32) -> list:
    """Returns pictures of training mazes (never eval seeds) for `calibrate_vision_outputs`."""
    from PIL import Image

    from shared.maze.core import generate
    from shared.maze.render import render_rgb

    return [Image.fromarray(render_rgb(generate(cfg.env.id, cfg.env.sft_seed_start + 10_000_000 + i), cfg.env.cell_px))
            for i in range(count)]


def build_tiny_model(cfg: RunConfig, out_dir: Path, seed: int | None = None) -> Path:
    """Writes the tiny Qwen3-VL (weights, config, processor) to out_dir with a manifest; returns out_dir."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    seed = cfg.seed if seed is None else seed
    processor = build_processor(cfg.env.cell_px)
    config = tiny_config(processor.tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    init_neighbour_heads(model)
    calibrate_vision_outputs(model, processor, calibration_images(cfg))
    model.generation_config.eos_token_id = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out_dir


def ensure_tiny_model(cfg: RunConfig, force: bool = False, log=logger.info) -> Path:
    """Returns the tiny model's folder, building it first when missing or incomplete."""
    out_dir = SharedVolume(cfg.shared_path()).model(cfg.model.tiny_name)
    if is_complete(out_dir) and not force:
        log(f"tiny model: {out_dir} is complete, skipping (use --force to rebuild)")
        return out_dir
    log(f"tiny model: building {out_dir}")
    build_tiny_model(cfg, out_dir)
    log(f"tiny model: wrote {out_dir}")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = command_line("python -m shared.models.tiny", __doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete model exists")
    args = parser.parse_args(argv)
    ensure_tiny_model(config_from_args(args), force=args.force)


if __name__ == "__main__":
    main()
