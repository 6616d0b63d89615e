"""The documentation (README.md and docs/) is runnable and links where it says.

* Every ```python block runs (``test_each_python_block_runs``), in a fresh namespace, in a
  temporary directory that holds ``hf_dir/`` (a tiny random model with a tiny tokenizer, for the
  blocks that load "hf_dir"), with tiny stand-ins for the names a block leaves to the reader
  (``STANDINS``: the stages of the compose example) and, for the service's client code, a
  ``ServiceClient`` that is a ``LocalServiceClient`` on a tiny in-process service. A block can be
  marked not runnable, with its reason, by ``<!-- not-runnable: reason -->`` on the line just
  before it (``MAX_NOT_RUNNABLE`` of them at most). The block marked ``<!-- primitives-loop -->``
  is run by ``tests/test_primitives.py`` (which also checks that it learns) when that test reads
  the block's page, else here.
* Links: every relative link of README.md and of the pages resolves to a file (and, for a page of
  the site, an anchor it has); ``mkdocs build --strict`` (``make docs``) checks the site's links
  too, but is not part of the test suite.
* mkdocs.yml's nav lists every page under docs/ once, and nothing else; the API reference covers
  the public packages (``REFERENCE``) and names only modules that exist.
* docs/architecture.md's "Layers" table lists the layers of ``tests/test_layers.py`` in their
  order, with the sub-packages of ``relax.models`` and ``relax.algorithms``.
* README.md stays short (at most 200 lines) and holds no commit hashes or issue numbers.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
NOT_RUNNABLE = re.compile(r"<!--\s*not-runnable:\s*(.*?)\s*-->\s*$")
PRIMITIVES_MARK = "<!-- primitives-loop -->"
MAX_NOT_RUNNABLE = 3
# The packages the API reference must render (a `::: name` line under docs/reference/).
REFERENCE = [
    "relax",
    "relax.models",
    "relax.rollout",
    "relax.text",
    "relax.data",
    "relax.rewards",
    "relax.objectives",
    "relax.train",
    "relax.parallel",
    "relax.eval",
    "relax.serve",
    "relax.plan",
    *[
        f"relax.algorithms.{name}"
        for name in ("grpo", "ppo", "sft", "dpo", "kto", "reward_model", "distill", "agent", "rlhf")
    ],
]


def python_blocks(page: Path) -> list[tuple[int, str, str | None, bool]]:
    """``(line, code, not_runnable_reason, primitives_loop)`` for every ```python block of ``page``."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, end = i + 1, i + 1
            while lines[end].strip() != "```":
                end += 1
            before = lines[i - 1] if i > 0 else ""
            marked = NOT_RUNNABLE.search(before)
            blocks.append(
                (
                    start + 1,
                    "\n".join(lines[start:end]) + "\n",
                    marked.group(1) if marked else None,
                    before.strip() == PRIMITIVES_MARK,
                )
            )
            i = end
        i += 1
    return blocks


BLOCKS = [
    (page.relative_to(ROOT), line, code, reason, loop)
    for page in PAGES
    for line, code, reason, loop in python_blocks(page)
]


def primitives_test_reads(page: Path) -> bool:
    """Whether tests/test_primitives.py reads the page (names its file)."""
    return f'"{page.name}"' in (ROOT / "tests" / "test_primitives.py").read_text()


# ------------------------------------------------------------------------------------------------
# Stand-ins for what a block leaves to the reader.


def tiny_config(vocab_size: int, **overrides):
    from relax.models import small_config

    return small_config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        **overrides,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory holding ``hf_dir/``: a tiny random Llama and a tiny ChatML tokenizer."""
    import jax
    from text_fixtures import make_model_dir

    from relax import load_tokenizer
    from relax.models import init, save_pretrained

    root = tmp_path_factory.mktemp("docs")
    hf_dir = make_model_dir(root, "qwen25").rename(root / "hf_dir")
    tokenizer = load_tokenizer(hf_dir)
    config = tiny_config(-(-tokenizer.vocab_size // 64) * 64, eos_token_id=tokenizer.eos_token_id)
    save_pretrained(init(config, jax.random.key(0)), hf_dir)
    return root


def standins() -> dict:
    """Names the blocks use without defining them: the compose example's stages and batch."""
    import jax.numpy as jnp

    from relax import stage

    def add(name: str, value: float):
        return stage(lambda state, batch: (state, {**batch, name: batch["x"] + value}))

    return {
        "rollout": add("tokens", 1.0),
        "score": add("rewards", 2.0),
        "advantage": add("advantages", 3.0),
        "update": stage(lambda state, batch: ({"step": state["step"] + 1}, batch)),
        "state": {"step": jnp.zeros((), jnp.int32)},
        "batch": {"x": jnp.zeros(2)},
    }


def local_service_client(tmp_path: Path):
    """A ``ServiceClient`` stand-in: the same client on a tiny service in this process."""
    import jax

    from relax.models import init
    from relax.models.layers.lora import LoRAConfig
    from relax.serve.client import LocalServiceClient
    from relax.serve.service import Service, ServiceConfig

    base = init(tiny_config(16, eos_token_id=3, max_position_embeddings=64), jax.random.key(0))
    service = Service(
        base, None, ServiceConfig(model="tiny", state_dir=str(tmp_path), lora=LoRAConfig(rank=4))
    )
    return lambda url, **kwargs: LocalServiceClient(service)


# ------------------------------------------------------------------------------------------------
# The tests.


def test_the_pages_have_python_blocks():
    assert len(BLOCKS) >= 6
    marked = [(page, line) for page, line, _, reason, _ in BLOCKS if reason is not None]
    assert len(marked) <= MAX_NOT_RUNNABLE, f"too many blocks marked not runnable: {marked}"
    assert all(reason for *_, reason, _ in BLOCKS if reason is not None), "give the reason"
    loops = [(page, line) for page, line, *_, loop in BLOCKS if loop]
    assert len(loops) == 1, f"{PRIMITIVES_MARK} must mark exactly one python block: {loops}"


@pytest.mark.parametrize(
    "page, line, code, reason, loop", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS]
)
@pytest.mark.slow
def test_each_python_block_runs(page, line, code, reason, loop, workdir, monkeypatch, tmp_path):
    if reason is not None:
        pytest.skip(f"marked not runnable: {reason}")
    if loop and primitives_test_reads(page):
        pytest.skip("tests/test_primitives.py runs this loop and checks that it learns")
    monkeypatch.chdir(workdir)
    if "ServiceClient" in code:
        pytest.importorskip("starlette", reason="the service's client code needs the serve extra")
        import relax.serve.client

        monkeypatch.setattr(relax.serve.client, "ServiceClient", local_service_client(tmp_path))
    namespace = {"__name__": f"doc_block_{line}", **standins()}
    exec(compile(code, f"{page}:{line}", "exec"), namespace)


def test_the_compose_example_composes():
    """With the stand-ins, the README's compose example is a real step: every stage ran, in order."""
    code = next(code for page, _, code, *_ in BLOCKS if page == Path("README.md"))
    namespace = standins()
    exec(compile(code, "README.md", "exec"), namespace)
    assert int(namespace["state"]["step"]) == 1
    assert float(namespace["batch"]["advantages"][0]) == 3.0


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a page as mkdocs' toc extension writes them."""
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", page.read_text(), flags=re.MULTILINE):
        text = re.sub(r"[`*_]", "", heading).lower()
        out.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_file(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if page != README:
            assert file.is_relative_to(DOCS), (
                f"{page.relative_to(ROOT)}: {target} is outside docs/: the site cannot link it "
                "(name the file in `code` instead)"
            )
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.relative_to(ROOT)}: {target}: no such anchor"


def test_readme_links_every_user_guide_page():
    text = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in text or page.name == "index.md", (
            f"README.md does not link docs/{page.name}"
        )


def nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return re.findall(r"([\w/.-]+\.md)\s*$", nav, flags=re.MULTILINE)


def test_the_nav_lists_every_page_once():
    listed = nav_pages()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, "mkdocs.yml's nav and the pages under docs/ differ"


def test_the_api_reference_covers_the_public_packages():
    rendered = [
        name
        for page in sorted((DOCS / "reference").rglob("*.md"))
        for name in re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(), flags=re.MULTILINE)
    ]
    assert not set(REFERENCE) - set(rendered), "packages missing from docs/reference/"
    missing = [name for name in rendered if importlib.util.find_spec(name) is None]
    assert not missing, f"docs/reference/ names modules that do not exist: {missing}"


def test_the_layers_table_is_the_layer_order():
    from test_layers import LAYERS, MODEL_PACKAGES, SHARED_PACKAGES

    text = (DOCS / "architecture.md").read_text()
    section = text[text.index("## Layers") : text.index("\n## ", text.index("## Layers") + 1)]
    rows = re.findall(r"^\| \d+ \| (\w+) \|", section, flags=re.MULTILINE)
    assert rows == [name for name, _ in LAYERS], "docs/architecture.md, Layers: the table's layers"
    models = re.findall(r"^\| `(\w+)/` \|", section, flags=re.MULTILINE)
    assert models[: len(MODEL_PACKAGES)] == list(MODEL_PACKAGES)
    assert models[len(MODEL_PACKAGES) :][: len(SHARED_PACKAGES)] == list(SHARED_PACKAGES)


def test_the_readme_is_short_and_timeless():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"`[0-9a-f]{7,40}`", text), "a commit hash in README.md"
    assert not re.search(r"\bissue \d+", text, flags=re.IGNORECASE), "an issue number in README.md"
    assert os.path.getsize(README) > 0
