"""The TRL side of ``benchmarks/real_model.py``: run by its TRL interpreter (``--trl-python``, no
jax there), it trains TRL's GRPOTrainer on the rows and hyper-parameters the parent wrote to
``--out`` and logs each step (``steps.jsonl``), saves the final model (``final_hf/``) and
``trl_info.json``. It scores with relax's own ``numeric_match``, from the snapshot of
``relax/rewards`` the parent took (``OUT/../reward_src``).

    TRL_PYTHON benchmarks/real_model_trl.py --model DIR --steps N --seed S --out OUT/trl --train-jsonl OUT/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from real_model_common import read_jsonl  # this folder (jax-free at import)
from real_model_peer import trl_kwargs


def _load_numeric_match(src: Path):
    """relax's ``numeric_match`` from the snapshot ``src`` without importing ``relax/__init__``
    (and so jax): ``relax`` and ``relax.rewards`` are registered as bare namespaces over its folders."""
    import types

    for name in ("relax", "relax.rewards"):
        m = types.ModuleType(name)
        m.__path__ = [str(src / name.replace(".", "/"))]
        sys.modules[name] = m
    from relax.rewards.builtin import numeric_match

    return numeric_match


def trl_worker(args) -> None:
    """Runs in the TRL interpreter: trains, logs each step, saves the final model."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    out = Path(args.out)
    h = json.loads((out / "hparams.json").read_text())
    rows = read_jsonl(Path(args.train_jsonl))
    numeric_match = _load_numeric_match(out.parent / "reward_src")

    def numeric_match_reward(prompts, completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return numeric_match(prompts, texts, answer=answer)

    tok = AutoTokenizer.from_pretrained(args.model)
    # the same prompt token ids as relax's (its chat-template rendering, written by the parent)
    expected = json.loads((out / "relax_prompt_ids.json").read_text())
    got = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for r in rows[: len(expected)]
    ]
    ids_equal = got == expected
    ds = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(out / "trl-output"),
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_dropout=True,
        gradient_checkpointing=h.get("remat", False),  # relax's --grpo.remat, as the parent asks
        log_completions=False,
        **trl_kwargs(h),
    )
    steps_file = open(out / "steps.jsonl", "w")
    versions = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    (out / "trl_info.json").write_text(
        json.dumps(
            {
                "versions": versions,
                "prompt_ids_equal": ids_equal,
                "prompt_ids_checked": len(expected),
            },
            indent=1,
        )
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.t0 = self.t_first = None
            self.logs: dict = {}

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()
            self.cpu0 = time.process_time()
            if self.t_first is None:
                self.t_first = self.t0

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.update({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

        def on_step_end(self, a, state, control, **kw):
            t1 = time.perf_counter()
            self.last = {
                "step": state.global_step,
                "step_s": round(t1 - self.t0, 4),
                "process_cpu_s": round(time.process_time() - self.cpu0, 3),
                "wall_s": round(t1 - self.t_first, 3),
                "loadavg1": os.getloadavg()[0],
            }

        def on_substep_end(self, *a, **kw):
            pass

    timer = Timer()

    class Flush(TrainerCallback):  # logs arrive after on_step_end: write the step once they have
        def on_log(self, a, state, control, logs=None, **kw):
            if (
                getattr(timer, "last", None)
                and timer.last["step"] == state.global_step
                and "loss" in (logs or {})
            ):
                steps_file.write(json.dumps({**timer.last, **timer.logs}) + "\n")
                steps_file.flush()
                timer.logs = {}

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=numeric_match_reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[timer, Flush()],
    )
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    steps_file.close()
    trainer.model.save_pretrained(str(out / "final_hf"))
    tok.save_pretrained(str(out / "final_hf"))
    effective = {k: getattr(trainer.args, k) for k in trl_kwargs(h)}
    effective["lr_scheduler_type"] = str(effective["lr_scheduler_type"])
    json.dump(
        {
            "versions": versions,
            "prompt_ids_equal": ids_equal,
            "prompt_ids_checked": len(expected),
            "train_wall_s": wall,
            "grpo_config": effective,
            "attn_implementation": model.config._attn_implementation,
        },
        open(out / "trl_info.json", "w"),
        indent=1,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-jsonl", required=True)
    trl_worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
