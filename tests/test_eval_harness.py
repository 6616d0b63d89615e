"""``relax eval`` (``relax.eval.harness``) against lm-evaluation-harness 0.4.13 as the reference:
its few-shot sampler, filters, exact_match and task contexts, imported in the tests only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from relax.eval.harness import (
    ItemRecord,
    aggregate,
    build_context,
    build_prompts,
    get_task,
    mean_stderr,
    sample_fewshot,
    truncate_at_stops,
)
from relax.eval.harness.run import load_docs

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "gsm8k_sample"
GSM8K = get_task("gsm8k")

COMPLETIONS = [
    " She has 5 * 12 = 60 crayons.\n#### 53",
    " The answer is $1,250.",
    " #### -5.",
    " It costs 4.50 dollars, so 6 * 4.5 = 27.\n#### 27",
    " no digits here",
    " 7 and then 8 and 9",
    " #### 1,500\n#### 12",
    " The total is $45.00.",
    " x #### abc 12",
    "",
]


def test_fewshot_draws_equal_lm_evals_context_sampler():
    pytest.importorskip("lm_eval")
    from lm_eval.api.samplers import ContextSampler, FirstNSampler

    pool = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(9)]
    docs = pool[:4] + [{"question": "new", "answer": "#### 0"}]
    for same in (False, True):
        ref = ContextSampler(list(pool), rnd=1234)
        want = [ref.sample(3, eval_doc=d if same else None) for d in docs]
        assert sample_fewshot(docs, pool, 3, seed=1234, same_split=same) == want
    ref = FirstNSampler(list(pool), rnd=1234)
    assert sample_fewshot(docs, pool, 2, sampler="first_n") == [ref.sample(2) for _ in docs]


def test_prompt_text_is_lm_evals_layout():
    ex = [{"question": "a?", "answer": "x\n#### 1"}, {"question": "b?", "answer": "#### 2"}]
    got = build_context({"question": "c?", "answer": "#### 3"}, ex, GSM8K.layout)
    assert got == (
        "Question: a?\nAnswer: x\n#### 1\n\nQuestion: b?\nAnswer: #### 2\n\nQuestion: c?\nAnswer:"
    )


def test_filters_and_exact_match_equal_lm_evals():
    pytest.importorskip("lm_eval")
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter as LMRegex

    lm_filters = {
        "strict-match": LMRegex(regex_pattern=r"#### (\-?[0-9\.\,]+)"),
        "flexible-extract": LMRegex(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1),
    }
    target = "Some steps, $1,250 in total.\n#### 1,250"
    for pipeline in GSM8K.filters:
        want = [r[0] for r in lm_filters[pipeline.name].apply([[c] for c in COMPLETIONS], [])]
        got = [pipeline.apply(c) for c in COMPLETIONS]
        assert got == want, pipeline.name
        for answer in [*got, "1250", "1,250.", "$1250", "1250 ", "#### 1250"]:
            ref = exact_match_hf_evaluate(
                predictions=[answer],
                references=[target],
                regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"],
                ignore_case=True,
            )["exact_match"]
            assert GSM8K.metric(answer, target) == ref, answer
    assert GSM8K.metric("1250", target) == 1.0  # the metric is not trivially 0


def test_stop_strings_cut_as_lm_eval_does():
    pytest.importorskip("lm_eval")
    from lm_eval.models.utils import postprocess_generated_text

    until = ["Question:", "</s>", "<|im_end|>", ""]
    texts = [
        " 12\n\nQuestion: next",
        " a</s>b Question:",
        " none",
        "Question:",
        " x<|im_end|>y</s>",
    ]
    for t in texts:
        assert truncate_at_stops(t, until) == postprocess_generated_text(t, until, None)


def record(verdicts: dict, source=None) -> ItemRecord:
    return ItemRecord(0, "0", source, "", "", ("",) * 3, {k: () for k in verdicts}, verdicts)


def test_aggregation_by_hand():
    recs = [
        record({"f": (1.0, 1.0, 0.0)}, "a"),
        record({"f": (0.0, 0.0, 0.0)}, "a"),
        record({"f": (1.0, 0.0, 0.0)}, "b"),
    ]
    out = aggregate(recs, "exact_match", ks=(1, 2))
    # item scores 2/3, 0, 1/3: mean 1/3; sample variance ((1/3)^2 + (1/3)^2 + 0) / 2 = 1/9
    assert out["exact_match,f"] == pytest.approx(1 / 3)
    assert out["exact_match_stderr,f"] == pytest.approx(math.sqrt(1 / 9) / math.sqrt(3))
    # pass@2 with n=3: c=2 -> 1; c=0 -> 0; c=1 -> 1 - C(2,2)/C(3,2) = 2/3
    assert out["pass@2,f"] == pytest.approx((1 + 0 + 2 / 3) / 3)
    assert out["pass@1,f"] == pytest.approx(1 / 3)
    assert math.isnan(mean_stderr([1.0]))
    from relax.eval.harness import build_report

    rep = build_report("t", recs, "exact_match", meta={})
    assert rep["by_source"]["a"]["exact_match,f"] == pytest.approx(1 / 3)
    assert rep["by_source"]["b"]["exact_match,f"] == pytest.approx(1 / 3)


def lm_eval_contexts(tmp_path: Path, limit: int, num_fewshot: int = 5, **chat) -> list[str]:
    """lm-eval's own contexts for its gsm8k task on the local sample files (nothing downloaded);
    ``chat``: ``build_all_requests``'s chat options (``apply_chat_template``, ...)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    import lm_eval
    from lm_eval.tasks import TaskManager, get_task_dict

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    base = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    (tmp_path / "gsm8k_local.yaml").write_text(
        textwrap.dedent(f"""\
        include: {base}
        task: gsm8k_local
        dataset_path: json
        dataset_name: null
        num_fewshot: {num_fewshot}
        dataset_kwargs:
          data_files:
            train: {DATA / "train.jsonl"}
            test: {DATA / "test.jsonl"}
        """)
    )
    task = get_task_dict(["gsm8k_local"], TaskManager(include_path=str(tmp_path)))["gsm8k_local"]
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=limit, **chat)
    return [inst.args[0] for inst in task.instances]


@pytest.mark.slow  # lm-eval's task loading (datasets) takes ~10 s
def test_gsm8k_prompts_are_byte_identical_to_lm_evals(tmp_path):
    pytest.importorskip("lm_eval")
    want = lm_eval_contexts(tmp_path, limit=44)
    docs = load_docs(str(DATA / "test.jsonl"), GSM8K.fields)
    pool = load_docs(str(DATA / "train.jsonl"), GSM8K.fields)
    got = build_prompts(GSM8K, docs, pool, num_fewshot=5, seed=1234, same_split=False)
    assert len(want) == len(got) == 44
    assert got == want
    assert len(set(got)) == 44 and got[0] != got[1]  # draws differ between items


@pytest.mark.slow  # lm-eval's task loading (datasets), three times
def test_chat_prompts_are_byte_identical_to_lm_evals(tmp_path):
    """``--apply-chat-template`` (multi-turn few-shot, lm-eval's default with it, and one user
    turn) and ``--system-instruction``, against lm-eval's contexts rendered by transformers'
    ``apply_chat_template`` as lm-eval's ``hf`` model renders them."""
    pytest.importorskip("lm_eval")
    from text_fixtures import make_model_dir
    from transformers import AutoTokenizer

    from relax.eval.harness.run import chat_renderer
    from relax.text import load_tokenizer

    model_dir = make_model_dir(tmp_path / "tok", "qwen25")
    hf = AutoTokenizer.from_pretrained(model_dir)

    def hf_template(messages, add_generation_prompt=True):  # lm-eval's HFLM.apply_chat_template
        return hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    docs = load_docs(str(DATA / "test.jsonl"), GSM8K.fields, limit=6)
    pool = load_docs(str(DATA / "train.jsonl"), GSM8K.fields)
    render = chat_renderer(load_tokenizer(model_dir))
    system = "Answer the grade-school math question."
    for multiturn in (True, False):
        want = lm_eval_contexts(
            tmp_path / f"lm{multiturn}",
            limit=6,
            apply_chat_template=True,
            fewshot_as_multiturn=multiturn,
            system_instruction=system,
            chat_template=hf_template,
        )
        got = build_prompts(
            GSM8K, docs, pool, num_fewshot=5, seed=1234, same_split=False, system=system,
            render=render, multiturn=multiturn,
        )  # fmt: skip
        assert got == want
        assert got[0].count("<|im_start|>user") == (6 if multiturn else 1)
    plain = lm_eval_contexts(tmp_path / "plain", limit=6, system_instruction=system)
    got = build_prompts(
        GSM8K, docs, pool, num_fewshot=5, seed=1234, same_split=False, system=system
    )
    assert got == plain and got[0].startswith(system + "Question:")


def test_a_prompt_that_starts_with_bos_gets_no_second_one(tmp_path):
    from text_fixtures import make_model_dir

    from relax.eval.harness.generate import encode_prompts
    from relax.text import load_tokenizer

    tok = load_tokenizer(make_model_dir(tmp_path, "llama3"))
    bos = tok.special_tokens["bos_token"]
    plain, templated = encode_prompts(tok, ["Question: 1+1?", bos + "Question: 1+1?"], keep=100)
    assert plain == templated  # the tokenizer's own BOS once, either way
    assert plain.count(tok.encode(bos, add_special_tokens=False)[0]) == 1


def tiny_model_dir(root: Path) -> Path:
    """A tiny random Llama with a ChatML BPE tokenizer, as a Hugging Face directory."""
    import jax
    from text_fixtures import make_model_dir

    from relax.models import ModelConfig, init
    from relax.models.hf.checkpoint import save_pretrained
    from relax.text import load_tokenizer

    tok = load_tokenizer(make_model_dir(root, "qwen25"))
    cfg = ModelConfig(
        vocab_size=-(-tok.vocab_size // 8) * 8,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
    )
    out = root / "model"
    save_pretrained(init(cfg, jax.random.key(0)), out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow  # compiles the sampler for a tiny model (~20 s on a CPU)
def test_relax_eval_end_to_end(tmp_path):
    pytest.importorskip("lm_eval")
    import jax
    import numpy as np
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter as LMRegex

    from relax.commands import main
    from relax.models.hf.checkpoint import load_pretrained
    from relax.rollout.config import RolloutConfig
    from relax.rollout.naive import generate_no_cache
    from relax.rollout.sampling import SamplingConfig
    from relax.text import load_tokenizer

    model_dir = tiny_model_dir(tmp_path)
    out = tmp_path / "report.json"
    argv = ["eval", "--model", str(model_dir), "--data", str(DATA / "test.jsonl")]
    argv += ["--fewshot-data", str(DATA / "train.jsonl"), "--limit", "3", "--max-gen-toks", "6"]
    assert main([*argv, "--batch-size", "2", "--output", str(out)]) == 0
    rep = json.loads(out.read_text())
    docs = load_docs(str(DATA / "test.jsonl"), GSM8K.fields, 3)
    pool = load_docs(str(DATA / "train.jsonl"), GSM8K.fields)
    prompts = build_prompts(GSM8K, docs, pool, num_fewshot=5, seed=1234, same_split=False)
    assert [s["prompt_sha256"] for s in rep["samples"]] == [
        hashlib.sha256(p.encode()).hexdigest() for p in prompts
    ]
    # the greedy completion of item 0, by the no-cache reference sampler
    tok, model = load_tokenizer(model_dir), load_pretrained(model_dir)
    ids = np.asarray([tok.encode(prompts[0])], np.int32)
    greedy = SamplingConfig(temperature=0.0)
    rcfg = RolloutConfig(1, 6, greedy, eos_ids=tok.eos_token_ids, pad_id=tok.pad_token_id)
    r = generate_no_cache(model, ids, np.ones_like(ids), jax.random.key(0), rcfg)
    text = tok.decode(np.asarray(r.tokens)[0, 0][np.asarray(r.mask)[0, 0] > 0], True)
    assert rep["samples"][0]["completions"] == [truncate_at_stops(text, GSM8K.until)]
    strict = LMRegex(regex_pattern=r"#### (\-?[0-9\.\,]+)")
    for s, doc in zip(rep["samples"], docs):
        ((extracted,),) = strict.apply([s["completions"]], [])
        assert s["extracted"]["strict-match"] == [extracted]
        want = exact_match_hf_evaluate(
            [extracted], [doc["answer"]], [",", "\\$", "(?s).*#### ", "\\.$"], True
        )["exact_match"]
        assert s["verdicts"]["strict-match"] == [want]
    assert rep["results"]["exact_match,strict-match"] == pytest.approx(
        np.mean([s["verdicts"]["strict-match"][0] for s in rep["samples"]])
    )
    # pass@k: three samples per item at temperature 1, each item's score their mean
    sampled = ["--num-samples", "3", "--temperature", "1.0", "--ks", "1", "3"]
    assert main([*argv, "--batch-size", "2", "--output", str(out), *sampled]) == 0
    rep = json.loads(out.read_text())
    assert all(len(s["completions"]) == 3 for s in rep["samples"])
    assert len({c for s in rep["samples"] for c in s["completions"]}) > 3  # samples differ
    assert rep["results"]["pass@1,flexible-extract"] == pytest.approx(
        rep["results"]["exact_match,flexible-extract"]
    )


HUMANEVAL_ITEM = {
    "task_id": "HandWritten/0",
    "prompt": 'def add_one(x):\n    """x + 1."""\n',
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-3) == -2\n",
    "entry_point": "add_one",
}


@pytest.mark.slow  # starts sandboxed Python processes (~1 s each)
def test_humaneval_programs_pass_as_code_eval_decides():
    from relax.eval.harness import score_items
    from relax.rewards.isolation import SandboxUnavailable

    task = get_task("humaneval")
    prompt = task.doc_to_text(HUMANEVAL_ITEM)
    # the completion is cut at "\ndef" as lm-eval's until does; the body alone is the answer
    right = truncate_at_stops("    return x + 1\n\ndef other():\n    pass", task.until)
    assert right == "    return x + 1\n"
    comps = [right, "    return x\n", "    while True:\n        pass\n"]
    try:
        (rec,) = score_items(task, [HUMANEVAL_ITEM], [prompt], [comps])
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
    assert rec.extracted["create_test"][0] == prompt + right
    assert rec.verdicts["create_test"] == (1.0, 0.0, 0.0)  # right, wrong, timed out
    assert rec.id == "HandWritten/0"
    mbpp = get_task("mbpp")
    item = {
        "task_id": 7,
        "text": "Add.",
        "test_list": [f"assert add({i}, 1) == {i + 1}" for i in range(3)],
    }
    comps = ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a * b\n"]
    (rec,) = score_items(mbpp, [item], [""], [comps])
    assert rec.verdicts["none"] == (1.0, 0.0) and rec.id == "7"


MATH_SOLUTIONS = [
    "So $x = \\boxed{\\frac{1}{2}}$.",
    "The answer is \\boxed{10\\%}.",
    "We get \\boxed 5$ and more",
    "So it is $\\boxed{\\dfrac{3}{4}}$.",
    "Hence \\boxed{x = 2}.",
    "Answer \\boxed{\\text{(B)}}",
]
MATH_COMPLETIONS = [
    " $\\frac12$",
    " $0.5$",
    " The answer is $10$.",
    " 3",
    " $5$ apples",
    " $3/4$",
    " $2$",
    " \\text{(B)}",
    " $\\sqrt3$ and $1/x$",
    " $a/b$",
    " $\\frac{1}{2} \\text{ cm} \\text{ m}$",
    " .5",
    "",
]


def test_math_answers_by_hand():
    from relax.eval.harness.math_answers import MathEquiv, math_target

    eq = MathEquiv()
    assert math_target(MATH_SOLUTIONS[0]) == "\\frac{1}{2}"
    assert math_target(MATH_SOLUTIONS[2]) == "5"
    assert eq(" $\\frac12$", "\\frac{1}{2}") == 1.0  # \frac12 -> \frac{1}{2}
    assert eq(" $0.5$", "\\frac{1}{2}") == 1.0
    assert eq(" $3/4$", "\\dfrac{3}{4}") == 1.0  # a/b and dfrac -> \frac{a}{b}
    assert eq("x = 2", "2") == 1.0 and eq(" x = 2", "2") == 0.0  # "x " is short, " x " not
    assert eq(" $2$", "3") == 0.0


@pytest.mark.slow  # lm-eval's hendrycks_math utils import `datasets` (~5 s)
def test_math_verdicts_equal_lm_evals():
    pytest.importorskip("lm_eval")
    from lm_eval.tasks.hendrycks_math import utils as ref

    from relax.eval.harness.math_answers import MathEquiv, math_target

    for solution in MATH_SOLUTIONS:
        target = math_target(solution)
        assert target == ref.remove_boxed(ref.last_boxed_only_string(solution))
        for c in MATH_COMPLETIONS:
            want = ref.process_results({"solution": solution}, [c])["exact_match"]
            assert MathEquiv()(c, target) == want, (solution, c)


def lm_eval_mbpp() -> tuple[dict, list[dict]]:
    """lm-eval's mbpp.yaml (its ``!function`` tags as plain strings) and its fixed few-shot
    samples, read from its utils.py's source (importing it would load HF ``evaluate``)."""
    import ast

    import lm_eval
    import yaml

    root = Path(lm_eval.__file__).parent / "tasks" / "mbpp"
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ld.construct_scalar(node))
    cfg = yaml.load((root / "mbpp.yaml").read_text(), Loader=loader)  # noqa: S506 - SafeLoader
    tree = ast.parse((root / "utils.py").read_text())
    fn = next(n for n in tree.body if getattr(n, "name", "") == "list_fewshot_samples")
    return cfg, ast.literal_eval(fn.body[0].value)


def test_mbpp_prompts_follow_lm_evals_templates():
    pytest.importorskip("lm_eval")
    from lm_eval.utils import apply_template

    from relax.eval.harness.mbpp_shots import MBPP_FEWSHOT

    cfg, samples = lm_eval_mbpp()
    assert list(MBPP_FEWSHOT) == samples
    doc = {"task_id": 11, "text": "Write f.", "code": "", "test_list": ["t1", "t2", "t3"]}
    want = "".join(
        apply_template(cfg["doc_to_text"], s)
        + cfg["target_delimiter"]
        + apply_template(cfg["doc_to_target"], s)
        + "\n\n"
        for s in samples[: cfg["num_fewshot"]]
    ) + apply_template(cfg["doc_to_text"], doc)
    mbpp = get_task("mbpp")
    (got,) = build_prompts(mbpp, [doc], MBPP_FEWSHOT, num_fewshot=3, seed=1234, same_split=False)
    assert got == want
    assert mbpp.doc_to_target(doc) == apply_template(cfg["doc_to_target"], doc) == "t1\nt2\nt3"
    assert mbpp.until == tuple(cfg["generation_kwargs"]["until"])


def test_a_runs_export_is_found_or_named(tmp_path):
    from relax.eval.harness.load import load_policy, run_export

    for step in (5, 12, 9):
        (tmp_path / "hf" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "hf" / f"step-{step}" / "config.json").write_text("{}")
    assert run_export(tmp_path) == tmp_path / "hf" / "step-12"  # the newest, not the last listed
    (tmp_path / "final_hf").mkdir()
    (tmp_path / "final_hf" / "config.json").write_text("{}")
    assert run_export(tmp_path) == tmp_path / "final_hf"
    with pytest.raises(FileNotFoundError, match="no Hugging Face export"):
        run_export(tmp_path / "hf")
    with pytest.raises(ValueError, match="exactly one of --model and --run-dir"):
        load_policy(model="a", run_dir="b")
    with pytest.raises(ValueError, match="--adapter goes with --model"):
        load_policy(run_dir="b", adapter="c")


def test_a_vision_language_directory_is_evaluated_by_its_language_model(tmp_path):
    import jax
    import numpy as np

    from relax.eval.harness.load import load_policy
    from relax.models.vision.families import load_vision_language
    from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
    from relax.tasks.visual import VisualTask

    write_tiny_qwen2_5_vl(tmp_path / "vlm", VisualTask(), key=jax.random.key(0))
    policy = load_policy(model=str(tmp_path / "vlm"))
    want = load_vision_language(tmp_path / "vlm").language_model
    assert jax.tree.structure(policy.model) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(policy.model), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert policy.tokenizer.encode("How many shapes?")


def test_a_runs_policy_is_the_step_asked_for_else_its_newest(tmp_path, monkeypatch):
    import relax.train.run_policy as rp
    from relax.eval.harness.run import HarnessConfig

    with pytest.raises(FileNotFoundError, match="no export .* and no checkpoint"):
        rp.run_policy(tmp_path)
    monkeypatch.setattr(rp, "checkpoint_steps", lambda run: [5, 10])
    monkeypatch.setattr(rp, "checkpoint_policy", lambda run, step: ("checkpoint", step))
    monkeypatch.setattr(rp, "load_policy", lambda model=None, run_dir=None: ("hf", model, run_dir))
    for step in (8, 10):
        (tmp_path / "hf" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "hf" / f"step-{step}" / "config.json").write_text("{}")
    hf = str(tmp_path / "hf" / "step-{}")
    assert rp.run_policy(tmp_path) == ("hf", hf.format(10), None)  # a tie: the export
    assert rp.run_policy(tmp_path, 5) == ("checkpoint", 5)
    assert rp.run_policy(tmp_path, 10) == ("checkpoint", 10)  # a step asked for: the checkpoint
    assert rp.run_policy(tmp_path, 8) == ("hf", hf.format(8), None)
    with pytest.raises(FileNotFoundError, match=r"step 3; checkpoints \[5, 10\], .* \[8, 10\]"):
        rp.run_policy(tmp_path, 3)
    shutil.rmtree(tmp_path / "hf" / "step-10")
    assert rp.run_policy(tmp_path) == ("checkpoint", 10)  # newer than the newest export
    (tmp_path / "final_hf").mkdir()
    (tmp_path / "final_hf" / "config.json").write_text("{}")
    assert rp.run_policy(tmp_path) == ("hf", None, str(tmp_path))  # the run's end: final_hf
    with pytest.raises(ValueError, match="--step goes with --run-dir"):
        HarnessConfig(model="m", step=3)


@pytest.mark.slow  # four evaluations of a tiny model (~50 s on a CPU)
def test_an_adapter_a_runs_export_and_its_checkpoint_evaluate_as_the_merged_model(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from relax.algorithms.grpo.run import GRPORunConfig
    from relax.commands import main
    from relax.models.adapters.operations import add_lora, merge_lora, with_adapters
    from relax.models.adapters.peft import save_adapter
    from relax.models.hf.checkpoint import load_pretrained, save_pretrained
    from relax.models.layers.lora import LoRAConfig, LoRAWeights
    from relax.text import load_tokenizer
    from relax.train.checkpoint import Checkpointer
    from relax.train.state import init_state

    base_dir = tiny_model_dir(tmp_path)
    policy = add_lora(load_pretrained(base_dir), LoRAConfig(rank=4), jax.random.key(1))
    rng = np.random.default_rng(0)
    ad = policy.layers.lora
    random_ab = {
        f: LoRAWeights(
            *(jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype) for x in (w.a, w.b))
        )
        for f, w in ad.weights().items()
    }
    policy = with_adapters(policy, dataclasses.replace(ad, **random_ab))
    save_adapter(policy, tmp_path / "adapter")
    save_pretrained(merge_lora(policy), tmp_path / "run" / "final_hf")
    load_tokenizer(base_dir).save_pretrained(tmp_path / "run" / "final_hf")

    def completions(*flags: str) -> list:
        out = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
        argv = ["eval", "--data", str(DATA / "test.jsonl"), "--num-fewshot", "1", "--limit", "2"]
        assert main([*argv, "--max-gen-toks", "5", "--output", str(out), *flags]) == 0
        return [s["completions"] for s in json.loads(out.read_text())["samples"]]

    adapted = completions("--model", str(base_dir), "--adapter", str(tmp_path / "adapter"))
    assert adapted == completions("--run-dir", str(tmp_path / "run"))
    # the same adapters in a run's checkpoint (a GRPO run's state and config, no export)
    run = GRPORunConfig(model=str(base_dir), data="rows.jsonl", lora=LoRAConfig(rank=4))
    with Checkpointer(tmp_path / "ckrun" / "checkpoints") as ckpt:
        state = init_state(policy, optax.adam(1e-3), key=jax.random.key(0), with_reference=True)
        assert ckpt.save(7, state, config=run, force=True)
    assert adapted == completions("--run-dir", str(tmp_path / "ckrun"), "--step", "7")
    with Checkpointer(tmp_path / "rmrun" / "checkpoints") as ckpt:  # a reward model's policy
        ckpt.save(1, {"policy": {"head": jnp.ones(3)}}, config={"model": str(base_dir)}, force=True)
    with pytest.raises(ValueError, match="step 1: its policy is not a language model of"):
        completions("--run-dir", str(tmp_path / "rmrun"))
    assert adapted != completions("--model", str(base_dir))  # the adapter changes the model
