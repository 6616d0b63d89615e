"""A tiny random Qwen2.5-VL for a visual task, written as a directory both relax and transformers
load (``Qwen2_5_VLForConditionalGeneration``, ``AutoTokenizer``, ``Qwen2VLImageProcessorPil``).

The directory holds:

- the weights and ``config.json`` (``save_qwen2_5_vl``): a ``qwen2`` language model from
  ``relax.models.init`` and a vision tower from ``init_qwen_vision``; ``mrope_section`` splits the
  head's rotary half 1 : 1.5 : 1.5 as Qwen2.5-VL's ``[16, 24, 24]`` does; the vision windows are
  2 x 2 merged tokens, the last block attends over the whole image;
- ``generation_config.json``: eos ``<|im_end|>``, pad and bos ``<|endoftext|>`` (as Qwen2.5-VL's);
- ``tokenizer.json`` (built with ``tokenizers``): a word-level vocabulary of the task's prompt
  and answer words, the chat roles, the ten digits, whitespace and punctuation (anything else
  is ``<unk>``), the pieces fused back on decoding; then the special tokens
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>``, ``<|video_pad|>``. The model's vocabulary is the tokenizer's rounded up to
  a multiple of 16;
- ``tokenizer_config.json``: those tokens, and a chat template in Qwen2.5-VL's style (without its
  default system turn): ``<|im_start|>role\\n...<|im_end|>\\n`` per message, a message's
  ``content`` a string or a list of parts (``{"type": "image"}`` -> ``<|vision_start|><|image_pad|>
  <|vision_end|>``, ``{"type": "text", "text": ...}``), the generation prompt
  ``<|im_start|>assistant\\n``;
- ``preprocessor_config.json`` (``Qwen2VLImageProcessor``): ``min_pixels = max_pixels`` = the
  task image's area rounded to whole merge blocks, so every task image gives the same grid
  (56 px images, patches of 7: ``(1, 8, 8)``, 16 image tokens).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from relax.data.images.qwen2_vl import smart_resize
from relax.models import family_config, init
from relax.models.vision.qwen2_5_vl import Qwen2_5_VL, VLConfig
from relax.models.vision.qwen2_5_vl_checkpoint import save_qwen2_5_vl
from relax.models.vision.qwen_vit import QwenVisionConfig, init_qwen_vision
from relax.tasks.visual import VisualTask

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "added_tokens",
    "build_tokenizer",
    "vocabulary",
    "write_tiny_qwen2_5_vl",
]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD, UNK = "<|image_pad|>", "<|video_pad|>", "<unk>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
ROLES = ("system", "user", "assistant")
PIECES = r"[A-Za-z]+|[0-9]|\s|[^A-Za-z0-9\s]"  # words, single digits, single other characters
PUNCTUATION = tuple(" \n?.,!:;'\"()-")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def vocabulary(task: VisualTask, roles: Sequence[str] = ROLES) -> list[str]:
    """The word-level vocabulary: ``<unk>``, the task's words (prompt, answers), the ``roles``,
    the digits and punctuation, in first-seen order (no special tokens)."""
    answers = [task.answer(n) for n in range(1, task.max_count + 1)]
    texts = [task.prompt, *answers, *roles, *"0123456789", *PUNCTUATION]
    words = [w for t in texts for w in re.findall(PIECES, t)]
    return list(dict.fromkeys([UNK, *words]))


def build_tokenizer(
    task: VisualTask, special: Sequence[str] = SPECIAL_TOKENS, roles: Sequence[str] = ROLES
) -> Tokenizer:
    """The ``tokenizers`` tokenizer of ``vocabulary(task, roles)`` followed by the ``special``
    tokens (Qwen2.5-VL's by default); pieces are fused back on decoding."""
    words = vocabulary(task, roles)
    vocab = {w: i for i, w in enumerate([*words, *special])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (UNK, *special)])
    return tok


def added_tokens(tok: Tokenizer) -> dict[str, dict]:
    """``tokenizer_config.json``'s ``added_tokens_decoder`` of ``tok``'s added tokens."""
    return {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def _mrope_section(head_dim: int) -> tuple[int, int, int]:
    """The rotary half ``head_dim / 2`` split t : h : w = 1 : 1.5 : 1.5 (Qwen2.5-VL's 16, 24, 24)."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return t, h, half - t - h


def write_tiny_qwen2_5_vl(
    directory: str | os.PathLike,
    task: VisualTask,
    *,
    key: jax.Array,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    patch_size: int = 7,
    max_positions: int = 256,
    std: float = 0.02,
) -> Path:
    """Write a random tiny Qwen2.5-VL for ``task`` to ``directory`` (module docstring); its path.

    The language model has ``num_layers`` layers of width ``hidden_size`` (SwiGLU of twice that,
    q/k/v biases, head dim ``hidden_size / num_heads``); the tower ``vision_depth`` blocks of
    width ``vision_hidden`` on ``patch_size``-pixel patches, merged 2 x 2 into one token of width
    ``hidden_size``. Weights are ``N(0, std)`` (the language model's biases too)."""
    root = Path(directory)
    merge, temporal = 2, 2
    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or head_dim % 4:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must be a whole head dim "
            "divisible by 4 (M-RoPE splits its rotary half in three)"
        )
    tok = build_tokenizer(task)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    lm_config = family_config(
        "qwen2",
        vocab_size=-(-n_vocab // 16) * 16,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        qkv_bias=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    vision_config = QwenVisionConfig(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=vision_heads,
        patch_size=patch_size,
        temporal_patch_size=temporal,
        spatial_merge_size=merge,
        window_size=2 * merge * patch_size,
        out_hidden_size=hidden_size,
        fullatt_block_indexes=(vision_depth - 1,),
    )
    k_lm, k_vision = jax.random.split(key)
    model = Qwen2_5_VL(
        language_model=init(lm_config, k_lm, std=std),
        visual=init_qwen_vision(vision_config, k_vision, std=std, dtype=jnp.float32),
        config=VLConfig(
            image_token_id=ids[IMAGE_PAD],
            video_token_id=ids[VIDEO_PAD],
            vision_start_token_id=ids[VISION_START],
            vision_end_token_id=ids[VISION_END],
            mrope_section=_mrope_section(head_dim),
        ),
    )
    save_qwen2_5_vl(model, root)

    tok.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens(tok),
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": UNK,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "split_special_tokens": False,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    factor = patch_size * merge
    h, w = smart_resize(task.image_size, task.image_size, factor, factor * factor, 2**40)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "min_pixels": h * w,
        "max_pixels": h * w,
        "size": {"shortest_edge": h * w, "longest_edge": h * w},
        "patch_size": patch_size,
        "temporal_patch_size": temporal,
        "merge_size": merge,
    }
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    return root
