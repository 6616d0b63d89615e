"""LoRA adapters: the forward against a NumPy merge, gradients against finite differences, the
frozen base, the free reference, the sampler, merge/export, PEFT files and checkpoints."""

import dataclasses
import json
from pathlib import Path

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import random_model

from relax.models import ModelConfig
from relax.models.adapters.operations import (
    adapters_zero,
    add_lora,
    lora_off,
    merge_lora,
    split_trainable,
    trainable,
    with_adapters,
    with_dropout_key,
)
from relax.models.adapters.peft import load_adapter, read_adapter_config, save_adapter
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.models.hf.config import HFFormatError
from relax.models.layers.lora import LoRAConfig, LoRAWeights
from relax.rollout.sampler import RolloutConfig, compiled_generate
from relax.train.checkpoint import Checkpointer
from relax.train.optimizer import OptimizerConfig
from relax.train.primitives import forward_backward, optim_step
from relax.train.state import init_state, reference_is_policy, reference_model

CFG = ModelConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
IDS = jnp.asarray(np.random.default_rng(0).integers(1, 32, (2, 7)), jnp.int32)
PHI3 = dataclasses.replace(CFG, family="phi3")  # q/k/v and gate/up fused in its checkpoints


def randomized(model, seed=1, std=0.1):
    """The adapters with random B (and A), so that they change the model."""
    rng = np.random.default_rng(seed)
    ad = model.layers.lora
    ws = {
        f: LoRAWeights(
            jnp.asarray(std * rng.standard_normal(w.a.shape), w.a.dtype),
            jnp.asarray(std * rng.standard_normal(w.b.shape), w.b.dtype),
        )
        for f, w in ad.weights().items()
    }
    return with_adapters(model, dataclasses.replace(ad, **ws))


def numpy_merged(model):
    """The adapted weights W + s A B, merged in NumPy (float64), as a plain model."""
    ad, layers = model.layers.lora, model.layers
    merged = {
        f: jnp.asarray(
            np.asarray(getattr(layers, f), np.float64)
            + ad.scale
            * np.einsum("lir,lro->lio", np.asarray(w.a, np.float64), np.asarray(w.b, np.float64)),
            jnp.float32,
        )
        for f, w in ad.weights().items()
    }
    return dataclasses.replace(model, layers=dataclasses.replace(layers, lora=None, **merged))


def peft_saved(model, path, ids):
    """``model`` (a ``peft`` model) with random ``lora_B`` (std 0.1, seeded), saved to ``path``;
    its logits on ``ids``."""
    import torch

    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(path)
    with torch.no_grad():
        return model.eval()(ids).logits.numpy()


@pytest.fixture(scope="module")
def base():
    return random_model(CFG)


def test_config_targets_and_scale():
    assert LoRAConfig(rank=8).fields() == (
        "wq",
        "wk",
        "wv",
        "wo",
        "w_gate",
        "w_up",
        "w_down",
        "shared_gate",
        "shared_up",
        "shared_down",
        "shared_router",
    )
    assert LoRAConfig(rank=2, target_modules=("down_proj",)).fields() == ("w_down", "shared_down")
    assert LoRAConfig(rank=4, target_modules=("v_proj", "q_proj")).fields() == ("wq", "wv")
    assert LoRAConfig(rank=4, alpha=8).scale == 2.0
    assert LoRAConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0
    with pytest.raises(ValueError, match="qkv_proj"):
        LoRAConfig(rank=4, target_modules=("qkv_proj",))
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(rank=4, dropout=1.0)


def test_fresh_adapters_are_exactly_the_base(base):
    policy = add_lora(base, LoRAConfig(rank=4), jax.random.key(0))
    assert float(jnp.abs(policy.layers.lora.wq.a).max()) > 0  # A is drawn, B is zero
    np.testing.assert_array_equal(np.asarray(policy(IDS)), np.asarray(base(IDS)))
    assert bool(adapters_zero(policy))
    bound = 1 / np.sqrt(CFG.hidden_size)  # PEFT's default: Kaiming-uniform A
    assert float(jnp.abs(policy.layers.lora.wq.a).max()) <= bound


@pytest.mark.parametrize(
    "targets,rslora", [(("all-linear",), False), (("q_proj", "down_proj"), True)]
)
def test_forward_equals_numpy_merged_weights(base, targets, rslora):
    policy = randomized(
        add_lora(
            base,
            LoRAConfig(rank=3, alpha=6.0, target_modules=targets, use_rslora=rslora),
            jax.random.key(1),
        )
    )
    want = np.asarray(numpy_merged(policy)(IDS))
    np.testing.assert_allclose(np.asarray(policy(IDS)), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(merge_lora(policy)(IDS)), want, atol=2e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(base(IDS)), want, atol=1e-3)


@pytest.mark.slow
def test_lora_gradients_against_finite_differences(base):
    policy = randomized(
        add_lora(
            base,
            LoRAConfig(rank=2, target_modules=("v_proj", "o_proj", "up_proj")),
            jax.random.key(2),
        ),
        std=0.2,
    )
    weights = jnp.asarray(
        np.random.default_rng(3).standard_normal((2, 7, CFG.vocab_size)), jnp.float32
    )
    trained, frozen = split_trainable(policy)

    def loss(t):
        return jnp.sum(jax.nn.log_softmax(eqx.combine(t, frozen)(IDS)) * weights) / 100

    grads = jax.grad(loss)(trained)
    assert all(g is None for g in jax.tree.leaves(eqx.filter(grads, lambda x: x is None)))
    leaves, tree = jax.tree.flatten(trained)
    direction = [
        jnp.asarray(np.random.default_rng(4 + i).standard_normal(x.shape), x.dtype)
        for i, x in enumerate(leaves)
    ]
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), direction))
    eps = 1e-2
    shift = lambda s: jax.tree.unflatten(tree, [x + s * d for x, d in zip(leaves, direction)])  # noqa: E731
    numeric = (float(loss(shift(eps))) - float(loss(shift(-eps)))) / (2 * eps)
    assert abs(analytic - numeric) <= 2e-2 * abs(numeric) + 1e-4, (analytic, numeric)
    assert abs(analytic) > 1e-2


def test_only_adapters_train_and_the_reference_is_the_base(base):
    policy = add_lora(base, LoRAConfig(rank=4), jax.random.key(3))
    opt = OptimizerConfig(learning_rate=1e-2).make()
    state = init_state(policy, opt, key=jax.random.key(0), with_reference=True)
    assert state.ref is None and state.ref_is_base
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2]
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(policy.layers.lora.weights()))
    assert sorted(x.shape for x in moments) == sorted(
        adapter_shapes * 2
    )  # mu and nu of A and B only
    assert bool(reference_is_policy(state))
    chex.assert_trees_all_equal(reference_model(state), base)

    def loss_fn(model, batch):
        return -jnp.mean(jax.nn.log_softmax(model(batch))[..., 3]), {}

    grads, _ = forward_backward(state, IDS, loss_fn)
    new = optim_step(state, grads)
    for name in ("embed", "norm", "lm_head"):
        np.testing.assert_array_equal(
            np.asarray(getattr(new.policy, name)), np.asarray(getattr(base, name))
        )
    np.testing.assert_array_equal(np.asarray(new.policy.layers.wq), np.asarray(base.layers.wq))
    assert not np.array_equal(np.asarray(new.policy.layers.lora.wq.b), 0)
    assert not bool(reference_is_policy(new))
    ref_logits = reference_model(new)(IDS)
    np.testing.assert_array_equal(np.asarray(ref_logits), np.asarray(base(IDS)))
    assert not np.allclose(np.asarray(new.policy(IDS)), np.asarray(ref_logits))


def test_trainable_marks_adapters_and_other_parts():
    model = add_lora(
        random_model(CFG), LoRAConfig(rank=2, target_modules=("q_proj",)), jax.random.key(0)
    )
    head = jnp.zeros(4)
    marks = trainable((model, head))
    assert jax.tree.leaves(marks[1]) == [True]
    assert sum(jax.tree.leaves(marks[0])) == 2  # A and B of q_proj


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.slow
def test_sampler_logprobs_equal_the_trainer_with_adapters(base, merge):
    policy = randomized(add_lora(base, LoRAConfig(rank=4), jax.random.key(4)))
    pm = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    ids = jnp.where(pm > 0, IDS[:, :5], 0)
    cfg = RolloutConfig(
        num_generations=3, max_new_tokens=6, merge_adapters=merge, prompt_buckets=(5,)
    )
    r = compiled_generate(cfg)(policy, ids, pm, jax.random.key(5))
    trainer = completion_logprobs(policy, ids, pm, r.tokens, r.mask)
    m = np.asarray(r.mask) > 0
    np.testing.assert_allclose(np.asarray(r.logprobs)[m], np.asarray(trainer)[m], atol=2e-5)
    base_lp = completion_logprobs(base, ids, pm, r.tokens, r.mask)
    assert not np.allclose(np.asarray(base_lp)[m], np.asarray(trainer)[m], atol=1e-3)


def test_dropout_only_in_a_training_forward(base):
    policy = randomized(add_lora(base, LoRAConfig(rank=4, dropout=0.5), jax.random.key(6)))
    plain = np.asarray(policy(IDS))
    np.testing.assert_allclose(
        plain, np.asarray(numpy_merged(policy)(IDS)), atol=2e-5
    )  # no key: no dropout
    a = np.asarray(with_dropout_key(policy, jax.random.key(1))(IDS))
    b = np.asarray(with_dropout_key(policy, jax.random.key(2))(IDS))
    assert not np.allclose(a, plain, atol=1e-4) and not np.allclose(a, b, atol=1e-4)


def test_merged_export_loads_and_equals_the_unmerged_forward(base, tmp_path):
    policy = randomized(add_lora(base, LoRAConfig(rank=4), jax.random.key(7)))
    with pytest.raises(ValueError, match="LoRA adapters"):
        save_pretrained(policy, tmp_path / "no")
    save_pretrained(merge_lora(policy), tmp_path / "full")
    loaded = load_pretrained(tmp_path / "full")
    np.testing.assert_allclose(
        np.asarray(loaded(IDS)), np.asarray(policy(IDS)), atol=2e-5, rtol=1e-5
    )


def test_peft_files_round_trip_and_bad_configs_are_named(base, tmp_path):
    policy = randomized(
        add_lora(
            base,
            LoRAConfig(
                rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True
            ),
            jax.random.key(8),
        )
    )
    save_adapter(policy, tmp_path / "a", base_model_name_or_path="base")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["use_rslora"] is True
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    back = load_adapter(base, tmp_path / "a")
    chex.assert_trees_all_equal(back, policy)
    config["use_dora"] = True
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(HFFormatError, match="adapter_config.json: use_dora"):
        read_adapter_config(tmp_path / "a")
    other = dataclasses.replace(CFG, hidden_size=16, head_dim=4)
    save_adapter(policy, tmp_path / "b")
    with pytest.raises(HFFormatError, match="lora_A.weight.*shape"):
        load_adapter(random_model(other), tmp_path / "b")


def test_fused_modules_have_no_peft_form(tmp_path):
    """Phi-3's q/k/v (one qkv_proj) and gate/up (one gate_up_proj): PEFT adapts each fused module
    with one lora_A, relax each part with its own, so such adapters are refused both ways, naming
    the modules; its unfused modules (o_proj, down_proj) save and load as any family's."""
    base = random_model(PHI3)
    policy = randomized(add_lora(base, LoRAConfig(rank=2), jax.random.key(3)))
    with pytest.raises(
        ValueError,
        match=r"phi3 stores \['q_proj', 'k_proj', 'v_proj'\] as one self_attn\.qkv_proj, "
        r"\['gate_proj', 'up_proj'\] as one mlp\.gate_up_proj.*no PEFT form.*"
        r"merge_lora.*\['down_proj', 'o_proj'\]",
    ):
        save_adapter(policy, tmp_path / "all")
    assert not (tmp_path / "all").exists()
    for targets, fused in ((("up_proj", "o_proj"), "gate_up_proj"), (("v_proj",), "qkv_proj")):
        with pytest.raises(ValueError, match=fused):
            save_adapter(
                add_lora(base, LoRAConfig(rank=2, target_modules=targets), jax.random.key(3)),
                tmp_path / "x",
            )
    ok = randomized(
        add_lora(
            base,
            LoRAConfig(rank=2, alpha=4.0, target_modules=("o_proj", "down_proj")),
            jax.random.key(4),
        )
    )
    save_adapter(ok, tmp_path / "ok")
    assert sorted(
        json.loads((tmp_path / "ok" / "adapter_config.json").read_text())["target_modules"]
    ) == ["down_proj", "o_proj"]
    chex.assert_trees_all_equal(load_adapter(base, tmp_path / "ok"), ok)
    # an adapter on PEFT's fused module, or on a part of one, is refused when loaded onto Phi-3
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    for targets in (["qkv_proj", "o_proj"], ["q_proj"], "all-linear"):
        (tmp_path / "ok" / "adapter_config.json").write_text(
            json.dumps({**config, "target_modules": targets})
        )
        with pytest.raises(
            HFFormatError, match=r"adapter_config\.json: phi3 stores .* no PEFT form"
        ):
            load_adapter(base, tmp_path / "ok")


def test_checkpoint_holds_adapters_only_and_checks_the_base(tmp_path):
    big = dataclasses.replace(
        CFG, vocab_size=512, hidden_size=128, num_heads=4, head_dim=32, intermediate_size=256
    )
    base = random_model(big)  # weights (1.8 MB) large against orbax's per-leaf metadata
    policy = randomized(add_lora(base, LoRAConfig(rank=2), jax.random.key(9)))
    opt = OptimizerConfig(learning_rate=1e-2).make()
    state = init_state(policy, opt, key=jax.random.key(0), with_reference=True)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, state, config={})
    stored = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    assert stored < base_bytes / 4, (stored, base_bytes)  # the base is not in it
    fresh = init_state(
        add_lora(base, LoRAConfig(rank=2), jax.random.key(1)),
        opt,
        key=jax.random.key(0),
        with_reference=True,
    )
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, _, _ = ckpt.restore(target=fresh)
    chex.assert_trees_all_equal(restored.policy, state.policy)
    other = init_state(
        add_lora(random_model(big, seed=5), LoRAConfig(rank=2), jax.random.key(1)),
        opt,
        key=jax.random.key(0),
        with_reference=True,
    )
    with (
        Checkpointer(tmp_path / "ckpt") as ckpt,
        pytest.raises(ValueError, match="other base weights"),
    ):
        ckpt.restore(target=other)


def test_lora_off_shares_the_base_arrays(base):
    policy = add_lora(base, LoRAConfig(rank=2), jax.random.key(0))
    off = lora_off(policy)
    assert off.layers.wq is policy.layers.wq and off.layers.lora is None


@pytest.mark.parity
@pytest.mark.parametrize("rslora", [False, True])
def test_peft_reads_relax_adapters_and_relax_reads_peft_adapters(base, tmp_path, rslora):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    save_pretrained(base, tmp_path / "base")
    hf = lambda: transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", dtype=torch.float32
    )  # noqa: E731
    ids = torch.tensor(np.asarray(IDS), dtype=torch.long)

    # relax -> peft
    policy = randomized(
        add_lora(base, LoRAConfig(rank=4, alpha=8.0, use_rslora=rslora), jax.random.key(10))
    )
    save_adapter(policy, tmp_path / "ours")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()(ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(policy(IDS)), theirs, atol=2e-4)

    # peft -> relax
    config = peft.LoraConfig(
        r=3,
        lora_alpha=5.0,
        target_modules=["k_proj", "o_proj", "gate_proj"],
        use_rslora=rslora,
        task_type="CAUSAL_LM",
    )
    want = peft_saved(peft.get_peft_model(hf(), config), tmp_path / "peft", ids)
    ours = load_adapter(base, tmp_path / "peft")
    assert ours.layers.lora.weights().keys() == {"wk", "wo", "w_gate"}
    np.testing.assert_allclose(np.asarray(ours(IDS)), want, atol=2e-4)
    assert not np.allclose(np.asarray(base(IDS)), want, atol=1e-3)


@pytest.mark.parity
def test_phi3_lora_against_transformers_and_peft(tmp_path):
    """A LoRA on every Phi-3 weight, merged into the fused checkpoint, is the model transformers
    loads; adapters on its unfused modules go to peft and back with the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = random_model(PHI3)
    save_pretrained(base, tmp_path / "base")
    hf = lambda: transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", dtype=torch.float32
    )  # noqa: E731
    ids = torch.tensor(np.asarray(IDS), dtype=torch.long)

    policy = randomized(add_lora(base, LoRAConfig(rank=3, alpha=6.0), jax.random.key(11)))
    save_pretrained(merge_lora(policy), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(policy(IDS)), merged(ids).logits.numpy(), atol=2e-4)

    partial = randomized(
        add_lora(
            base,
            LoRAConfig(rank=4, alpha=8.0, target_modules=("o_proj", "down_proj")),
            jax.random.key(12),
        )
    )
    save_adapter(partial, tmp_path / "ours")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()(ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(partial(IDS)), theirs, atol=2e-4)
    assert not np.allclose(np.asarray(base(IDS)), theirs, atol=1e-3)

    for targets in (
        ["o_proj", "down_proj"],
        ["qkv_proj"],
    ):  # peft -> relax; the fused one is refused
        model = peft.get_peft_model(
            hf(),
            peft.LoraConfig(r=2, lora_alpha=3.0, target_modules=targets, task_type="CAUSAL_LM"),
        )
        want = peft_saved(model, tmp_path / targets[0], ids)
        if targets == ["qkv_proj"]:
            with pytest.raises(HFFormatError, match=r"self_attn\.qkv_proj.*lora_A shared"):
                load_adapter(base, tmp_path / targets[0])
            continue
        np.testing.assert_allclose(
            np.asarray(load_adapter(base, tmp_path / targets[0])(IDS)), want, atol=2e-4
        )


@pytest.mark.slow
def test_k_adapters_in_one_program_equal_k_separate_runs(base):
    from relax.train.many import (
        adapter,
        init_many,
        stack_adapters,
        vmap_over_adapters,
        with_learning_rate_scale,
    )
    from relax.train.update import make_update

    def loss_fn(model, mb, ctx):
        logp = jax.nn.log_softmax(model(mb["ids"]))
        nll = -jnp.take_along_axis(logp[:, :-1], mb["ids"][:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mb["loss_mask"][:, 1:]) / ctx.norms["tokens"], {"nll": jnp.mean(nll)}

    rng = np.random.default_rng(0)
    batch = {
        "ids": jnp.asarray(rng.integers(1, 32, (4, 6)), jnp.int32),
        "loss_mask": jnp.ones((4, 6), jnp.int32),
    }
    lora, scales, lr = (
        LoRAConfig(rank=2, target_modules=("q_proj", "v_proj", "down_proj")),
        [0.5, 1.0, 4.0],
        1e-2,
    )
    models = [add_lora(base, lora, jax.random.key(k)) for k in range(3)]
    keys = jax.random.split(jax.random.key(7), 3)

    def opt(scale):
        return OptimizerConfig(learning_rate=lr * scale, weight_decay=0.1).make()

    separate = []
    for m, s, k in zip(models, scales, keys):
        update = jax.jit(make_update(loss_fn, opt(s), minibatches=2, grad_accum=1))
        o = opt(s).init(split_trainable(m)[0])
        for _ in range(3):
            m, o, metrics = update(m, o, batch, k)
        separate.append((m, metrics))

    shared = with_learning_rate_scale(opt(1.0))
    stacked = stack_adapters(models)
    states = init_many(shared, stacked, scales)
    update = jax.jit(
        vmap_over_adapters(make_update(loss_fn, shared, minibatches=2, grad_accum=1), stacked)
    )
    for _ in range(3):
        stacked, states, metrics = update(stacked, states, batch, keys)
    assert metrics["loss"].shape == (3,)
    for k, (m, met) in enumerate(separate):
        chex.assert_trees_all_close(
            adapter(stacked, k).layers.lora, m.layers.lora, atol=1e-6, rtol=1e-5
        )
        np.testing.assert_allclose(float(metrics["loss"][k]), float(met["loss"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(stacked.layers.wq), np.asarray(base.layers.wq))


@pytest.mark.slow
def test_float32_adapters_over_a_bfloat16_base_keep_small_updates(base):
    from relax.models.decoder.transformer import cast

    low = cast(base, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    f32 = add_lora(low, LoRAConfig(rank=2), jax.random.key(0))
    same = add_lora(low, LoRAConfig(rank=2, dtype="base"), jax.random.key(0))
    assert f32.layers.lora.wq.a.dtype == jnp.float32 and same.layers.lora.wq.a.dtype == jnp.bfloat16
    assert f32(IDS).dtype == jnp.float32  # logits accumulate in float32 either way

    def step(model):
        state = init_state(model, OptimizerConfig(learning_rate=1e-5).make(), key=jax.random.key(0))
        for _ in range(2):
            grads, _ = forward_backward(state, IDS, lambda m, b: (jnp.mean(m(b)[..., 1]), {}))
            state = optim_step(state, grads)
        return state.policy.layers.lora.wq

    # step 1 moves only B (A's gradient is 0 while B = 0); step 2 moves A by ~2e-5, under half a
    # bfloat16 ulp for entries above 2^-7 (A is U(-0.18, 0.18)): lost in bfloat16, kept in float32
    w32, w16 = step(f32), step(same)
    moved = lambda w, a0: float(jnp.mean(w.a != a0))  # noqa: E731
    assert moved(w32, f32.layers.lora.wq.a) > 0.9
    assert moved(w16, same.layers.lora.wq.a) < 0.2


def test_run_export_of_fused_adapters_writes_the_merged_model_and_warns(tmp_path):
    """A run's export (``relax.algorithms.online.setup.exporter``) of a Phi-3 policy with adapters on its
    fused tensors: the merged model (what transformers loads) is written, the PEFT adapter is not,
    and a warning says why; with adapters only on unfused modules both are written."""
    from relax.algorithms.online.setup import exporter
    from relax.models.hf.checkpoint import load_pretrained

    class NoTokenizer:
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer_saved").write_text("")

    policy = randomized(add_lora(random_model(PHI3), LoRAConfig(rank=2), jax.random.key(3)))
    with pytest.warns(UserWarning, match=r"adapters alone are not: phi3 stores .*qkv_proj"):
        exporter(NoTokenizer())(policy, tmp_path / "fused")
    assert not (tmp_path / "fused" / "adapter").exists()
    chex.assert_trees_all_close(load_pretrained(tmp_path / "fused"), merge_lora(policy), atol=1e-6)
    ok = randomized(
        add_lora(
            random_model(PHI3), LoRAConfig(rank=2, target_modules=("o_proj",)), jax.random.key(4)
        )
    )
    exporter(NoTokenizer())(ok, tmp_path / "ok")
    assert (tmp_path / "ok" / "adapter" / "adapter_config.json").exists()
