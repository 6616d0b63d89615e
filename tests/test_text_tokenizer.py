"""relax.text tokenizers: loading, special ids, encode/decode, saving; parity with transformers.

Model directories in the styles of Qwen2.5 / Qwen3 / Llama 3 / Mistral / Gemma / Hermes are
built in-test (tests/text_fixtures.py). Tests marked ``parity`` compare token for token with
``transformers.AutoTokenizer`` and are skipped without it; the others check relax's own rules.
"""

import json
import pickle

import pytest
from text_fixtures import CORPUS, MULTI_TURN, STYLES, USER_ONLY
from tokenizers import Tokenizer, models, pre_tokenizers

from relax.text import HFTokenizer, SentencePieceTokenizer, TokenizerFormatError, load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece

TEXTS = [
    "Hello world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\n",
    "Ünïcödé café naïve 日本語 😀",
    "",
    " ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<s>[INST] hi [/INST] ok</s>",
    '<tool_call>{"a": 1}</tool_call>',
    "a <|eot_id|>b<|begin_of_text|> c",
    "<bos><start_of_turn>model\n<mask> x<start_of_image>",
    "xyzq ~~ QQQ ''s n't",
    "<think>\nhmm\n</think>\n\n",
    "<|image_pad|><|endoftext|>",
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    texts = [
        "Hello world! This is a tiny corpus. café naïve",
        "another line  with  spaces",
        "user assistant",
    ] * 30
    return train_sentencepiece(texts, tmp_path_factory.mktemp("sp") / "m", vocab_size=90)


# ---- loading ----


def test_load_directory_or_file(model_dirs):
    d = model_dirs["llama3"]
    from_dir, from_file = load_tokenizer(d), load_tokenizer(d / "tokenizer.json")
    assert isinstance(from_dir, HFTokenizer) and from_dir.path == d
    assert from_file.path == d / "tokenizer.json"
    assert from_dir.encode("Hello world") == from_file.encode("Hello world")
    assert from_file.has_chat_template  # sidecars read next to the file


def test_load_errors_name_the_path(tmp_path, model_dirs):
    with pytest.raises(FileNotFoundError, match="not found.*nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match="empty.*no tokenizer.json or tokenizer.model.*nothing"
    ):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFormatError, match="bad/tokenizer.json"):
        load_tokenizer(tmp_path / "bad")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="notes.txt: not a tokenizer file"):
        load_tokenizer(tmp_path / "notes.txt")
    broken = tmp_path / "broken_config"
    broken.mkdir()
    (broken / "tokenizer.json").write_text((model_dirs["qwen25"] / "tokenizer.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(TokenizerFormatError, match="tokenizer_config.json: eos_token"):
        load_tokenizer(broken)
    (broken / "tokenizer_config.json").write_text("{}")
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerFormatError, match="generation_config.json: eos_token_id"):
        load_tokenizer(broken)


# ---- special ids ----


def test_special_ids_stop_tokens_and_pad_fallback(model_dirs):
    llama = load_tokenizer(model_dirs["llama3"])
    tid = llama.token_to_id
    assert llama.bos_token_id == tid("<|begin_of_text|>")
    # the tokenizer's eos first, then generation_config.json's others (Llama 3 has three)
    assert llama.eos_token_ids == (tid("<|eot_id|>"), tid("<|end_of_text|>"), tid("<|eom_id|>"))
    assert llama.pad_token_id == tid("<|eot_id|>")  # no pad token: the first eos
    qwen = load_tokenizer(model_dirs["qwen25"])
    assert qwen.bos_token_id is None
    assert qwen.eos_token_ids == (qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>"))
    assert qwen.pad_token_id == qwen.token_to_id("<|endoftext|>")
    hermes = load_tokenizer(
        model_dirs["hermes"]
    )  # tokens only in the legacy special_tokens_map.json
    assert hermes.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    assert hermes.eos_token_ids == (hermes.token_to_id("<|im_end|>"),)


def test_config_tokens_missing_from_tokenizer_json_are_added(model_dirs):
    gemma = load_tokenizer(model_dirs["gemma"])
    base = Tokenizer.from_file(str(model_dirs["gemma"] / "tokenizer.json")).get_vocab_size()
    mask, image = gemma.token_to_id("<mask>"), gemma.token_to_id("<start_of_image>")
    assert sorted((mask, image)) == [base, base + 1]
    assert gemma.vocab_size == base + 2  # largest id + 1, added tokens included
    assert gemma.encode("a<mask>", add_special_tokens=False)[-1] == mask
    assert gemma.decode([mask, image], skip_special_tokens=True) == ""


# ---- encode / decode semantics ----


def test_add_special_tokens_is_the_post_processor(model_dirs, tmp_path):
    llama = load_tokenizer(model_dirs["llama3"])
    assert llama.encode("Hello") == [llama.bos_token_id] + llama.encode(
        "Hello", add_special_tokens=False
    )
    qwen = load_tokenizer(model_dirs["qwen25"])
    assert qwen.encode("Hello") == qwen.encode("Hello", add_special_tokens=False)
    # add_bos_token in tokenizer_config.json changes nothing when tokenizer.json exists
    # (transformers 5 drops it): no post-processor, so nothing is added.
    tok = Tokenizer.from_file(str(model_dirs["llama3"] / "tokenizer.json"))
    tok.post_processor = None
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "add_bos_token": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    bare = load_tokenizer(tmp_path)
    assert bare.encode("Hello") == bare.encode("Hello", add_special_tokens=False)


def test_no_double_bos_in_chat_prompts(model_dirs):
    for style in ("llama3", "gemma", "mistral"):
        tok = load_tokenizer(model_dirs[style])
        kwargs = {"date_string": "26 Jul 2024"} if style == "llama3" else {}
        ids = tok.apply_chat_template(MULTI_TURN, add_generation_prompt=True, **kwargs)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, style
        text = tok.apply_chat_template(
            MULTI_TURN, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert ids == tok.encode(text, add_special_tokens=False)


def test_decode_and_special_tokens(model_dirs):
    qwen = load_tokenizer(model_dirs["qwen25"])
    ids = qwen.encode("<|im_start|>user\nhi <tool_call><|im_end|>")
    assert ids[0] == qwen.token_to_id("<|im_start|>")  # special strings in text are their tokens
    assert qwen.decode(ids) == "<|im_start|>user\nhi <tool_call><|im_end|>"
    # <tool_call> is an added but not special token (as in Qwen): kept when skipping specials
    assert qwen.decode(ids, skip_special_tokens=True) == "user\nhi <tool_call>"
    import numpy as np

    assert qwen.decode(np.asarray(ids, dtype=np.int32)) == qwen.decode(ids)
    with pytest.raises(ValueError, match="decode_batch"):
        qwen.decode(np.asarray([ids]))
    rows = np.asarray([ids, ids[::-1]])
    mask = np.zeros_like(rows)
    mask[:, 2:] = 1
    assert qwen.decode_batch(rows, mask, skip_special_tokens=True) == [
        qwen.decode(r[2:], skip_special_tokens=True) for r in rows
    ]
    assert qwen.decode_batch([ids, []]) == [qwen.decode(ids), ""]
    for text in TEXTS:
        assert qwen.decode(qwen.encode(text)) == text  # byte-level BPE round-trips everything
    assert qwen.encode_batch(TEXTS) == [qwen.encode(t) for t in TEXTS]


def test_pickle_round_trip(model_dirs, sp_model):
    for tok in (load_tokenizer(model_dirs["llama3"]), load_tokenizer(sp_model)):
        again = pickle.loads(pickle.dumps(tok))
        assert again.encode("Hello world") == tok.encode("Hello world")
        assert (
            again.apply_chat_template(
                USER_ONLY, tokenize=False, chat_template="{{ messages[0].content }}"
            )
            == USER_ONLY[0]["content"]
        )


# ---- saving ----


def test_save_pretrained_round_trip(model_dirs, tmp_path):
    for style in STYLES:
        tok = load_tokenizer(model_dirs[style])
        out = tok.save_pretrained(tmp_path / style)
        again = load_tokenizer(out)
        kwargs = {"date_string": "26 Jul 2024"} if style == "llama3" else {}
        for attr in (
            "bos_token_id",
            "eos_token_ids",
            "pad_token_id",
            "vocab_size",
            "special_tokens",
            "chat_template",
        ):
            assert getattr(again, attr) == getattr(tok, attr), (style, attr)
        assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
        assert again.apply_chat_template(
            MULTI_TURN, add_generation_prompt=True, **kwargs
        ) == tok.apply_chat_template(MULTI_TURN, add_generation_prompt=True, **kwargs)
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert (out / "tokenizer.json").read_bytes() == (
            model_dirs[style] / "tokenizer.json"
        ).read_bytes()
    gemma_out = tmp_path / "gemma"  # the template came as chat_template.jinja: copied, not inlined
    assert (gemma_out / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((gemma_out / "tokenizer_config.json").read_text())


def test_save_pretrained_keeps_generation_config_and_drops_stale_template(model_dirs, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "temperature": 0.6}))
    (out / "chat_template.jinja").write_text("stale {{ messages }}")
    load_tokenizer(model_dirs["qwen25"]).save_pretrained(out)
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.6
    assert not (out / "chat_template.jinja").exists()  # it would override the config's template
    assert load_tokenizer(out).chat_template == load_tokenizer(model_dirs["qwen25"]).chat_template


# ---- sentencepiece ----


def test_sentencepiece_model_loads(sp_model):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (2, (3,), 0)
    assert tok.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    body = tok.tokenizer.encode("Hello world")
    assert tok.encode("Hello world") == [2] + body  # BOS: the sentencepiece / Llama-2 convention
    assert tok.encode("Hello world", add_special_tokens=False) == body
    assert tok.decode(tok.encode(" Hello  world"), skip_special_tokens=True) == " Hello  world"
    assert tok.decode([2] + body) == "<s>Hello world"
    # special token strings in text are their ids; the text between is encoded on its own
    ids = tok.encode("Hello</s><s>world", add_special_tokens=False)
    assert ids == tok.tokenizer.encode("Hello") + [3, 2] + tok.tokenizer.encode("world")
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match=r"m\.model has no chat template"):
        tok.apply_chat_template(USER_ONLY)


def test_sentencepiece_directory_with_config(sp_model, tmp_path):
    d = tmp_path / "spdir"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    template = "{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "add_bos_token": False})
    )
    tok = load_tokenizer(d)
    assert isinstance(tok, SentencePieceTokenizer) and tok.path == d
    assert tok.encode("Hello") == tok.encode(
        "Hello", add_special_tokens=False
    )  # add_bos_token: false
    ids = tok.apply_chat_template(USER_ONLY)
    assert ids[0] == 2 and ids[-1] == 3 and ids.count(2) == 1
    again = load_tokenizer(tok.save_pretrained(tmp_path / "saved"))
    assert again.apply_chat_template(USER_ONLY) == ids and again.encode("Hello") == tok.encode(
        "Hello"
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|not_a_piece|>"}))
    with pytest.raises(TokenizerFormatError, match="not_a_piece.*is not a piece"):
        load_tokenizer(d)


# ---- parity with transformers ----


@pytest.mark.parity
@pytest.mark.parametrize("style", STYLES)
def test_encode_decode_match_transformers(style, model_dirs, auto):
    hf, ours = auto(model_dirs[style]), load_tokenizer(model_dirs[style])
    assert type(hf).__name__ in ("TokenizersBackend", "Qwen2Tokenizer")
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    every = list(range(ours.vocab_size))
    for chunk in (every[:40], every[-40:], every[::7]):
        for skip in (True, False):
            assert ours.decode(chunk, skip_special_tokens=skip) == hf.decode(
                chunk, skip_special_tokens=skip
            )


@pytest.mark.parity
@pytest.mark.parametrize("style", STYLES)
def test_special_ids_match_transformers(style, model_dirs, auto):
    hf, ours = auto(model_dirs[style]), load_tokenizer(model_dirs[style])
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id == ours.eos_token_ids[0]
    assert ours.pad_token_id == (
        hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    )
    assert ours.vocab_size == len(hf)
    assert ours.special_tokens == hf.special_tokens_map


@pytest.mark.parity
@pytest.mark.parametrize("style", STYLES)
def test_saved_directory_matches_in_transformers(style, model_dirs, auto, tmp_path):
    ours = load_tokenizer(model_dirs[style])
    hf = auto(ours.save_pretrained(tmp_path / style))
    kwargs = {"date_string": "26 Jul 2024"} if style == "llama3" else {}
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == hf.decode(
            hf.encode(text), skip_special_tokens=True
        )
    for messages in (USER_ONLY, MULTI_TURN):
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False, **kwargs
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (
        hf.bos_token_id,
        hf.eos_token_id,
        len(hf),
    )


@pytest.mark.parity
def test_sentencepiece_matches_transformers(sp_model, tmp_path, auto):
    d = tmp_path / "spdir"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    ours = load_tokenizer(d)
    hf = auto(ours.save_pretrained(tmp_path / "saved"))
    assert type(hf).__name__ == "SentencePieceBackend"
    for text in [
        "Hello world",
        " Hello  world",
        "café\nnaïve x",
        "Hello world </s> again<s>",
        "user: hi",
        "",
    ]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
    for text in ["Hello world", "café naïve</s>", "another line with spaces"]:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        )
    for messages in (USER_ONLY, MULTI_TURN):
        assert ours.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(
            messages, tokenize=False
        )
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, return_dict=False
        )
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.vocab_size) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
        len(hf),
    )


@pytest.mark.parity
def test_clean_up_tokenization_spaces_matches_transformers(tmp_path, auto):
    words = sorted(
        {w for line in CORPUS for w in line.split()} | {".", ",", "?", "'s", "n't", "[UNK]"}
    )
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "clean_up_tokenization_spaces": True,
                "unk_token": "[UNK]",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    ours, hf = load_tokenizer(tmp_path), auto(tmp_path)
    ids = ours.encode("Hello world . is it ? tiny 's n't")
    assert ids == hf.encode("Hello world . is it ? tiny 's n't")
    assert (
        ours.decode(ids) == hf.decode(ids) == "Hello [UNK]. is [UNK]? tiny'sn't"
    )  # spaces cleaned up
