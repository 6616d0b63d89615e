"""Text in and out of models: Hugging Face tokenizers and chat templates, without transformers.

    from relax.text import load_tokenizer

    tok = load_tokenizer("path/to/model")            # tokenizer.json or sentencepiece model
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    tok.eos_token_ids                                 # every stop token, generation_config's too
    tok.save_pretrained("out/")                       # transformers.AutoTokenizer loads it

Modules: ``loader`` (``load_tokenizer``), ``base`` (the common interface), ``hf``
(``tokenizer.json`` via the ``tokenizers`` library), ``sentencepiece`` (``.model`` files via
``relax.text.sentencepiece_model``), ``chat_template`` (Jinja rendering as transformers does it), ``files``
(reading the sidecar files), ``saving`` (writing them).
"""

from relax.text.base import TextTokenizer
from relax.text.chat_template import NoChatTemplateError, render_chat
from relax.text.files import TokenizerFormatError
from relax.text.hf import HFTokenizer
from relax.text.loader import load_tokenizer
from relax.text.sentencepiece import SentencePieceTokenizer

__all__ = [
    "HFTokenizer",
    "NoChatTemplateError",
    "SentencePieceTokenizer",
    "TextTokenizer",
    "TokenizerFormatError",
    "load_tokenizer",
    "render_chat",
]
