"""The generative judge reward (``relax.rewards.generative_judge``): parse rules on hand-written
replies, the ``--reward-on-error`` rules and metrics on a scripted backend, the HTTP path against a
local fake server, and (slow) a tiny judge model against transformers ``generate()`` on the same
weights: one device here, and sharded on an 8-device mesh in a subprocess (this file run as a
script); a GRPO run with the judge as its reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

# the tiny judge's parse rule: the last vowel of its reply, each vowel its own verdict
VOWELS = {"a": 1.0, "e": 0.75, "i": 0.5, "o": 0.25, "u": 0.0}
PARSE = dict(
    parse="verdict", pattern="([aeiou])", verdicts=tuple(f"{k}={v}" for k, v in VOWELS.items())
)
TEMPLATE = "Task: {{ prompt }}\nResponse: {{ completion }}\nVerdict:"
SAMPLES = [
    ("What is 2 + 2?", "The answer is 4."),
    ("Hello world!", "Hello"),
    ("The weather in Paris", "is sunny"),
    ("def f(x):", "return x"),
    ("You are a helpful assistant.", "tabs and spaces"),
    ("Tokyo", "rainy"),
]
MAX_NEW = 12


def reference_verdict(reply: str) -> float | None:
    """An independent reading of the tiny judge's reply: its last vowel's value."""
    vowels = [c for c in reply if c in VOWELS]
    return VOWELS[vowels[-1]] if vowels else None


def make_judge_dir(root: Path) -> Path:
    """A tiny Qwen2 chat model (random weights, a ChatML tokenizer and template) as an HF dir."""
    import torch
    import transformers
    from text_fixtures import make_model_dir

    from relax.text import load_tokenizer

    d = make_model_dir(root, "qwen25")
    tok = load_tokenizer(d)
    cfg = transformers.Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=list(tok.eos_token_ids),
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # not flat: greedy decoding is then decided well above rounding
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.3 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.3 * torch.randn(p.shape, generator=g)
            )
    model.save_pretrained(d / "hf", safe_serialization=True)
    for f in ("config.json", "model.safetensors"):
        (d / "hf" / f).rename(d / f)
    return d


def hf_replies(d: Path) -> list[str]:
    """transformers' tokenizer, chat template and greedy ``generate()`` on the judge prompts."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    out = []
    for prompt, completion in SAMPLES:
        user = TEMPLATE.replace("{{ prompt }}", prompt).replace("{{ completion }}", completion)
        text = tok.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            seq = model.generate(
                ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos[1]
            )
        out.append(tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def relax_judge(d: Path, mesh_spec: str | None = None):
    """The judge reward of ``d`` (its weights on ``mesh_spec``'s mesh when given) and its model."""
    import jax

    from relax.models.hf.checkpoint import load_pretrained
    from relax.parallel import make_mesh, state_shardings
    from relax.rewards.generative_judge import JudgeConfig, device_judge
    from relax.text import load_tokenizer

    model = load_pretrained(d)
    if mesh_spec is not None:
        mesh = make_mesh(mesh_spec)
        model = jax.device_put(model, state_shardings(model, mesh))
    cfg = JudgeConfig(model=str(d), template=TEMPLATE, max_new_tokens=MAX_NEW, **PARSE)
    judge = device_judge(cfg, model, load_tokenizer(d), on_error="missing")
    return judge, model


def judge_outputs(judge) -> dict:
    """The judge's replies and rewards on ``SAMPLES`` (one call: the whole batch)."""
    prompts, completions = zip(*SAMPLES)
    convs = [judge.conversation(p, c, {}) for p, c in SAMPLES]
    replies = judge.backend.complete(convs)
    scores = judge(list(prompts), list(completions))
    return {"replies": replies, "scores": scores, "metrics": judge.last_metrics}


def worker(out_path: str, model_dir: str) -> None:
    """8 simulated devices: the judge on one device and sharded on a mesh; results as JSON."""
    import jax

    one, _ = relax_judge(Path(model_dir))
    sharded, model = relax_judge(Path(model_dir), "fsdp=8")
    leaves = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array) and x.ndim >= 2]
    Path(out_path).write_text(
        json.dumps(
            {
                "devices": jax.device_count(),
                "one": judge_outputs(one),
                "mesh": judge_outputs(sharded),
                "split": sum(not x.sharding.is_fully_replicated for x in leaves),
                "matrices": len(leaves),
                "embed_spec": str(model.embed.sharding.spec) if hasattr(model, "embed") else "",
            }
        )
    )


if __name__ == "__main__":
    worker(*sys.argv[2:])
    sys.exit(0)


import pytest  # noqa: E402

from relax.rewards.contract import RewardError  # noqa: E402
from relax.rewards.generative_judge import (  # noqa: E402
    GenerativeJudge,
    JudgeConfig,
    http_judge,
    judge_metrics,
)
from relax.rewards.judge_http import Failure  # noqa: E402
from relax.rewards.judge_parse import JudgeParser  # noqa: E402

# ------------------------------------------------------------------ parsing


def test_parse_rules_on_written_replies():
    score = JudgeParser("score", max_score=10)
    assert score("The response is right.\nScore: 7") == pytest.approx(0.7)
    assert score("score: 3 at first, but on reflection\nSCORE:4.5") == pytest.approx(0.45)
    assert score("Score: 12") == 1.0 and score("Score: -3") == 0.0  # clipped to [0, 1]
    assert score("I cannot decide.") is None
    verdict = JudgeParser("verdict")
    assert verdict("Looks fine. Verdict: Yes") == 1.0
    assert verdict("Verdict: incorrect") == 0.0
    assert verdict("Verdict: maybe") is None  # not a known verdict
    pairwise = JudgeParser("verdict", pattern=r"\[\[(A|B)\]\]", verdicts=("A=1", "B=0"))
    assert pairwise("A is longer, B is right: [[B]]") == 0.0
    assert pairwise("[[A]]") == 1.0 and pairwise("A") is None
    with pytest.raises(ValueError, match="needs a group"):
        JudgeParser("score", pattern=r"Score: \d")
    with pytest.raises(ValueError, match="word=number"):
        JudgeParser("verdict", verdicts=("yes",))
    with pytest.raises(ValueError, match="exclusive"):
        JudgeConfig(model="m", url="http://x")


class Scripted:
    """A backend whose replies are given: ``complete`` returns them in order, counting calls."""

    def __init__(self, replies):
        self.replies, self.calls = list(replies), 0

    def complete(self, convs):
        self.calls += 1
        return [self.replies[i % len(self.replies)] for i in range(len(convs))]


def test_judge_renders_rows_and_applies_reward_on_error():
    template = "Q: {{ prompt }} A: {{ completion }} ref={{ reference }} src={{ source }}"
    replies = ["Score: 8", "no idea", Failure("HTTP 500", 3), "Score: 2"]
    judge = GenerativeJudge(
        Scripted(replies), JudgeParser("score"), template=template, on_error="missing"
    )
    conv = judge.conversation("2+2", "4", {"answer": "4", "source": "math"})
    assert conv == [{"role": "user", "content": "Q: 2+2 A: 4 ref=4 src=math"}]
    fields = {"answer": ["4"] * 4, "source": ["m"] * 4}
    scores = judge(["p0", "p1", "p2", "p3"], ["c0", "c1", "c2", "c3"], **fields)
    assert scores == [pytest.approx(0.8), None, None, pytest.approx(0.2)]
    m = judge_metrics([judge])
    assert (m["judge/unparsed"], m["judge/failed"]) == (1.0, 1.0)
    assert m["judge/mean_score"] == pytest.approx(0.5) and m["time/judge"] >= 0
    raising = GenerativeJudge(Scripted(replies), JudgeParser("score"), template=template)
    with pytest.raises(RewardError, match="sample 1 reply could not be read"):
        raising(["p0", "p1", "p2", "p3"], ["c0", "c1", "c2", "c3"], **fields)
    # relax.rewards.functions re-scores a raising batch's samples alone: the judge is not asked again
    calls = raising.backend.calls
    with pytest.raises(RewardError, match="sample 0 reply could not be read"):
        raising(["p1"], ["c1"], answer=["4"], source=["m"])
    assert raising.backend.calls == calls
    asked = []
    backend = Scripted(["Score: 5"])
    backend.complete = lambda convs: (
        asked.append([c[0]["content"] for c in convs]) or ["Score: 5"] * len(convs)
    )
    once = GenerativeJudge(backend, JudgeParser("score"), template="{{ completion }}")
    assert once(["p"] * 3, ["same", "same", "other"], answer=["a"] * 3) == [0.5] * 3
    assert asked == [["same", "other"]]  # equal completions are asked once
    with pytest.raises(Exception, match="'source' is undefined"):  # named
        judge.conversation("p", "c", {"answer": "4"})


# ------------------------------------------------------------------ HTTP


class FakeJudge(BaseHTTPRequestHandler):
    """An OpenAI-style chat completions endpoint: the reply depends on a word in the prompt."""

    seen: list = []
    flaky: dict = {}

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeJudge.seen.append((self.path, self.headers.get("Authorization"), body))
        text = body["messages"][-1]["content"]
        if "SLOW" in text:
            time.sleep(1.0)
        if "FLAKY" in text and not FakeJudge.flaky.get(text):
            FakeJudge.flaky[text] = True
            self.send_response(503)
            self.end_headers()
            return
        reply = "Score: 9" if "GOOD" in text else "Score: 1" if "BAD" in text else "hmm"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]})
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data.encode())
        except BrokenPipeError:  # a client that timed out has gone
            pass

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    FakeJudge.seen.clear()
    FakeJudge.flaky.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_http_judge_against_a_local_server(server, monkeypatch):
    pytest.importorskip("httpx")
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    cfg = JudgeConfig(
        url=server,
        api_model="tiny-judge",
        api_key_env="JUDGE_KEY",
        template="{{ completion }}",
        timeout_s=0.2,
        retries=1,
        backoff_s=0.01,
        concurrency=3,
    )
    judge = http_judge(cfg, on_error="missing")
    completions = ["GOOD", "BAD", "garbled", "SLOW", "FLAKY GOOD"]
    scores = judge(["p"] * 5, completions, answer=["a"] * 5)
    assert scores == [pytest.approx(0.9), pytest.approx(0.1), None, None, pytest.approx(0.9)]
    m = judge.last_metrics
    assert (m["judge/unparsed"], m["judge/failed"]) == (1.0, 1.0)  # garbled; timed out twice
    path, auth, body = FakeJudge.seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "tiny-judge" and body["temperature"] == 0.0
    assert body["max_tokens"] == cfg.max_new_tokens
    assert (
        sum("FLAKY" in b["messages"][-1]["content"] for _, _, b in FakeJudge.seen) == 2
    )  # retried
    raising = http_judge(cfg, on_error="raise")
    with pytest.raises(RewardError, match=r"sample 0 failed \(ReadTimeout"):
        raising(["p"], ["SLOW"], answer=["a"])
    assert raising.time_bound_s({"answer": ["a"] * 5}) == pytest.approx(2 * (2 * 0.2 + 0.01))


# ------------------------------------------------------------------ a tiny judge model


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d = make_judge_dir(tmp_path_factory.mktemp("judge"))
    return d, hf_replies(d)


@pytest.mark.slow
@pytest.mark.parity
def test_tiny_judge_matches_transformers_generate(judge_dir):
    d, reference = judge_dir
    judge, _ = relax_judge(d)
    out = judge_outputs(judge)
    assert out["replies"] == reference
    want = [reference_verdict(r) for r in reference]
    assert out["scores"] == want
    assert len({s for s in want if s is not None}) >= 2, f"too few distinct verdicts: {want}"
    assert out["metrics"]["judge/unparsed"] == sum(s is None for s in want)


@pytest.mark.slow
@pytest.mark.parity
def test_judge_sharded_on_8_devices(judge_dir, tmp_path):
    from conftest import FAST_COMPILE

    d, reference = judge_dir
    flags = f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    out_path = tmp_path / "mesh.json"
    proc = subprocess.run(
        [sys.executable, str(HERE), "worker", str(out_path), str(d)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out_path.read_text())
    assert got["devices"] == 8
    assert got["split"] >= got["matrices"] // 2 > 0, got  # the judge's weights are sharded
    assert got["mesh"]["replies"] == got["one"]["replies"] == reference
    assert got["mesh"]["scores"] == [reference_verdict(r) for r in reference]


@pytest.mark.slow
@pytest.mark.parity
def test_grpo_with_the_judge_as_reward(judge_dir, tmp_path):
    from conftest import load_example

    d, _ = judge_dir
    rows = [{"prompt": p, "answer": c} for p, c in SAMPLES * 2]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    args = [
        "--model", str(d), "--data", str(tmp_path / "train.jsonl"), "--run-dir", str(run_dir),
        "--steps", "2", "--batch-size", "2", "--max-prompt-tokens", "96",
        "--grpo.num-generations", "2", "--grpo.max-new-tokens", "4",
        "--reward-on-error", "missing", "--reward-workers", "0", "--no-compile-ahead",
        "--eval-every", "0",
        "--judge.model", "policy", "--judge.template", TEMPLATE,
        "--judge.max-new-tokens", str(MAX_NEW), "--judge.parse", "verdict",
        "--judge.pattern", PARSE["pattern"], "--judge.verdicts", *PARSE["verdicts"],
    ]  # fmt: skip
    load_example("grpo").main(args)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward/judge" in x]
    assert len(steps) == 2
    for x in steps:  # the tiny judge's verdicts (vowels) on this data parse: a finite mean
        assert 0.0 <= x["reward/judge"] <= 1.0
