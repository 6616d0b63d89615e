"""A tiny random Gemma 3 for a visual task, written as a directory both relax and transformers
load (``Gemma3ForConditionalGeneration``, ``AutoTokenizer``, ``Gemma3ImageProcessorPil``,
``Gemma3Processor``).

The directory holds:

- the weights and ``config.json`` (``save_gemma3``): a ``gemma3_text`` language model from
  ``relax.models.init`` (sliding layers then a full one, as Gemma 3 interleaves them; local
  RoPE base 1e4, global 1e6; scores over ``sqrt(head_dim)``; tied embeddings) and a SigLIP tower
  from ``init_siglip`` with a random projector (``1 + w`` RMSNorm and ``[Dv, D]`` matrix);
  each image becomes ``mm_tokens_per_image`` soft tokens, the patch grid average-pooled;
- ``generation_config.json``: eos ``<eos>`` and ``<end_of_turn>``, bos ``<bos>``, pad ``<pad>``
  (as the Hub's Gemma 3);
- ``tokenizer.json`` (``relax.tasks.tiny_vlm.build_tokenizer``): the word-level vocabulary of
  the task's words, the roles (``user``, ``model``, ...), digits, whitespace and punctuation,
  then the special tokens ``<pad>``, ``<eos>``, ``<bos>``, ``<start_of_turn>``,
  ``<end_of_turn>``, ``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``. The
  model's vocabulary is the tokenizer's rounded up to a multiple of 16;
- ``tokenizer_config.json``: those tokens (``boi_token`` / ``image_token`` / ``eoi_token`` named
  as Gemma 3's are, which ``Gemma3Processor`` reads) and Gemma 3's own chat template: ``<bos>``,
  ``<start_of_turn>role\\n...<end_of_turn>\\n`` per message (``assistant`` written ``model``, a
  system message prefixed to the first user turn), an image part written ``<start_of_image>``,
  which the processor expands to ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x
  ``<image_soft_token>`` + ``<end_of_image>\\n\\n``; the generation prompt
  ``<start_of_turn>model\\n``;
- ``preprocessor_config.json`` (``Gemma3ImageProcessor``: resize to the tower's image size,
  bilinear, rescale, mean = std = 0.5) and ``processor_config.json`` (``Gemma3Processor``,
  ``image_seq_length = mm_tokens_per_image``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from relax.models import family_config, init
from relax.models.vision.gemma3 import Gemma3Vision, Gemma3VisionConfig, Projector
from relax.models.vision.gemma3_checkpoint import save_gemma3
from relax.models.vision.siglip import SiglipConfig, init_siglip
from relax.tasks.tiny_vlm import UNK, added_tokens, build_tokenizer
from relax.tasks.visual import VisualTask

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "write_tiny_gemma3"]

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, IMAGE_SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
SPECIAL_TOKENS = (PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, BOI, IMAGE_SOFT, EOI)
ROLES = ("system", "user", "model", "assistant")

# Gemma 3's chat template (google/gemma-3-*-it), as published
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _tokenizer_config(tok, max_positions: int) -> dict:
    """``tokenizer_config.json``: the added tokens, the named ones and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens(tok),
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "boi_token": BOI,
        "image_token": IMAGE_SOFT,
        "eoi_token": EOI,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "split_special_tokens": False,
    }


def _processor_configs(image_size: int, mm_tokens: int) -> tuple[dict, dict]:
    """``preprocessor_config.json`` (the image processor) and ``processor_config.json``."""
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": None,
        "do_pan_and_scan": None,
        "image_seq_length": mm_tokens,
    }
    return image, {"processor_class": "Gemma3Processor", "image_seq_length": mm_tokens}


def write_tiny_gemma3(
    directory: str | os.PathLike,
    task: VisualTask,
    *,
    key: jax.Array,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    sliding_window: int = 16,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    patch_size: int = 14,
    mm_tokens_per_image: int = 4,
    max_positions: int = 256,
    std: float = 0.02,
) -> Path:
    """Write a random tiny Gemma 3 for ``task`` to ``directory`` (module docstring); its path.

    The language model has ``num_layers`` layers of width ``hidden_size`` (GeGLU of twice that,
    head dim ``hidden_size / num_heads``), all but the last sliding (window ``sliding_window``);
    the tower ``vision_depth`` blocks of width ``vision_hidden`` on ``task.image_size``-pixel
    images cut in ``patch_size``-pixel patches, pooled to ``mm_tokens_per_image`` soft tokens of
    width ``hidden_size``. Weights are ``N(0, std)``; the language model's norms identity, the
    tower's LayerNorms and the projector's norm off identity by ``N(0, std)``."""
    root = Path(directory)
    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    tok = build_tokenizer(task, SPECIAL_TOKENS, ROLES)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    lm_config = family_config(
        "gemma3_text",
        vocab_size=-(-n_vocab // 16) * 16,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        sliding_window=sliding_window,
        layer_types=("sliding",) * (num_layers - 1) + ("full",),
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=float(head_dim),
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=(ids[EOS], ids[END_OF_TURN]),
        pad_token_id=ids[PAD],
    )
    siglip = SiglipConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_layers=vision_depth,
        num_heads=vision_heads,
        image_size=task.image_size,
        patch_size=patch_size,
    )
    vision_config = Gemma3VisionConfig(
        siglip,
        mm_tokens_per_image=mm_tokens_per_image,
        image_token_id=ids[IMAGE_SOFT],
        boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI],
    )
    k_lm, k_tower, k_norm, k_proj = jax.random.split(key, 4)
    projector = Projector(
        std * jax.random.normal(k_norm, (vision_hidden,), jnp.float32),
        std * jax.random.normal(k_proj, (vision_hidden, hidden_size), jnp.float32),
    )
    vision = Gemma3Vision(init_siglip(siglip, k_tower, std=std), projector, vision_config)
    save_gemma3(init(lm_config, k_lm, std=std), vision, root)

    tok.save(str(root / "tokenizer.json"))
    config = _tokenizer_config(tok, max_positions)
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    image, processor = _processor_configs(task.image_size, mm_tokens_per_image)
    (root / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (root / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return root
