"""LoRA on mixture-of-experts models: the attention projections, a dense layer's MLP and Qwen2-MoE's
shared expert (its MLP and its gate) are adapted, each stacked on the layers that have it; the
experts and router never are. Checked against a NumPy merge, finite differences, the sampler, the
PEFT files (tensor names per layer kind) and, under the parity extra, peft on transformers' model."""

import contextlib
import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_lora import numpy_merged, peft_saved, randomized
from test_moe_hf import expected_config, random_model

from relax.algorithms.online.step import StepParts
from relax.models.adapters.operations import add_lora, merge_lora, split_trainable
from relax.models.adapters.peft import load_adapter, save_adapter
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.hf.checkpoint import load_pretrained
from relax.models.layers.lora import LoRAConfig
from relax.rollout.sampler import RolloutConfig, compiled_generate

QWEN2_MOE = expected_config(
    "qwen2_moe_shared_dense_layer"
)  # layers 0, 1 sparse with a shared expert; 2 dense
QWEN3_MOE = expected_config("qwen3_moe_dense_layer_normalised")  # layers 0, 2 sparse; 1 dense
IDS = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 9)), jnp.int32)
SHARED = ("shared_gate", "shared_up", "shared_down", "shared_router")


@pytest.fixture(scope="module")
def base():
    return random_model(QWEN2_MOE)


def _lora(model, seed=1, **cfg):
    """``model`` with random adapters (all-linear unless ``target_modules`` says otherwise)."""
    cfg = dict(rank=3, alpha=6.0) | cfg
    said = (
        contextlib.nullcontext()
        if "target_modules" in cfg
        else pytest.warns(UserWarning, match="router are not")
    )
    with said:
        return randomized(add_lora(model, LoRAConfig(**cfg), jax.random.key(seed)), seed=seed)


@pytest.mark.slow
def test_all_linear_adapts_attention_the_dense_mlp_and_the_shared_expert(base):
    policy = _lora(base)
    ad, r, D = policy.layers.lora, 3, QWEN2_MOE.hidden_size
    assert set(ad.weights()) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", *SHARED}
    assert ad.wq.a.shape == (3, D, r)  # every layer
    assert ad.w_gate.a.shape == (1, D, r)  # the dense layer 2 only
    assert ad.shared_gate.a.shape == (2, D, r) and ad.shared_gate.b.shape == (
        2,
        r,
        24,
    )  # sparse layers 0, 1
    assert ad.shared_router.b.shape == (2, r, 1)
    assert all(getattr(ad, f, None) is None for f in ("router", "expert_gate"))
    want = np.asarray(numpy_merged(policy)(IDS))
    np.testing.assert_allclose(np.asarray(policy(IDS)), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(merge_lora(policy)(IDS)), want, atol=2e-5, rtol=1e-5)
    for field in SHARED:  # each shared-expert adapter alone moves the logits
        only = dataclasses.replace(ad, **{f: None for f in ad.weights() if f != field})
        alone = dataclasses.replace(policy, layers=dataclasses.replace(policy.layers, lora=only))
        assert not np.allclose(np.asarray(alone(IDS)), np.asarray(base(IDS)), atol=1e-4), field


def test_targets_resolve_per_model_and_absent_ones_are_errors():
    dense_mlp = add_lora(
        random_model(QWEN3_MOE),
        LoRAConfig(rank=2, target_modules=("gate_proj",)),
        jax.random.key(0),
    )
    assert (
        set(dense_mlp.layers.lora.weights()) == {"w_gate"}
        and dense_mlp.layers.lora.w_gate.a.shape[0] == 1
    )
    all_sparse = random_model(expected_config("qwen3_moe_all_sparse_unnormalised_window"))
    with pytest.raises(ValueError, match=r"\['gate_proj'\].*experts.*'q_proj'"):
        add_lora(
            all_sparse,
            LoRAConfig(rank=2, target_modules=("q_proj", "gate_proj")),
            jax.random.key(0),
        )
    with pytest.raises(ValueError, match=r"shared_expert_gate.*no such layer"):
        add_lora(
            random_model(
                dataclasses.replace(QWEN3_MOE, num_experts=0, dense_layers=(), family="qwen3")
            ),
            LoRAConfig(rank=2, target_modules=("shared_expert_gate",)),
            jax.random.key(0),
        )
    shared_only = add_lora(
        random_model(QWEN2_MOE),
        LoRAConfig(rank=2, target_modules=("shared_expert_gate",)),
        jax.random.key(0),
    )
    assert set(shared_only.layers.lora.weights()) == {"shared_router"}


@pytest.mark.slow
def test_shared_expert_gradients_against_finite_differences(base):
    policy = _lora(base, seed=2, target_modules=("gate_proj", "down_proj", "shared_expert_gate"))
    assert set(policy.layers.lora.weights()) == {
        "w_gate",
        "w_down",
        "shared_gate",
        "shared_down",
        "shared_router",
    }
    weights = jnp.asarray(
        np.random.default_rng(3).standard_normal((*IDS.shape, QWEN2_MOE.vocab_size)), jnp.float32
    )
    trained, frozen = split_trainable(policy)

    def loss(t):
        return jnp.sum(jax.nn.log_softmax(eqx.combine(t, frozen)(IDS)) * weights) / 100

    grads = jax.grad(loss)(trained)
    leaves, tree = jax.tree.flatten(trained)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    direction = [
        jnp.asarray(np.random.default_rng(4 + i).standard_normal(x.shape), x.dtype)
        for i, x in enumerate(leaves)
    ]
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), direction))
    eps = 1e-3  # small: a larger step moves some token's top-k choice, a jump no gradient sees
    shift = lambda s: jax.tree.unflatten(tree, [x + s * d for x, d in zip(leaves, direction)])  # noqa: E731
    numeric = (float(loss(shift(eps))) - float(loss(shift(-eps)))) / (2 * eps)
    assert abs(analytic - numeric) <= 2e-2 * abs(numeric) + 1e-3, (analytic, numeric)
    assert abs(analytic) > 1e-2


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.slow
def test_sampler_logprobs_equal_the_trainer_with_shared_expert_adapters(base, merge):
    policy = _lora(base, seed=4)
    pm = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    ids = jnp.where(pm > 0, IDS[:, :5], 0)
    cfg = RolloutConfig(
        num_generations=3, max_new_tokens=6, merge_adapters=merge, prompt_buckets=(5,)
    )
    r = compiled_generate(cfg)(policy, ids, pm, jax.random.key(5))
    trainer = completion_logprobs(policy, ids, pm, r.tokens, r.mask)
    m = np.asarray(r.mask) > 0
    np.testing.assert_allclose(np.asarray(r.logprobs)[m], np.asarray(trainer)[m], atol=2e-5)


def test_peft_files_name_each_layer_kind_and_round_trip(base, tmp_path):
    policy = _lora(base, seed=6)
    save_adapter(policy, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "shared_expert_gate",
        "up_proj",
        "v_proj",
    ]
    names = set(load_file(tmp_path / "a" / "adapter_model.safetensors"))
    at = lambda i, module: f"base_model.model.model.layers.{i}.{module}.lora_A.weight"  # noqa: E731
    assert {
        at(0, "mlp.shared_expert.gate_proj"),
        at(1, "mlp.shared_expert_gate"),
        at(2, "mlp.gate_proj"),
    } <= names
    assert not {at(2, "mlp.shared_expert.gate_proj"), at(0, "mlp.gate_proj")} & names
    assert len(names) == 2 * (
        4 * 3 + 3 * 1 + 4 * 2
    )  # A and B: attention x 3 layers, dense MLP x 1, shared x 2
    back = load_adapter(base, tmp_path / "a")
    assert jax.tree.structure(back) == jax.tree.structure(policy)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(policy)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parity
def test_peft_on_transformers_reads_and_writes_shared_expert_adapters(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from test_moe_hf import _hf_model

    _hf_model("qwen2_moe_shared_dense_layer").save_pretrained(
        tmp_path / "base", safe_serialization=True
    )
    hf = lambda: _hf_model("qwen2_moe_shared_dense_layer")  # noqa: E731
    base = load_pretrained(tmp_path / "base")
    ids = torch.tensor(np.asarray(IDS), dtype=torch.long)

    policy = _lora(base, seed=7)  # relax -> peft: every module PEFT's all-linear takes
    save_adapter(policy, tmp_path / "ours")
    theirs_model = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()
    adapted = {n.split(".lora_A")[0] for n, _ in theirs_model.named_parameters() if "lora_A" in n}
    assert any("mlp.shared_expert_gate" in n for n in adapted) and any(
        "shared_expert.up_proj" in n for n in adapted
    )
    with torch.no_grad():
        theirs = theirs_model(ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(policy(IDS)), theirs, atol=2e-4)
    assert not np.allclose(np.asarray(base(IDS)), theirs, atol=1e-3)

    # peft -> relax: all-linear there adapts the same modules (the experts are not Linear modules)
    model = peft.get_peft_model(
        hf(),
        peft.LoraConfig(r=2, lora_alpha=5.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    assert {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n} == adapted
    want = peft_saved(model, tmp_path / "peft", ids)
    ours = load_adapter(base, tmp_path / "peft")
    assert set(ours.layers.lora.weights()) == set(policy.layers.lora.weights())
    np.testing.assert_allclose(np.asarray(ours(IDS)), want, atol=2e-4)


@pytest.mark.slow  # make test-all; adapters-only training: test_lora.py, GRPO on a MoE policy: test_moe_run.py
def test_grpo_trains_the_adapters_only():
    from test_parallel import _decode

    from relax.algorithms.cli.configure import configure
    from relax.algorithms.grpo.config import GRPOConfig
    from relax.algorithms.grpo.step import make_grpo_step
    from relax.algorithms.online.batch import step_input
    from relax.train.optimizer import OptimizerConfig
    from relax.train.state import init_state

    def low(prompts, completions, **fields):  # share of tokens below 32: varies within a group
        return [sum(int(t) < 32 for t in c.split()) / 4 for c in completions]

    base = random_model(QWEN2_MOE)  # its own: the step donates the state's arrays
    frozen = {
        f: np.asarray(getattr(base.layers, f)).copy()
        for f in ("expert_gate", "router", "shared_up", "wq")
    }
    policy = add_lora(
        base,
        LoRAConfig(rank=2, target_modules=("q_proj", "gate_proj", "shared_expert_gate")),
        jax.random.key(0),
    )
    cfg = configure(
        GRPOConfig,
        num_generations=4,
        max_new_tokens=4,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    state = init_state(policy, cfg.optimizer.make(), key=jax.random.key(1), with_reference=True)
    step = make_grpo_step(cfg, StepParts(reward_fns=[low], decode=_decode, eos_ids=(), pad_id=0))
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 64, (2, 5)), jnp.int32)
    for _ in range(2):
        state, out = step(
            state, step_input(ids, jnp.ones_like(ids), ["p"] * 2, {"weight": [1.0] * 2})
        )
    m = out.device.metrics
    assert (
        np.isfinite(float(m["loss"])) and float(m["mismatch/abs_max"]) < 1e-4 and float(m["kl"]) > 0
    )
    ad = state.policy.layers.lora
    for field in ("wq", "w_gate", "shared_gate", "shared_router"):
        assert float(jnp.abs(getattr(ad, field).b).max()) > 0, field  # B moved from 0
    for field, before in frozen.items():
        np.testing.assert_array_equal(np.asarray(getattr(state.policy.layers, field)), before)
