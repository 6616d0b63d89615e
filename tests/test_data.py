"""Tests for relax.data.prompts: small jsonl / parquet files in tmp_path and a tiny sentencepiece model."""

import dataclasses
import json

import numpy as np
import pytest
from text_fixtures import make_model_dir

import relax.data.files as data_files
from relax.data.prompts import (
    DataConfig,
    Record,
    eval_records,
    load_records,
    prepare_prompts,
    prompt_batch,
    prompt_dataset,
    prompt_iterator,
    read_records,
    read_splits,
    train_eval_split,
)
from relax.text import load_tokenizer
from relax.text.sentencepiece_model import train_sentencepiece


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A sentencepiece tokenizer without a chat template; ``encode`` adds BOS (Llama 2's rule)."""
    texts = [f"question {i}: what is {i} plus {2 * i} ? say the answer" for i in range(300)]
    model = train_sentencepiece(texts, tmp_path_factory.mktemp("spm") / "tiny", vocab_size=100)
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def chat_toks(tmp_path_factory):
    """tokenizer.json tokenizers with their chat templates: Qwen2.5 (no BOS anywhere) and Llama 3
    (the template writes the BOS; encode adds one too)."""
    root = tmp_path_factory.mktemp("hf")
    return {style: load_tokenizer(make_model_dir(root, style)) for style in ("qwen25", "llama3")}


def _rows(n, **extra):
    return [
        {"prompt": f"question {i}: what is {i} plus {2 * i} ?", "answer": str(3 * i), **extra}
        for i in range(n)
    ]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path, **kw):
    kw = {"batch_size": 4, "max_prompt_tokens": 32, **kw}
    return DataConfig(path, **kw)


def _take(it, k):
    return [next(it) for _ in range(k)]


def _iter(cfg, tok, **kw):
    return prompt_iterator(cfg, tok, process_index=kw.get("pi", 0), process_count=kw.get("pc", 1))


def test_shapes_padding_and_fields(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", _rows(8, level=1, data_source="math"))
    b = next(_iter(_cfg(f), tok))
    assert b.prompt_ids.shape == b.prompt_mask.shape == (4, 32)
    assert b.prompt_ids.dtype == b.prompt_mask.dtype == np.int32
    for ids, mask, text in zip(b.prompt_ids, b.prompt_mask, b.prompts):
        n = int(mask.sum())
        assert mask[-n:].all() and not mask[:-n].any()  # left padded
        assert (ids[:-n] == tok.pad_token_id).all()
        assert ids[-n] == tok.bos_token_id and list(ids[-n + 1 :]) == tok.encode(
            text, add_special_tokens=False
        )
    assert [int(a) for a in b.answers] == [3 * int(p.split()[1][:-1]) for p in b.prompts]
    assert b.fields == {"level": [1] * 4} and b.data_source == ["math"] * 4


def test_buckets_and_the_tokenizers_own_special_tokens(tmp_path, tok, chat_toks):
    f = _jsonl(tmp_path / "d.jsonl", _rows(8))
    b = next(_iter(_cfg(f, prompt_buckets=(8, 16, 24)), tok))
    assert b.prompt_ids.shape[1] == 16 and b.prompt_mask[:, 0].sum() < 4
    # a plain prompt gets exactly what the tokenizer adds: Llama 3's BOS, nothing for Qwen2.5
    for style, bos in (("llama3", True), ("qwen25", False)):
        b = next(
            _iter(
                _cfg(f, shuffle=False, chat_template="never", max_prompt_tokens=64),
                chat_toks[style],
            )
        )
        ids = list(b.prompt_ids[0][b.prompt_mask[0] == 1])
        body = chat_toks[style].encode(b.prompts[0], add_special_tokens=False)
        assert ids == ([chat_toks[style].bos_token_id] if bos else []) + body, style
    with pytest.raises(ValueError, match="prompt_buckets"):
        _cfg(f, prompt_buckets=(16, 8))


def test_shuffle_seed_determinism_and_epochs(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", _rows(8))
    order = lambda **kw: [p for b in _take(_iter(_cfg(f, **kw), tok), 4) for p in b.prompts]
    a, a2, b = order(seed=1), order(seed=1), order(seed=2)
    assert a == a2 and a != b
    assert sorted(a[:8]) == sorted(a[8:]) == sorted(r["prompt"] for r in _rows(8))
    assert a[:8] != a[8:]  # each epoch has its own order
    assert order(shuffle=False)[:8] == [r["prompt"] for r in _rows(8)]


def test_finite_epochs_drop_partial_batch(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", _rows(6))
    batches = list(_iter(_cfg(f, num_epochs=2), tok))
    assert len(batches) == 3 and all(len(b.prompts) == 4 for b in batches)
    with pytest.raises(ValueError, match="no full batch"):
        _iter(_cfg(f, num_epochs=1, batch_size=8), tok)


def test_process_sharding(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", _rows(8))  # batches do not straddle epochs: rows distinct
    cfg = _cfg(f, prompt_buckets=(8, 16, 24))
    full = _take(_iter(cfg, tok), 5)
    p0, p1 = _take(_iter(cfg, tok, pi=0, pc=2), 5), _take(_iter(cfg, tok, pi=1, pc=2), 5)
    for g, a, b in zip(full, p0, p1):
        assert len(a.prompts) == len(b.prompts) == 2
        assert not set(a.prompts) & set(b.prompts)
        assert a.prompts + b.prompts == g.prompts and a.answers + b.answers == g.answers
        np.testing.assert_array_equal(np.concatenate([a.prompt_ids, b.prompt_ids]), g.prompt_ids)
        np.testing.assert_array_equal(np.concatenate([a.prompt_mask, b.prompt_mask]), g.prompt_mask)
    with pytest.raises(ValueError, match="divide"):
        _iter(_cfg(f, batch_size=3), tok, pi=0, pc=2)


def test_missing_field_names_file_row_field(tmp_path, tok):
    rows = _rows(4)
    del rows[2]["answer"]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    with pytest.raises(KeyError, match=rf"{f}: row 4: missing field 'answer'") as err:
        _iter(_cfg(f), tok)
    assert str(err.value).startswith(str(f))  # the message itself, not its repr
    with pytest.raises(KeyError, match=rf"{f}: row 4: missing field 'answer'"):
        load_records(f, fields=["prompt", "answer"])
    assert len(load_records(f, fields=["prompt"])) == 3
    assert next(_iter(_cfg(f, answer_field=None, batch_size=3), tok)).answers == [None] * 3


def test_bad_json_and_empty_file(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer}\n')
    with pytest.raises(ValueError, match=rf"{f}: line 2: invalid JSON"):
        load_records(f)
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1: expected a JSON object"):
        load_records(tmp_path / "list.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'empty.jsonl'}: data file is empty"):
        _iter(_cfg(tmp_path / "empty.jsonl"), tok)
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "nope.jsonl")


def test_overlong_prompts_are_dropped_by_default_and_counted(tmp_path, tok):
    rows = _rows(6)
    long_a = " ".join(f"question {i}: what is" for i in range(20)) + " 7 plus 14 ?"
    rows[1]["prompt"], rows[4]["prompt"] = long_a, long_a + " and more and more"
    f = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _cfg(f, shuffle=False, max_prompt_tokens=12)
    prepared = prepare_prompts(read_records(f), cfg, tok)
    lengths = [len(tok.encode(r["prompt"])) for r in rows]  # the independent count
    s = prepared.stats
    assert s.action == "drop" and s.rows == 6 and s.kept == 4 and s.dropped == 2
    assert [(o.row, o.tokens) for o in s.over_budget] == [
        (5, lengths[4]),
        (2, lengths[1]),
    ]  # longest first
    assert s.percentiles() == {
        f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 99)
    } | {"max": max(lengths)}
    assert [e.text for e in prepared.examples] == [rows[i]["prompt"] for i in (0, 2, 3, 5)]
    message = s.over_budget_message("training")
    assert (
        f"2 of 6 training prompts are over --max-prompt-tokens 12: {f} row 5 ({lengths[4]} tokens)"
        in message
    )
    assert "dropped" in message
    b = next(_iter(cfg, tok))
    assert long_a not in b.prompts and b.prompt_ids.shape == (4, 12)
    with pytest.warns(UserWarning, match="2 of 6 held-out prompts are over"):
        assert prompt_batch(read_records(f), cfg, tok).prompt_ids.shape[0] == 4


def test_overlong_truncate_keeps_end_and_reject_names_row(tmp_path, tok):
    rows = _rows(4)
    rows[1]["prompt"] = " ".join(f"question {i}: what is" for i in range(20)) + " 7 plus 14 ?"
    f = _jsonl(tmp_path / "d.jsonl", rows)
    b = next(_iter(_cfg(f, shuffle=False, max_prompt_tokens=12, overlong="truncate"), tok))
    assert b.prompt_ids.shape == (4, 12) and b.prompts[1] == rows[1]["prompt"]  # row kept
    assert b.prompt_mask[1].all()
    assert (
        list(b.prompt_ids[1])
        == [tok.bos_token_id] + tok.encode(rows[1]["prompt"], add_special_tokens=False)[-11:]
    )
    n = len(tok.encode(rows[1]["prompt"]))
    with pytest.raises(
        ValueError, match=rf"{f}: row 2: prompt has {n} tokens > max_prompt_tokens=12"
    ):
        _iter(_cfg(f, max_prompt_tokens=12, overlong="reject"), tok)
    with pytest.raises(ValueError, match="no training prompt is within max_prompt_tokens=2"):
        _iter(_cfg(f, max_prompt_tokens=2), tok)


def test_truncated_chat_prompt_keeps_header_and_system_prompt(tmp_path, chat_toks):
    question = (
        "Compute the sum. "
        + " ".join(f"item {i} costs {i} coins." for i in range(40))
        + " What is the total?"
    )
    msgs = [
        {"role": "system", "content": "You are a careful accountant."},
        {"role": "user", "content": question},
    ]
    f = _jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": msgs, "answer": "780"}, {"prompt": "short", "answer": "1"}],
    )
    for style, t in chat_toks.items():
        full = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        budget = len(full) // 2
        cfg = _cfg(f, batch_size=1, shuffle=False, max_prompt_tokens=budget, overlong="truncate")
        prepared = prepare_prompts(read_records(f), cfg, t)
        cut = prepared.examples[0]
        assert (
            len(cut.ids) <= budget
            and prepared.stats.kept == 2
            and len(prepared.stats.over_budget) == 1
        )
        assert "You are a careful accountant." in cut.text and "What is the total?" in cut.text
        assert "item 0 costs" not in cut.text
        # the fewest tokens cut: one more content token would not fit
        content = t.encode(question, add_special_tokens=False)
        kept = next(
            k
            for k in range(len(content), -1, -1)
            if len(
                t.apply_chat_template(
                    [msgs[0], {"role": "user", "content": t.decode(content[len(content) - k :])}],
                    add_generation_prompt=True,
                    tokenize=True,
                )
            )
            <= budget
        )
        assert cut.text == t.apply_chat_template(
            [msgs[0], {"role": "user", "content": t.decode(content[len(content) - kept :])}],
            add_generation_prompt=True,
            tokenize=False,
        ), style
        fixed = len(
            t.apply_chat_template(
                [msgs[0], {"role": "user", "content": ""}], add_generation_prompt=True
            )
        )
        tiny = prepare_prompts(
            read_records(f),
            _cfg(f, batch_size=1, max_prompt_tokens=fixed - 1, overlong="truncate"),
            t,
        )
        # the system prompt and the template are never cut: a prompt they alone put over is dropped
        assert 1 in [o.row for o in tiny.stats.over_budget], style
        assert tiny.stats.uncuttable == len(tiny.stats.over_budget) == tiny.stats.dropped, style


def test_batches_pad_to_the_datas_longest_bucket_by_default(tmp_path, tok):
    rows = _rows(8)
    rows[5]["prompt"] = " ".join(f"question {i}: what is" for i in range(4)) + " 7 plus 14 ?"
    f = _jsonl(tmp_path / "d.jsonl", rows)
    longest = max(len(tok.encode(r["prompt"])) for r in rows)
    buckets = (8, 16, 24, 32)
    want = next(b for b in buckets if b >= longest)
    shapes = {
        b.prompt_ids.shape[1]
        for b in _take(_iter(_cfg(f, prompt_buckets=buckets, batch_size=2), tok), 8)
    }
    assert shapes == {want}
    shapes = {
        b.prompt_ids.shape[1]
        for b in _take(_iter(_cfg(f, prompt_buckets=buckets, batch_size=2, pad_to="batch"), tok), 8)
    }
    assert len(shapes) > 1 and max(shapes) == want


def test_chat_prompts_use_the_models_template_with_one_bos(tmp_path, tok, chat_toks):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = [{"prompt": msgs, "answer": "ok"}, {"prompt": "hi", "answer": "ok"}]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    user = [{"role": "user", "content": "hi"}]
    for style, t in chat_toks.items():  # auto: a chat model's template for string prompts too
        b = next(_iter(_cfg(f, batch_size=2, shuffle=False, max_prompt_tokens=128), t))
        render = lambda m, tokenize: t.apply_chat_template(
            m, add_generation_prompt=True, tokenize=tokenize
        )  # noqa: E731
        assert b.prompts == [render(msgs, False), render(user, False)], style
        for i, m in enumerate((msgs, user)):
            ids = list(b.prompt_ids[i][b.prompt_mask[i] == 1])
            assert ids == render(m, True), style
            assert ids.count(t.bos_token_id) == (1 if style == "llama3" else 0), (
                style
            )  # never a second BOS
        b = next(
            _iter(
                _cfg(f, batch_size=2, shuffle=False, max_prompt_tokens=128, system_prompt="sys"), t
            )
        )
        assert b.prompts == [
            render(msgs, False),  # already has a system message
            render([{"role": "system", "content": "sys"}] + user, False),
        ], style
    with pytest.raises(ValueError, match=rf"{f}: row 1: field 'prompt': .*has no chat template"):
        _iter(_cfg(f, batch_size=1), tok)  # messages, and a tokenizer without a template
    with pytest.raises(
        ValueError,
        match=rf"{f}: row 1: field 'prompt': a list of chat messages needs a chat template",
    ):
        _iter(_cfg(f, batch_size=1, chat_template="never"), chat_toks["qwen25"])
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        _cfg(f, system_prompt="sys", chat_template="never")


def test_data_source_must_be_on_every_row(tmp_path, tok):
    rows = _rows(4, data_source="gsm8k")
    del rows[3]["data_source"]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(KeyError, match=r"row 4: missing field 'data_source'"):
        _iter(_cfg(f), tok)
    b = next(_iter(_cfg(f, data_source_field=None), tok))
    assert b.data_source is None and set(b.fields["data_source"]) <= {"gsm8k", None}


def test_parquet_directory_and_file_list(tmp_path, tok, chat_toks):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "hi"}]
    msgs2 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = [
        {"prompt": msgs, "answer": "1", "tag": "p"},
        {"prompt": msgs2, "answer": "2", "tag": "q"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    _jsonl(tmp_path / "a.jsonl", _rows(2))
    recs = load_records(tmp_path)  # a.jsonl then b.parquet
    assert [r["answer"] for r in recs] == ["0", "3", "1", "2"] and recs[2]["prompt"] == msgs
    cfg = _cfg([tmp_path / "b.parquet"], batch_size=2, shuffle=False, max_prompt_tokens=64)
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["path"] == [str(tmp_path / "b.parquet")]
    chat = chat_toks["qwen25"]
    b = next(prompt_iterator(cfg, chat))  # process index/count from jax
    assert b.prompts == [
        chat.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        for m in (msgs, msgs2)
    ]
    assert b.fields == {"tag": ["p", "q"]} and b.answers == ["1", "2"]
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}]), tmp_path / "c.parquet")
    with pytest.raises(KeyError, match=rf"{tmp_path / 'c.parquet'}: row 1: missing field 'answer'"):
        _iter(_cfg(tmp_path / "c.parquet", batch_size=1), tok)


def test_iterator_state_resume_is_exact(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", _rows(7))
    cfg = _cfg(f, seed=3)
    straight = _take(_iter(cfg, tok), 6)
    it = _iter(cfg, tok)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # survives serialisation
    resumed = _iter(cfg, tok)
    resumed.set_state(state)
    for a, b in zip(straight[3:], _take(resumed, 3)):
        assert a.prompts == b.prompts and a.answers == b.answers
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)


def test_train_eval_split(tmp_path, tok):
    items = list(range(20))
    train, held = train_eval_split(items, 0.25, seed=0)
    assert (train, held) == train_eval_split(items, 0.25, seed=0)
    assert len(held) == 5 and sorted(train + held) == items and held == sorted(held)
    assert train_eval_split(items, 0.25, seed=1)[1] != held
    assert train_eval_split(items, 0.0, seed=0) == (items, [])
    f = _jsonl(tmp_path / "d.jsonl", _rows(20))
    cfg = _cfg(f, eval_fraction=0.25, num_epochs=1)
    held_prompts = {r.record["prompt"] for r in eval_records(cfg)}
    seen = {
        p for b in prompt_dataset(cfg, tok, process_index=0, process_count=1) for p in b.prompts
    }
    assert len(held_prompts) == 5 and len(seen) == 12 and not seen & held_prompts
    b = prompt_batch(eval_records(cfg), cfg, tok)
    assert b.prompt_ids.shape == (5, 32) and set(b.prompts) == held_prompts


def test_read_splits_reads_the_file_once_for_both_splits(tmp_path, tok, monkeypatch):
    f = _jsonl(tmp_path / "d.jsonl", _rows(20))
    cfg = _cfg(f, eval_fraction=0.25, num_epochs=1)
    expected_held = eval_records(cfg)
    expected = [b.prompts for b in prompt_dataset(cfg, tok, process_index=0, process_count=1)]
    reads = []
    original = data_files._read_jsonl
    monkeypatch.setattr(
        data_files, "_read_jsonl", lambda file: reads.append(file) or original(file)
    )
    splits = read_splits(cfg)
    assert eval_records(cfg, splits) == expected_held
    assert [
        b.prompts for b in prompt_dataset(cfg, tok, process_index=0, process_count=1, splits=splits)
    ] == expected
    assert reads == [f]


# ------------------------------------------------------------------- encodings, error origins


def test_invalid_utf8_names_file_line_column_and_offset(tmp_path):
    lines = [
        b'{"prompt": "caf\xc3\xa9", "answer": "1"}\r\n',
        b"\r\n",
        b'{"prompt": "ok \xff here", "answer": "2"}\r\n',
    ]
    f = tmp_path / "latin.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b"".join(lines))  # BOM, then the bad byte on line 3
    offset = 3 + len(lines[0]) + len(lines[1]) + lines[2].index(b"\xff")
    column = lines[2].index(b"\xff") + 1  # ASCII before it: characters = bytes
    msg = rf"{f}: line 3: invalid UTF-8 byte 0xff at column {column} \(byte offset {offset} in the file\)"
    with pytest.raises(ValueError, match=msg):
        load_records(f)
    f.write_bytes(
        b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xe2\x82", "answer": "2"}\n'
    )  # cut short
    with pytest.raises(ValueError, match=rf"{f}: line 2: invalid UTF-8 byte 0xe2 at column 13 "):
        read_records(f)


def test_bom_and_line_endings_read_like_plain_utf8(tmp_path):
    rows = [{"prompt": "caf\u00e9 \u00fcber", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    body = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode()
    variants = {
        "lf": body + b"\n",
        "crlf": body.replace(b"\n", b"\r\n") + b"\r\n",
        "cr": body.replace(b"\n", b"\r"),
        "bom": b"\xef\xbb\xbf" + body,
        "bom_crlf_blank": b"\xef\xbb\xbf\r\n" + body.replace(b"\n", b"\r\n\r\n"),
    }
    for name, data in variants.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        assert load_records(tmp_path / f"{name}.jsonl") == rows, name
    assert [r.row for r in read_records(tmp_path / "bom_crlf_blank.jsonl")] == [2, 4]


def test_prompt_batch_errors_name_the_eval_file_and_row(tmp_path, tok):
    cfg = _cfg(_jsonl(tmp_path / "train.jsonl", _rows(8)))
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps(_rows(1)[0]) + "\n\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(ValueError, match=rf"^{ev}: row 3: field 'prompt' is empty$"):
        prompt_batch(read_records(ev, fields=("prompt",)), _cfg(ev, answer_field=None), tok)
    _jsonl(ev, [_rows(1)[0], {"prompt": {"text": "hi"}, "answer": "1"}])
    with pytest.raises(
        ValueError, match=rf"^{ev}: row 2: field 'prompt': prompt must be a string .* got dict"
    ):
        prompt_batch(read_records(ev), cfg, tok)
    with pytest.raises(ValueError, match=r"^<records>: row 2: field 'prompt'"):  # plain dicts
        prompt_batch(load_records(ev), cfg, tok)
    with pytest.raises(TypeError, match=r"<records>: row 1: expected a dict or a Record, got str"):
        prompt_batch(["hi"], cfg, tok)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"prompt": "hi"}, {"prompt": ""}]), tmp_path / "eval.parquet"
    )
    with pytest.raises(
        ValueError, match=rf"^{tmp_path / 'eval.parquet'}: row 2: field 'prompt' is empty"
    ):
        prompt_batch(read_records(tmp_path / "eval.parquet"), _cfg(ev, answer_field=None), tok)


def test_held_out_split_errors_name_the_training_file_and_line(tmp_path, tok):
    rows = _rows(12)
    held = train_eval_split(list(range(12)), 0.25, seed=5)[1]
    rows[held[1]]["prompt"] = 7  # only the held-out split holds the bad row
    f = tmp_path / "train.jsonl"
    f.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # line = index + 2
    cfg = _cfg(f, eval_fraction=0.25, seed=5)
    records = eval_records(cfg)
    assert [(r.file, r.row) for r in records] == [(str(f), i + 2) for i in held]
    assert isinstance(records[0], Record) and records[0].record == rows[held[0]]
    with pytest.raises(ValueError, match=rf"^{f}: row {held[1] + 2}: field 'prompt': .*got int"):
        prompt_batch(records, cfg, tok)
    assert len(next(_iter(cfg, tok)).prompts) == 4  # the training split is fine
