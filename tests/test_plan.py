"""relax.plan: a run compiled for a TPU target with libtpu's compile-only client (no TPU), its
memory per chip against a hand count, a run too large for the chips reported as not fitting,
the decode loop's cache copies, and the HLO roofline's FLOP count against a hand count.

The compile-only tests need libtpu (the ``tpu`` extra, which ``make test`` installs); without it they
are skipped. Target parsing and the out-of-memory message parser need nothing."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from relax.plan import targets
from relax.plan.memory import oom_bytes

needs_tpu = pytest.mark.skipif(
    not targets.tpu_available(), reason="libtpu (the tpu extra) is not installed"
)

L, D, F, V, HQ, HKV, HD = 2, 256, 512, 1024, 4, 2, 64
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": D,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "head_dim": HD,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
RUN = [
    "--batch-size",
    "8",
    "--grpo.num-generations",
    "4",
    "--grpo.max-new-tokens",
    "32",
    "--max-prompt-tokens",
    "16",
]


def hand_count_params(layers: int = L) -> int:
    """Parameters of the tiny Llama: embedding and head, per layer q/k/v/o, gate/up/down and two norms, final norm."""
    per_layer = D * HQ * HD + 2 * D * HKV * HD + HQ * HD * D + 3 * D * F + 2 * D
    return 2 * V * D + layers * per_layer + D


def reward_model_bytes_per_chip(itemsize: int, fsdp: int) -> int:
    """A reward model on the tiny Llama's backbone: no ``lm_head``, every backbone parameter split
    over fsdp (in its stored dtype), and the float32 head ``[D]`` replicated."""
    return (hand_count_params() - V * D) * itemsize // fsdp + D * 4


def test_targets_parse():
    t = targets.Target.parse("v5p:2x2x2")
    assert (t.chips, t.platform, t.chip.name) == (8, "tpu", "v5p")
    assert targets.Target.parse("v6e:4x4").chips == 16
    g = targets.Target.parse("h100x8")
    assert (g.chips, g.platform, g.topology) == (8, "gpu", "1x1x8")
    for bad in ("v5p:2x2", "v5e:2x2x2", "a100x8", "v5e"):
        with pytest.raises(ValueError, match="target"):
            targets.Target.parse(bad)


def test_oom_message_parsed():
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(19.53G) exceeds available HBM (15.75G)."
    )
    needed, available = oom_bytes(msg)
    assert needed == int(19.53 * 2**30) and available == int(15.75 * 2**30)
    assert oom_bytes("something else") == (None, None)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(scope="module")
def rm_config(tmp_path_factory):
    """A reward model's config.json on the tiny Llama, its parameters stored in bfloat16."""
    path = tmp_path_factory.mktemp("rm") / "config.json"
    rm = {**TINY, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    path.write_text(json.dumps({**rm, "torch_dtype": "bfloat16"}))
    return str(path)


@pytest.fixture(scope="module")
def teacher_config(tmp_path_factory):
    """A distillation teacher's config.json: the tiny Llama twice as deep, stored in bfloat16."""
    path = tmp_path_factory.mktemp("teacher") / "config.json"
    path.write_text(json.dumps({**TINY, "num_hidden_layers": 2 * L, "torch_dtype": "bfloat16"}))
    return str(path)


def no_compile(lowered):
    """A ``compile_fn`` that compiles nothing: the state's layout per chip comes from the programs'
    arguments, which a plan lowers without it (each program reads as refused, its temporaries 0)."""
    return None, "RESOURCE_EXHAUSTED: not compiled", 0.0


@pytest.fixture(scope="module")
def tiny_plan(tiny_config):
    from relax.plan import plan

    return plan("grpo", ["--model", tiny_config, *RUN, "--parallel.mesh", "fsdp=4"], "v5e:2x2")


@needs_tpu
@pytest.mark.slow
def test_plan_counts_weights_and_optimizer_by_hand(tiny_plan):
    chips = 4
    weights = hand_count_params() * 4 // chips  # float32, every parameter split over fsdp=4
    names = [m.name for m in tiny_plan.programs]
    assert (
        names[0].startswith("rollout")
        and any("reference" in n for n in names)
        and "update" in names[-1]
    )
    for m in tiny_plan.programs:
        assert m.weights == weights, m
        assert m.reference == weights  # beta > 0 (the grpo preset): a full copy, sharded alike
        assert (
            2 * weights <= m.optimizer <= 2 * weights + 4096
        )  # Adam's two moments, plus step counters
        assert m.error is None and m.fits and m.limit == 16 * 2**30
        assert m.total >= m.weights + m.optimizer + m.reference
    rollout = tiny_plan.programs[0]
    kv = (
        2 * L * (8 * 16 + 8 * 4 * 32) * HKV * HD * 4 // chips
    )  # prompt once per group + each completion
    assert rollout.kv_cache == kv
    assert "fits" in tiny_plan.table() and "v5e:2x2" in tiny_plan.table()


@needs_tpu
def test_reference_flops_by_hand(tiny_plan):
    """The roofline's FLOPs per chip of the reference forward (the tiny Llama, 8 prompts of 16 x 4
    completions of 32, fsdp=4) against a hand count: each layer's matmuls over every prompt token
    (once per group) and completion token, the head over the completion tokens, and attention
    (QK and PV, the whole [Lp + N] keys for each completion token, Lp for each prompt token),
    over 4 chips. Exact only if the layer scan counts its L trips (the TPU compiler does not
    annotate them) and the compiler's convolutions count the taps on real elements alone."""
    p, g, n, lp, chips = 8, 4, 32, 16, 4
    per_token = 2 * (D * HQ * HD + 2 * D * HKV * HD + HQ * HD * D + 3 * D * F)
    layers = L * per_token * (p * lp + p * g * n)
    head = 2 * V * D * p * g * n
    attention = L * 4 * HQ * HD * (p * g * n * (lp + n) + p * lp * lp)
    (reference,) = [t for t in tiny_plan.traffic if t is not None and "reference" in t.name]
    assert reference.flops == (layers + head + attention) / chips


@needs_tpu
def test_decode_loop_copies_no_cache_on_tpu(tiny_plan):
    rollout = tiny_plan.traffic[0]
    assert rollout.decode_step_seconds > 0  # a decode loop was found and costed
    assert rollout.cache_copies == 0
    # rows split over fsdp: the FSDP weights are gathered once before the loop, never per step, and
    # no collective runs per layer (TPU all-reduces a few row-sized values per step: RESULTS.md)
    weights = tiny_plan.programs[0].weights
    gathered = rollout.decode_collectives.get("all-gather", (0, 0))[1]
    assert gathered < weights / 10, rollout.decode_collectives
    assert sum(n for n, _ in rollout.decode_collectives.values()) <= 3, rollout.decode_collectives


@needs_tpu
@pytest.mark.slow
def test_a_run_too_large_is_reported_not_fitting(tmp_path, capsys):
    from relax.plan.cli import main

    big = {
        **TINY,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "head_dim": 128,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "vocab_size": 128256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(big))
    out = tmp_path / "plan.json"
    status = main(
        [
            "plan",
            "grpo",
            "--target",
            "v5e:2x2",
            "--model",
            str(path),
            "--batch-size",
            "4",
            "--grpo.num-generations",
            "2",
            "--grpo.max-new-tokens",
            "8",
            "--max-prompt-tokens",
            "16",
            "--no-suggest",
            "--json",
            str(out),
        ]
    )
    assert status == 3
    text = capsys.readouterr().out
    assert "does NOT fit" in text
    record = json.loads(out.read_text())
    assert record["fits"] is False
    # ~5.5e9 float32 parameters with Adam: > 80 GB over 4 chips of 16 GiB
    assert all(not p["fits"] for p in record["programs"])
    assert (
        max(p["weights"] + p["optimizer"] + p["reference"] for p in record["programs"]) > 16 * 2**30
    )


@needs_tpu
def test_roofline_counts_matmul_flops_by_hand():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from relax.plan.hlo_summary import traffic

    t = targets.Target.parse("v5e:2x2")
    mesh = jax.make_mesh((4,), ("data",), devices=targets.devices(t))
    m, k, n = 1024, 512, 256
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(x, w).compile()
    f = traffic("matmul", compiled, t.chip)
    assert f.flops == 2 * (m // 4) * k * n
    # reads x's and w's shards and writes the result at least once: bf16
    assert f.bytes >= 2 * ((m // 4) * k + k * n + (m // 4) * n)
    assert f.seconds >= f.flops / t.chip.flops


def adapter_params_per_chip(rank: int, fsdp: int) -> int:
    """LoRA factors A [in, r] and B [r, out] on q, k, v, o, gate, up, down, on a mesh without tensor
    parallelism: a factor is split over fsdp where its weight's dimension is the model width D
    (the inputs of q/k/v/gate/up, the outputs of o/down), replicated otherwise."""
    a_split, a_whole = (
        5 * D,
        HQ * HD + F,
    )  # inputs: D for q, k, v, gate, up; o's and down's are not D
    b_split, b_whole = 2 * D, HQ * HD + 2 * HKV * HD + 2 * F  # outputs: D for o and down
    return L * rank * ((a_split + b_split) // fsdp + a_whole + b_whole)


SHORT = ["--max-prompt-tokens", "16", "--max-completion-tokens", "16"]


@needs_tpu
@pytest.mark.parametrize(
    "algorithm,flags,mesh",
    [
        # make test-all: an online trainer compiles fast in tiny_plan (GRPO, fsdp=4); this case adds the
        # tensor axis and the critic
        pytest.param(
            "ppo",
            ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "16"],
            "fsdp=2,tensor=2",
            marks=pytest.mark.slow,
        ),
        # make test-all: GRPO compiles fast in tiny_plan (fsdp=4); this case adds LoRA's adapter bytes
        pytest.param(
            "grpo",
            ["--lora.rank", "8", "--grpo.max-new-tokens", "16"],
            "data=2,fsdp=2",
            marks=pytest.mark.slow,
        ),
        ("sft", ["--sft.max-length", "64"], None),
        # make test-all: every other trainer; their memory per chip is counted by hand, without
        # compiles, in test_offline_plan_splits_weights_and_adam_over_fsdp and
        # test_reward_model_and_teacher_bytes_by_hand
        *[
            pytest.param(algorithm, flags, None, marks=pytest.mark.slow, id=name)
            for name, algorithm, flags in (
                (
                    "dpo",
                    "dpo",
                    ["--dpo.max-prompt-tokens", "16", "--dpo.max-completion-tokens", "16"],
                ),
                (
                    "kto",
                    "kto",
                    ["--kto.max-prompt-tokens", "16", "--kto.max-completion-tokens", "16"],
                ),
                ("rm", "rm", SHORT),
                ("distill", "distill", ["--teacher", "TEACHER", *SHORT]),
                (
                    "agent",
                    "agent",
                    ["--grpo.num-generations", "2", "--grpo.max-new-tokens", "32"]
                    + ["--agent.max-turn-tokens", "8"],
                ),
                (
                    "grpo-reward-model",
                    "grpo",
                    ["--reward-model", "REWARD_MODEL", "--grpo.num-generations", "2"]
                    + ["--grpo.max-new-tokens", "16", "--grpo.beta", "0"],
                ),
            )
        ],
    ],
)
@pytest.mark.slow
def test_every_trainer_compiles_for_tpu(request, tiny_config, algorithm, flags, mesh):
    from relax.plan import plan

    fixtures = {"TEACHER": "teacher_config", "REWARD_MODEL": "rm_config"}
    flags = [request.getfixturevalue(fixtures[f]) if f in fixtures else f for f in flags]
    argv = ["--model", tiny_config, "--batch-size", "4", *flags] + (
        ["--parallel.mesh", mesh] if mesh else []
    )
    if algorithm in ("ppo", "grpo", "agent"):
        argv += ["--max-prompt-tokens", "16"]
    p = plan(algorithm, argv, "v5e:2x2")
    assert p.programs and all(m.error is None and m.fits for m in p.programs), p.table()
    # parameters split over fsdp x tensor; norms [D] over fsdp only (tensor splits heads, MLP width
    # and vocabulary); data replicates. Without a mesh every trainer takes fsdp=-1: 4 chips.
    fsdp, tensor = {"fsdp=2,tensor=2": (2, 2), "data=2,fsdp=2": (2, 1), None: (4, 1)}[mesh]
    norms = (2 * L + 1) * D
    full = (hand_count_params() - norms) * 4 // (fsdp * tensor) + norms * 4 // fsdp
    fused = ("decode_turn", "append")  # the multi-turn decoder's, with its fused weights too
    for m in p.programs:
        if "--lora.rank" in flags:
            # base weights plus adapters; Adam's moments of the adapters only (the base is frozen)
            adapters = adapter_params_per_chip(8, fsdp) * 4
            assert m.weights == full + adapters, m
            assert 2 * adapters <= m.optimizer <= 2 * adapters + 4096
        elif algorithm == "rm":  # the policy is a reward model: no lm_head, a float32 head
            assert m.weights == reward_model_bytes_per_chip(4, fsdp), m
        elif m.name in fused:
            assert m.weights > full, m
        else:
            assert m.weights == full, m
    if algorithm == "ppo":
        assert p.programs[0].critic > 0  # the critic and its optimizer are resident too
    if algorithm == "agent":
        assert [m.name for m in p.programs][:4] == ["start", "fused_layers", *fused]
    if "--reward-model" in argv:
        assert p.programs[1].name == "reward_model" and p.programs[1].reward_model > 0


@needs_tpu
def test_offline_plan_splits_weights_and_adam_over_fsdp(tiny_config):
    """An offline trainer is planned on the run's meshes, as it runs: SFT with the 4 chips in
    ``data`` (fsdp=1) holds the whole float32 weights and Adam's two moments on each chip; with
    ``fsdp=4`` a quarter of them (counted from the parameters; nothing compiled)."""
    from relax.plan import plan

    params, held = hand_count_params(), {}
    argv = ["--model", tiny_config, "--batch-size", "4", "--sft.max-length", "64"]
    for mesh, shards in (("data=4", 1), ("fsdp=4", 4)):
        argv_mesh = [*argv, "--parallel.mesh", mesh]
        (m,) = plan("sft", argv_mesh, "v5e:2x2", compile_fn=no_compile).programs
        weights = params * 4 // shards
        assert m.weights == weights, mesh
        assert 2 * weights <= m.optimizer <= 2 * weights + 4096, mesh  # plus the step counters
        held[mesh] = m.weights + m.optimizer
    assert held["fsdp=4"] == pytest.approx(held["data=4"] / 4, rel=1e-3)


@needs_tpu
@pytest.mark.slow
def test_agent_on_several_hosts_samples_on_each_hosts_copy(tiny_config):
    """``relax agent`` on a slice of two hosts (v5p:2x2x2, 4 chips each) samples each host's half
    of the prompts on its own copy of the policy over its 4 chips (``relax.parallel.local``): the
    decoder's start holds the trainer's eighth of the weights and the copy's quarter, and 4 of the
    8 prompts ([4, 16] ids and mask, int32, and the key); on one host (v5e:2x2) the policy as the
    mesh holds it (counted from the parameters; nothing compiled)."""
    from relax.plan import plan

    full = hand_count_params() * 4
    argv = ["--model", tiny_config, "--batch-size", "8", "--grpo.num-generations", "2"]
    argv += ["--grpo.max-new-tokens", "32", "--agent.max-turn-tokens", "8"]
    argv += ["--max-prompt-tokens", "16"]
    for target, mesh, weights, prompts in (
        ("v5p:2x2x2", "fsdp=8", full // 8 + full // 4, 4),
        ("v5e:2x2", "fsdp=4", full // 4, 8),
    ):
        p = plan("agent", [*argv, "--parallel.mesh", mesh], target, compile_fn=no_compile)
        start = p.programs[0]
        assert start.name == "start" and start.weights == weights, (target, start)
        assert start.batch == 2 * prompts * 16 * 4 + 8, (target, start)


@needs_tpu
@pytest.mark.slow
def test_agent_plan_replays_a_mixtures_routes(tmp_path):
    """A mixture of experts' agent run replays its sampler's experts in the update: the plan's
    stand-in for the rollout gives the update the routes the run's rollout records (int8 experts
    of every layer, ``[P, Lp, L, k]`` for prompts and ``[P, G, N, L, k]`` for completions, by
    hand), so the plan lowers the update the run compiles (nothing compiled)."""
    from relax.plan import agent as plan_agent
    from relax.plan.plan import parse_run
    from relax.plan.trainers import ALGORITHMS
    from relax.plan.vision import language_config

    moe = {**TINY, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    (tmp_path / "config.json").write_text(
        json.dumps({**moe, "num_local_experts": 4, "num_experts_per_tok": 2})
    )
    argv = ["--model", str(tmp_path / "config.json"), "--batch-size", "4"]
    argv += ["--grpo.num-generations", "2", "--grpo.max-new-tokens", "32"]
    run = parse_run("agent", [*argv, "--agent.max-turn-tokens", "8", "--max-prompt-tokens", "16"])
    devices = targets.devices(targets.Target.parse("v5e:2x2"))
    programs = plan_agent.update_programs(
        run, ALGORITHMS["agent"].algorithm(run), language_config(run.model), devices, no_compile
    )
    update = [p for p in programs if p.name.endswith("update")]
    assert len(update) == 1, [p.name for p in programs]
    routes = update[0].args[1].routes
    assert routes is not None, "the update was planned without the sampler's routes"
    assert routes.prompt.shape == (4, 16, L, 2) and routes.completion.shape == (4, 2, 32, L, 2)
    assert routes.prompt.dtype == routes.completion.dtype == jnp.int8


@needs_tpu
@pytest.mark.slow
def test_reward_model_and_teacher_bytes_by_hand(tiny_config, rm_config, teacher_config):
    """What a plan holds beside the policy's state, counted from the parameters (nothing
    compiled): GRPO's reward model (``--reward-model``, stored in bfloat16) on every chip of the
    trainer beside each program, with its scoring program after the sampler; a distillation's
    teacher (twice as deep, stored in bfloat16) as the state's reference."""
    from relax.plan import plan

    argv = ["--model", tiny_config, "--batch-size", "4", "--parallel.mesh", "fsdp=4"]
    grpo = plan(
        "grpo",
        [*argv, "--reward-model", rm_config, "--grpo.num-generations", "2"]
        + ["--grpo.max-new-tokens", "16", "--max-prompt-tokens", "16"],
        "v5e:2x2",
        compile_fn=no_compile,
    )
    assert [m.name for m in grpo.programs][:2] == ["rollout", "reward_model"]
    for m in grpo.programs:
        assert m.reward_model == reward_model_bytes_per_chip(2, 4), m
        assert m.total >= m.weights + m.optimizer + m.reward_model
    assert "reward_model" in grpo.table()
    distill = plan(
        "distill", [*argv, "--teacher", teacher_config, *SHORT], "v5e:2x2", compile_fn=no_compile
    )
    for m in distill.programs:
        assert m.weights == hand_count_params() * 4 // 4, m  # the student, float32
        assert m.reference == hand_count_params(2 * L) * 2 // 4, m  # the teacher, bfloat16


@needs_tpu
@pytest.mark.slow
def test_multi_turn_decoder_compiles_for_tpu(tiny_config):
    from relax.algorithms.online.config import ModelRunConfig
    from relax.models.hf.checkpoint import read_config
    from relax.parallel import make_mesh
    from relax.plan.plan import compile_program
    from relax.plan.programs import abstract_model, laid_out, multi_turn_programs
    from relax.rollout.turns import TurnConfig

    cfg = TurnConfig(num_generations=2, max_tokens=64, max_turn_tokens=16, eos_ids=(2,))
    run = ModelRunConfig(model=tiny_config, data="-")
    mesh = make_mesh("fsdp=4", targets.devices(targets.Target.parse("v5e:2x2")))
    model = laid_out(abstract_model(run, read_config(tiny_config)), mesh)
    programs = multi_turn_programs(model, cfg, 4, 16, 8, compile_fn=compile_program)
    assert [p.name for p in programs] == ["start", "fused_layers", "decode_turn", "append"]
    for p in programs:
        assert p.error is None and p.compiled.memory_analysis().temp_size_in_bytes >= 0
        assert p.compiled.as_text()  # the TPU program's HLO


def test_cli_usage_errors(capsys):
    from relax.plan.cli import main
    from relax.plan.plan import parse_run

    assert main([]) == 2 and main(["plan"]) == 2 and main(["plan", "--target", "v5e:2x2"]) == 2
    assert main(["plan", "grpo", "--model", "config.json"]) == 2  # no --target
    assert "--target" in capsys.readouterr().err
    bad = ["plan", "grpo", "--target", "v5e:2x2", "--model", "config.json", "--compile-threads"]
    assert main([*bad, "0"]) == 2 and main([*bad, "two"]) == 2
    assert "--compile-threads must be a whole number >= 1, got 'two'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--model"):
        parse_run("grpo", ["--batch-size", "8"])
    with pytest.raises(ValueError, match="knows"):
        parse_run("a2c", ["--model", "x"])
    from relax.plan import ALGORITHMS
    from relax.plan.cli import USAGE, help_text

    assert all(name in USAGE and name in help_text() for name in ALGORITHMS)
    for name in ("sft", "kto", "agent"):  # every trainer over every chip unless told otherwise
        assert parse_run(name, ["--model", "config.json"]).parallel.mesh == "fsdp=-1"
    run = parse_run("grpo", ["--model", "config.json", "--grpo.packing.mode", "on"])
    assert (
        run.parallel.mesh == "fsdp=-1" and run.grpo.packing.mode == "off"
    )  # every chip; planned padded


@needs_tpu
@pytest.mark.slow  # make test-all (two mesh compiles); the planner's one-mesh accounting stays fast above
def test_sampler_split_and_offloaded_reference(tiny_config):
    from relax.plan import plan

    p = plan(
        "grpo",
        [
            "--model",
            tiny_config,
            *RUN,
            "--parallel.mesh",
            "fsdp=2",
            "--parallel.sampler-devices",
            "2",
            "--parallel.offload-reference",
        ],
        "v5e:2x2",
    )
    full = hand_count_params() * 4
    rollout, *trainer = p.programs
    # the sampler's 2 chips (data=2) hold their own whole copy of the policy, nothing else
    assert (rollout.weights, rollout.optimizer, rollout.reference) == (full, 0, 0), rollout
    for (
        m
    ) in trainer:  # the trainer's 2 chips: fsdp=2; the reference on the device only for its readers
        assert m.weights == full // 2 and m.fits, m
    assert all(
        m.reference == full // 2 for m in trainer
    )  # the reference forward and the update read it


@needs_tpu
def test_suggest_keeps_what_lowers_the_peak_until_it_fits(monkeypatch, tiny_config):
    """The greedy search over candidate flags, with the compiles stood in for by a peak that each
    flag lowers by a known amount (a real run of it is in RESULTS.md)."""
    from relax.plan import suggest as suggest_lib
    from relax.plan.memory import ProgramMemory
    from relax.plan.plan import Plan, parse_run

    gib = (
        2**30
    )  # remat lowers the peak by 6 GiB, offloading the reference by 3, micro-batches by nothing

    def fake_plan(peak: float, run) -> Plan:
        m = ProgramMemory("update", 0, 0, 0, 0, 0, 0, 0, 0, int(peak), 16 * gib)
        return Plan("grpo", targets.Target.parse("v5e:2x2"), run, None, (m,), (None,), 0.0)

    def fake_plan_run(algorithm, run, model, target, **_):
        peak = (
            24 * gib
            - (6 * gib if run.grpo.forward.remat else 0)
            - (3 * gib if run.parallel.offload_reference else 0)
        )
        return fake_plan(peak, run)

    monkeypatch.setattr(suggest_lib, "plan_run", fake_plan_run)
    argv = ["--model", tiny_config, "--parallel.mesh", "fsdp=4", "--grpo.no-remat"]
    start = fake_plan(24 * gib, parse_run("grpo", argv))
    names = [c[0] for c in suggest_lib.candidates(start)]
    assert names[:2] == ["--grpo.remat", "--grpo.grad-accum"] and "--lora.rank" in names
    attempts = suggest_lib.suggest(start, argv)
    assert attempts[0].flags == ("--grpo.remat",) and attempts[0].kept and not attempts[0].fits
    assert not any(
        a.kept for a in attempts if a.flags[0] == "--grpo.grad-accum"
    )  # changed nothing: dropped
    assert (
        attempts[-1].flags == ("--parallel.offload-reference",) and attempts[-1].fits
    )  # 15 GiB: stop here


@needs_tpu
@pytest.mark.parametrize(
    "algorithm, flags, runs, tried",
    [
        # 8 prompt groups of 16 x 1,024 slots over 4 chips: 2 groups (32,768) per chip are over
        # the default 16,384 positions a chip takes in a micro-batch, 1 group is not: 2
        ("grpo", ["--grpo.num-generations", "16", "--grpo.max-new-tokens", "1024"], 2, (4, 8)),
        (
            "grpo",
            ["--grpo.num-generations", "16", "--grpo.max-new-tokens", "1024"]
            + ["--grpo.grad-accum", "4"],
            4,
            (8,),
        ),
        ("grpo", ["--grpo.num-generations", "2", "--grpo.max-new-tokens", "16"], 1, (2, 4, 8)),
        # 64 pairs of 2 x 1,536 completion positions, 16 per chip (49,152): 4 pairs a chip
        # (12,288) fit the budget, 8 do not; the micro-batch counts that split 64 over 4 chips
        # are 1, 2, 4, 8 and 16, so 4
        (
            "dpo",
            ["--batch-size", "64", "--dpo.max-prompt-tokens", "512"]
            + ["--dpo.max-completion-tokens", "1536"],
            4,
            (8, 16, 32),
        ),
        # SFT's packed rows take --sft.grad-accum's count, 1 by default, whatever their length
        ("sft", ["--batch-size", "64", "--sft.max-length", "2048"], 1, (2, 4, 8)),
    ],
)
def test_suggested_micro_batches_start_from_the_runs_own(
    tiny_config, algorithm, flags, runs, tried
):
    """The micro-batches ``suggest`` tries are more than the run already takes (2a, 4a, 8a of
    its ``a``, those that split its rows), ``a`` counted by hand from the budget per chip
    (``MICRO_BATCH_TOKENS``) on v5e:2x2 with fsdp=4; a smaller count would only raise the peak."""
    from relax.passes import MICRO_BATCH_TOKENS
    from relax.plan import suggest as suggest_lib
    from relax.plan.plan import Plan, parse_run

    assert MICRO_BATCH_TOKENS == 16_384
    argv = ["--model", tiny_config, "--batch-size", "8", "--parallel.mesh", "fsdp=4", *flags]
    run = parse_run(algorithm, argv)
    p = Plan(algorithm, targets.Target.parse("v5e:2x2"), run, None, (), (), 0.0)
    assert suggest_lib.micro_batches(p) == runs
    flag = f"--{algorithm}.grad-accum"
    assert tuple(int(c[1]) for c in suggest_lib.candidates(p) if c[0] == flag) == tried


def int8_sampler_bytes_by_hand(tensor: int, scale_bytes: int) -> int:
    """The tiny Llama's int8 sampler weights on a chip: per layer each matrix's codes (1 byte),
    split over ``tensor`` by heads (q/k/v, o) and MLP units (gate/up, down), plus one scale per
    output channel, split where the output axis is (q/k/v: heads, gate/up: units; o and down
    output the model width, their scales whole); the int8 head ``[V, D]`` and its ``V`` scales,
    vocabulary rows over ``tensor``."""
    codes = D * HQ * HD + 2 * D * HKV * HD + HQ * HD * D + 3 * D * F
    split_scales = HQ * HD + 2 * HKV * HD + 2 * F
    whole_scales = D + D
    per_layer = codes // tensor + split_scales * scale_bytes // tensor + whole_scales * scale_bytes
    return L * per_layer + V * (D + scale_bytes) // tensor


def test_sampler_weights_by_hand():
    """``relax plan``'s sampler weight copy per chip: 1 byte per quantized parameter plus scales
    (int8, bfloat16 scales), 4 per parameter (the float32 parameters' own copy), by hand."""
    from jax.sharding import AbstractMesh, AxisType

    from relax.models.config.model import family_config
    from relax.plan.memory import sampler_weights_per_chip

    config = family_config(
        "llama", vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L, num_heads=HQ,
        num_kv_heads=HKV, head_dim=HD, max_position_embeddings=2048,
    )  # fmt: skip
    for tensor in (1, 2):
        mesh = AbstractMesh(
            (1, 1, 4 // tensor, tensor), ("data", "expert", "fsdp", "tensor"),
            axis_types=(AxisType.Auto,) * 4,
        )  # fmt: skip
        got = sampler_weights_per_chip(config, "int8", jnp.float32, jnp.bfloat16, mesh)
        assert got == int8_sampler_bytes_by_hand(tensor, 2), tensor
        fp8 = sampler_weights_per_chip(config, "fp8", jnp.float32, jnp.float32, mesh)
        assert fp8 == int8_sampler_bytes_by_hand(tensor, 4)  # the same layout, float32 scales
        model = sampler_weights_per_chip(config, "model", jnp.float32, jnp.bfloat16, mesh)
        assert model == (hand_count_params() - 2 * V * D - 2 * L * D - D) * 4 // tensor


@needs_tpu
@pytest.mark.slow  # make test-all (another compile of the tiny plan, ~30 s)
def test_int8_sampler_planned_in_one_byte_per_weight(tiny_config, tiny_plan):
    """``--grpo.sampler-precision int8`` on the tiny plan: the sampler's weight copy by hand (out of
    its temporaries), fewer bytes per decode step, and the table says so. (Its total is not
    compared: the temporaries of a model this small sit partly in the TPU's on-chip memory, which
    the compiler does not count; docs/planner.md has a 4096-wide model's.)"""
    from relax.plan import plan

    argv = ["--model", tiny_config, *RUN, "--parallel.mesh", "fsdp=4"]
    p = plan("grpo", [*argv, "--grpo.sampler-precision", "int8"], "v5e:2x2")
    rollout, fp32 = p.programs[0], tiny_plan.programs[0]
    assert rollout.sampler_weights == int8_sampler_bytes_by_hand(1, 4)  # compute float32
    assert fp32.sampler_weights == (hand_count_params() - 2 * V * D - 2 * L * D - D) * 4
    assert rollout.fits
    assert p.traffic[0].decode_step_bytes < tiny_plan.traffic[0].decode_step_bytes
    table = p.table()
    assert "sampler int8" in table and "sampler_weights" in table


@needs_tpu
@pytest.mark.slow  # make test-all (a 16-layer compile); the depths and the line through them: test_plan_depth.py
def test_deep_sampler_extended_from_two_shallow_compiles(tmp_path):
    """A 16-layer model's sampler compiled at 4 and 8 layers and extended (``relax.plan.depth``)
    against the same sampler compiled whole: the FLOPs and collectives, which grow by the same
    amount per layer, agree; what is known exactly (state, KV caches) is exact. (The temporaries
    of a model this small sit partly in the TPU's on-chip memory, which the compiler does not
    count; RESULTS.md compares them at Qwen2.5-0.5B's size.)"""
    from relax.plan import plan
    from relax.plan.plan import compile_once

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "num_hidden_layers": 16}))
    argv = ["--model", str(path), *RUN, "--parallel.mesh", "fsdp=4"]
    compile_fn = (
        compile_once()
    )  # the reference and update programs are compiled once for both plans
    fast, whole = (
        plan("grpo", argv, "v5e:2x2", compile_fn=compile_fn, exact=e) for e in (False, True)
    )
    (mf, *rest_f), (mw, *rest_w) = fast.programs, whole.programs
    assert mf.depths == (4, 8) and mw.depths == () and rest_f == rest_w
    assert (mf.weights, mf.optimizer, mf.reference, mf.batch, mf.kv_cache) == (
        mw.weights,
        mw.optimizer,
        mw.reference,
        mw.batch,
        mw.kv_cache,
    )
    tf, tw = fast.traffic[0], whole.traffic[0]
    assert tf.flops == pytest.approx(tw.flops, rel=1e-6)
    assert tf.decode_collectives == tw.decode_collectives
    assert set(tf.collectives) == set(tw.collectives)
    for kind, (
        n,
        size,
    ) in tw.collectives.items():  # the compiler combines the gathers a little differently
        assert tf.collectives[kind][0] == n and tf.collectives[kind][1] == pytest.approx(
            size, rel=0.05
        ), kind
    assert "~ rollout: extended to 16 layers from compiles of its first 4 and 8" in fast.table()


def test_smallest_slice_search(monkeypatch, tiny_config):
    """The search over a kind's slices with the compiles stood in for by a need that halves with
    every doubling of chips; the state floor and a refused layout are passed over, not compiled."""
    from relax.models.hf.checkpoint import read_config
    from relax.plan import search
    from relax.plan.memory import ProgramMemory
    from relax.plan.plan import Plan, parse_run

    assert [str(t) for t in search.slices("v5p")][:3] == ["v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"]
    assert [t.chips for t in search.slices("h100")] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="chip kind"):
        search.slices("a100")
    gib, planned = 2**30, []

    def fake_plan_run(algorithm, run, model, target, **_):
        planned.append(target.chips)
        if target.chips == 16:
            raise ValueError("prompts do not split over 16 chips")
        m = ProgramMemory(
            "update", 0, 0, 0, 0, 0, 0, 0, 0, int(1600 * gib / target.chips), target.chip.hbm_bytes
        )
        return Plan("grpo", target, run, model, (m,), (None,), 0.0)

    monkeypatch.setattr(search, "plan_run", fake_plan_run)
    monkeypatch.setattr(
        search, "state_bytes", lambda *a: 500 * gib
    )  # more than 4 v5p chips hold (380 GiB)
    run, model = parse_run("grpo", ["--model", tiny_config]), read_config(tiny_config)
    p, tried = search.smallest("grpo", run, model, "v5p", compile_fn=None)
    assert planned == [
        8,
        16,
        32,
    ]  # 4 chips skipped by the floor, 16 refused, 32 fits (50 of 95 GiB)
    assert str(p.target) == "v5p:2x4x4" and p.fits
    assert [t.fits for t in tried] == [False, False, False, True] and "state alone" in tried[
        0
    ].reason
    assert "do not split" in tried[2].reason and tried[1].peak_bytes == 200 * gib
    monkeypatch.setattr(search, "state_bytes", lambda *a: 10**15)  # nothing holds it
    assert search.smallest("grpo", run, model, "v5e", compile_fn=None)[0] is None
    with pytest.raises(ValueError, match="-1 axis"):
        search.smallest(
            "grpo",
            parse_run("grpo", ["--model", tiny_config, "--parallel.mesh", "fsdp=4"]),
            model,
            "v5p",
            compile_fn=None,
        )
    monkeypatch.setattr(search, "state_bytes", lambda *a: 500 * gib)
    offline, _ = search.smallest(  # an offline trainer grows with the slice too (fsdp=-1)
        "sft", parse_run("sft", ["--model", tiny_config]), model, "v5p", compile_fn=None
    )
    assert str(offline.target) == "v5p:2x4x4"


def test_state_bytes_by_hand(tiny_config):
    from relax.models.hf.checkpoint import read_config
    from relax.plan.plan import parse_run
    from relax.plan.search import state_bytes

    run = parse_run("grpo", ["--model", tiny_config])
    # float32 weights, Adam's two moments and the reference copy (grpo's beta > 0), plus step counters
    assert (
        0
        <= state_bytes("grpo", run, read_config(tiny_config)) - 4 * 4 * hand_count_params()
        <= 4096
    )
