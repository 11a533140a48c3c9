"""Builds the tiny Qwen3-VL: the real architecture and processor, small enough to train on two CPU cores.

    python -m shared.models.tiny --config configs/tiny-cpu.yaml   (what `make tiny-model` runs)

The tokenizer is a byte-level BPE trained offline on the maze prompts, actions and feedback, with
Qwen3-VL's special tokens; the image processor makes one merged vision token cover one maze cell.
Same seed, same weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.config import RunConfig, add_config_arguments, config_from_args
from shared.models.chat import QWEN3VL_CHAT_TEMPLATE
from shared.storage import SharedVolume, is_complete, staged_dir

PATCH_SIZE = 16
MERGE_SIZE = 2
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
    from shared.maze.core import FEEDBACK_INVALID, FEEDBACK_OK, FEEDBACK_WALL, generate, solve
    from shared.maze.prompt import solver_reply, task_prompt

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


def tiny_config(tokenizer, hidden: int = 128, layers: int = 4, vision_hidden: int = 96, vision_depth: int = 2,
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


def build_tiny_model(cfg: RunConfig, out_dir: Path, seed: int | None = None) -> Path:
    """Writes the tiny Qwen3-VL (weights, config, processor) to out_dir with a manifest; returns out_dir."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    seed = cfg.seed if seed is None else seed
    processor = build_processor(cfg.env.cell_px)
    config = tiny_config(processor.tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out_dir


def ensure_tiny_model(cfg: RunConfig, force: bool = False, log=print) -> Path:
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
    parser = argparse.ArgumentParser(prog="python -m shared.models.tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete model exists")
    args = parser.parse_args(argv)
    ensure_tiny_model(config_from_args(args), force=args.force)


if __name__ == "__main__":
    main()
