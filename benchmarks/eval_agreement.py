"""``relax eval`` against lm-evaluation-harness on the same GSM8K items, item by item.

    python benchmarks/eval_agreement.py                     # 20 items, 5-shot, max_gen_toks 256
    python benchmarks/eval_agreement.py --limit 40 --model models/smollm2-135m-instruct
    python benchmarks/eval_agreement.py --apply-chat-template   # the prompts in the chat template

Runs ``lm_eval run --model hf`` (transformers, CPU, float32, batch size 1, ``--log_samples``) on a
GSM8K task read from local files (an include-path YAML that includes lm-eval's own ``gsm8k.yaml``
and swaps its dataset for ``benchmarks/data/gsm8k_sample``'s jsonl files: nothing is downloaded),
then ``relax eval`` on the same files and items, each as its own process, and prints JSON: the
per-item verdict agreement for both filters, whether the prompts are byte-identical, the items
whose completions differ (both completions, both verdicts, the first character where they part,
and the first differing token with both frameworks' logit gap between the two choices there)
and both wall times. Needs the ``eval`` extra (lm-eval) and
torch/transformers (the ``parity`` extra). ``--apply-chat-template``: both render the prompts with
the model's chat template, the few-shot examples as turns (lm-eval's ``--apply_chat_template``,
which turns ``--fewshot_as_multiturn`` on; relax eval's ``--apply-chat-template``).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # explain() runs relax's model in this process
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "gsm8k_sample"
FILTERS = ("strict-match", "flexible-extract")


def task_yaml(directory: Path, data: Path) -> str:
    """Write ``gsm8k_local.yaml`` (lm-eval's gsm8k on ``data``'s train/test jsonl) -> task name."""
    import lm_eval

    base = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    (directory / "gsm8k_local.yaml").write_text(
        f"include: {base}\ntask: gsm8k_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    train: {data / 'train.jsonl'}\n"
        f"    test: {data / 'test.jsonl'}\n"
    )
    return "gsm8k_local"


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(
            f"{cmd[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    print(proc.stdout[-2000:], file=sys.stderr)
    return time.perf_counter() - t0


def run_lm_eval(args, work: Path, env: dict) -> tuple[float, list[dict]]:
    task = task_yaml(work, args.data)
    cmd = [
        str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "hf",
        "--model_args", f"pretrained={args.model},dtype=float32", "--device", "cpu",
        "--batch_size", "1", "--tasks", task, "--include_path", str(work),
        "--limit", str(args.limit), "--num_fewshot", str(args.num_fewshot),
        "--gen_kwargs", f"max_gen_toks={args.max_gen_toks}",
        "--output_path", str(work / "lm_eval_out"), "--log_samples",
    ]  # fmt: skip
    cmd += ["--apply_chat_template"] if args.apply_chat_template else []
    wall = timed(cmd, env)
    (samples,) = glob.glob(
        str(work / "lm_eval_out" / "**" / f"samples_{task}_*.jsonl"), recursive=True
    )
    rows = [json.loads(line) for line in Path(samples).read_text().splitlines() if line.strip()]
    return wall, rows


def run_relax(args, work: Path, env: dict) -> tuple[float, dict]:
    out = work / "relax_report.json"
    cmd = [
        str(Path(sys.executable).with_name("relax")), "eval", "--task", "gsm8k",
        "--model", str(args.model), "--data", str(args.data / "test.jsonl"),
        "--fewshot-data", str(args.data / "train.jsonl"), "--limit", str(args.limit),
        "--num-fewshot", str(args.num_fewshot), "--max-gen-toks", str(args.max_gen_toks),
        "--batch-size", str(args.batch_size), "--output", str(out),
    ]  # fmt: skip
    cmd += ["--apply-chat-template"] if args.apply_chat_template else []
    wall = timed(cmd, env)
    return wall, json.loads(out.read_text())


def compare(lm_rows: list[dict], report: dict) -> dict:
    """Per-item agreement of prompts, completions and verdicts. ``lm_rows``: lm-eval's logged
    samples, one per item and filter (``doc_id``, ``filter``, ``arguments``, ``resps``,
    ``exact_match``)."""
    lm = {(r["doc_id"], r["filter"]): r for r in lm_rows}
    agree = dict.fromkeys(FILTERS, 0)
    same_prompt = same_completion = 0
    differing = []
    for me in report["samples"]:
        first = lm[(me["doc_id"], FILTERS[0])]
        prompt = first["arguments"]["gen_args_0"]["arg_0"]
        same_prompt += hashlib.sha256(prompt.encode()).hexdigest() == me["prompt_sha256"]
        theirs, ours = first["resps"][0][0], me["completions"][0]
        same_completion += theirs == ours
        row = {"doc_id": me["doc_id"]}
        for f in FILTERS:
            verdicts = {"lm_eval": float(lm[(me["doc_id"], f)]["exact_match"]),
                        "relax": me["verdicts"][f][0]}  # fmt: skip
            agree[f] += verdicts["lm_eval"] == verdicts["relax"]
            row[f] = verdicts
        if theirs != ours or any(row[f]["lm_eval"] != row[f]["relax"] for f in FILTERS):
            at = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y),
                      min(len(theirs), len(ours)))  # fmt: skip
            row.update(
                first_difference_at_char=at, lm_eval_completion=theirs, relax_completion=ours
            )
            differing.append(row)
    n = len(report["samples"])
    return {
        "items": n,
        "prompts_identical": same_prompt,
        "completions_identical": same_completion,
        "verdict_agreement": {f: agree[f] / n for f in FILTERS},
        "differing_items": differing,
    }


def explain(model_dir: Path, lm_rows: list[dict], differing: list[dict]) -> None:
    """For each item whose completions differ: the first differing token (the two completions
    re-tokenized), and at that position both models' logits given the common prefix: each one's
    logit gap between lm-eval's token and relax's, and the largest |torch - relax| logit there."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from relax.models.hf.checkpoint import load_pretrained

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rx = load_pretrained(model_dir)
    prompts = {r["doc_id"]: r["arguments"]["gen_args_0"]["arg_0"] for r in lm_rows}
    for row in differing:
        a_text, b_text = row["lm_eval_completion"], row["relax_completion"]
        if a_text == b_text:
            continue
        p = tok(prompts[row["doc_id"]])["input_ids"]
        a = tok(a_text, add_special_tokens=False)["input_ids"]
        b = tok(b_text, add_special_tokens=False)["input_ids"]
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if k == min(len(a), len(b)):
            row["first_token_difference"] = {"index": k, "note": "one completion is a prefix"}
            continue
        ctx = p + a[:k]
        with torch.no_grad():
            lt = hf(torch.tensor([ctx])).logits[0, -1].double().numpy()
        lr = np.asarray(rx(jnp.asarray([ctx], jnp.int32))[0, -1], np.float64)
        row["first_token_difference"] = {
            "index": k,
            "lm_eval_token": tok.decode([a[k]]),
            "relax_token": tok.decode([b[k]]),
            "torch_gap": round(float(lt[a[k]] - lt[b[k]]), 5),
            "relax_gap": round(float(lr[a[k]] - lr[b[k]]), 5),
            "max_abs_logit_diff": round(float(np.max(np.abs(lt - lr))), 5),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument(
        "--batch-size", type=int, default=8, help="relax eval's prompts per sampler call"
    )
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render the prompts with the model's chat template on both sides",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep both runs' outputs here (default: a temporary directory, removed)",
    )
    args = p.parse_args()
    args.model, args.data = args.model.resolve(), args.data.resolve()
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="eval-agreement-") as tmp:
        work = Path(tmp) if args.work_dir is None else args.work_dir
        work.mkdir(parents=True, exist_ok=True)
        lm_wall, lm_all = run_lm_eval(args, work, env)
        relax_wall, report = run_relax(args, work, env)
    out = compare(lm_all, report)
    if out["differing_items"]:
        explain(args.model, lm_all, out["differing_items"])
    out["wall_s"] = {"lm_eval": round(lm_wall, 1), "relax_eval": round(relax_wall, 1)}
    out["relax_times"] = {k: report["meta"][k] for k in ("load_s", "generate_s", "score_s")}
    out["relax_results"] = report["results"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
