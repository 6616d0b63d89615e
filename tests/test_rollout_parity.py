"""relax's sampler against Hugging Face ``generate``: the same checkpoint, greedy, on a
left-padded ragged batch, gives the same tokens (finished rows padded with the pad id) and
the same log-probs as ``compute_transition_scores(..., normalize_logits=True)``. The Gemma 3 case
decodes through sliding layers (window 3, their own RoPE base) and a full layer, so the per-layer
windows of the prefix-shared cache are exercised well past the window. The Phi-3 cases load fused
q/k/v and gate/up weights; the LongRoPE one (context 128, original length 32, capped at 32 by
``max_positions``) decodes with transformers' short factors and attention factor."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relax.models.hf.checkpoint import load_pretrained  # noqa: E402
from relax.rollout import sampler as rollout  # noqa: E402

pytestmark = pytest.mark.parity

ATOL = 2e-4
PAD = 0
N_NEW = 10
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=PAD,
)
CASES = {
    "llama_gqa": ("LlamaConfig", {}),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=5)),
    "gemma3_mixed_window": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=3,
            query_pre_attn_scalar=24,
            rope_local_base_freq=100.0,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
    "phi3_window": ("Phi3Config", dict(sliding_window=4)),
    "phi3_longrope": (
        "Phi3Config",
        dict(
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.5, 1.2, 2.5, 2.0, 3.0, 2.8, 4.0],
                "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
            },
        ),
    ),
}
MAX_POSITIONS = {
    "phi3_longrope": 32
}  # LongRoPE runs at most its original length (relax.models.hf.config)


def _hf_model(case):
    cls_name, overrides = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    identity = 0.0 if cfg.model_type.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():  # randomise norms and biases too; 0.3 so distributions aren't flat
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(identity + 0.3 * noise if "norm" in name else 0.3 * noise)
    return model.eval()


def _prompts(vocab, lengths=(9, 4, 6), width=9):
    rng = np.random.default_rng(0)
    ids = np.full((len(lengths), width), PAD, np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(3, vocab, n)
        mask[i, width - n :] = 1
    return ids, mask


def _hf_generate(model, ids, mask, eos):
    with torch.no_grad():
        out = model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=N_NEW,
            eos_token_id=eos,
            pad_token_id=PAD,
            output_scores=True,
            return_dict_in_generate=True,
        )
        scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    new = out.sequences[:, ids.shape[1] :].numpy()
    return new, scores.float().numpy()


def _pick_stop_id(new):
    """A token the first row generates (not at step 0 and not in any other row before it),
    so that row stops early and the others run on."""
    for t in range(2, new.shape[1] - 2):
        tok = int(new[0, t])
        if tok == PAD or tok in new[0, :t]:
            continue
        if all(tok not in new[r] for r in range(1, new.shape[0])):
            return tok
    pytest.skip("no usable stop id in the greedy continuation")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_greedy_generate_matches_transformers(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path, max_positions=MAX_POSITIONS.get(case))
    vocab = hf.config.vocab_size
    ids, mask = _prompts(vocab)
    # a first run with an unreachable stop id (outside the vocabulary) picks one that ends row 0 early
    first, _ = _hf_generate(hf, ids, mask, eos=vocab)
    assert first.shape[1] == N_NEW
    stop = _pick_stop_id(first)
    want, scores = _hf_generate(hf, ids, mask, eos=stop)
    r = rollout.generate(
        model,
        ids.astype(np.int32),
        mask.astype(np.int32),
        key=jax.random.key(0),
        num_generations=1,
        max_new_tokens=N_NEW,
        temperature=0.0,
        eos_ids=(stop,),
        pad_id=PAD,
    )
    toks, rmask, logps = (np.asarray(x)[:, 0] for x in (r.tokens, r.mask, r.logprobs))
    # HF stops when every row has finished; relax keeps the full budget, padded
    n = want.shape[1]
    assert np.all(toks[:, n:] == PAD) and np.all(rmask[:, n:] == 0)
    np.testing.assert_array_equal(toks[:, :n], want)
    finished = np.asarray(r.finished)[:, 0]
    assert finished[0] and rmask[0].sum() < N_NEW, "row 0 must stop early"
    assert not finished[1:].all()
    valid = rmask[:, :n].astype(bool)
    np.testing.assert_allclose(logps[:, :n][valid], scores[valid], atol=ATOL, rtol=0)
    assert np.all(logps[:, :n][~valid] == 0)
