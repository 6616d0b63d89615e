import functools
import os
import tempfile

# Tests run on the CPU; the mesh tests ask for 8 simulated devices themselves.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Test programs are tiny: XLA's backend optimisation costs more than it saves (a cold-cache
# suite ~40% faster). RELAX_TEST_XLA_OPT=1 keeps the full pipeline (e.g. on an accelerator).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get("RELAX_TEST_XLA_OPT") != "1":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def use_compile_cache() -> None:
    """The suite's persistent compilation cache (also called by the subprocess workers): many
    tests build the same small programs again (a fresh jit per trainer, and the eager ops between
    them, each its own program); the cache turns those recompiles into disk reads. Every program
    is kept, however quick its compile: a test compiles hundreds of ~20 ms programs (a service test
    916), and reading one back costs a quarter of that (benchmarks/RESULTS.md)."""
    jax.config.update(
        "jax_compilation_cache_dir",
        os.environ.get(
            "RELAX_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "relax-test-jax-cache")
        ),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


use_compile_cache()


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    """The heaviest test files first: with ``--dist loadfile --no-loadscope-reorder`` (the
    Makefile's) pytest-xdist hands files to its workers in this order, so no long file starts last
    while the other worker idles. A file weighs the seconds of its selected tests, as
    ``tests/test_seconds.json`` (``benchmarks/suite_profile.py --write``) last measured them."""
    import json
    from pathlib import Path

    store = Path(__file__).with_name("test_seconds.json")
    seconds = json.loads(store.read_text()) if store.exists() else {}
    weight = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        weight[path] = weight.get(path, 0.0) + seconds.get(item.nodeid, 0.0)
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])  # stable: files stay whole


def load_example(name: str):
    """``examples/train_<name>.py`` as a module (its ``main(argv)`` runs the command line in-process)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"train_{name}.py"
    spec = importlib.util.spec_from_file_location(f"train_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tokenizer directories in the styles of the major model families (``text_fixtures``)."""
    from text_fixtures import STYLES, make_model_dir

    root = tmp_path_factory.mktemp("models")
    return {style: make_model_dir(root, style) for style in STYLES}


@pytest.fixture(scope="module")
def auto():
    """``auto(directory)``: transformers' AutoTokenizer for it (cached); skips without transformers."""
    transformers = pytest.importorskip("transformers")
    return functools.lru_cache(maxsize=None)(
        lambda d: transformers.AutoTokenizer.from_pretrained(d)
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. Each XLA:CPU executable holds memory
    maps of its code; kept alive for the whole suite they approach the kernel's per-process limit
    (``vm.max_map_count``, 65530 here), where a later compile or cache write dies in a segfault."""
    yield
    jax.clear_caches()
