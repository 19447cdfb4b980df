"""Shared test fixtures: the location of ../shared (real models) and stories260K engines of one
size (``STORIES_ENGINE``), so tests share their compiled steps."""

import json
import os
from pathlib import Path

import pytest

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"

# The suite compiles with LLVM's optimization level 0 (XLA's backend level; the HLO and XLA's
# own passes are the same): the suite is compile-bound (a cold speculative test spends ~40 of its
# 47 s compiling), and level 0 compiles ~30 % faster. Set before jax is imported, so this process
# and its subprocess tests use it; XLA_FLAGS naming a level of its own wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
# The engine sizes of the ``stories_llm`` fixture (the model's 512-token context, 32 sequences):
# an LLM of stories260K built with them (and the same attention), or a ``jaxinfer generate`` run
# given STORIES_CLI_FLAGS, reuses every step shape that another test of this process compiled with
# them (jax's jit cache is per process and keyed by shapes; the KV pool's page count is one).
STORIES_ENGINE = dict(max_num_seqs=32)
STORIES_CLI_FLAGS = ["--max-num-seqs", "32", "--no-progress"]


def pytest_configure(config):
    """The suite's outside references live in ../shared: without them the run fails (it must
    not pass by skipping every reference test)."""
    if not (STORIES / "greedy_reference.json").is_file():
        raise pytest.UsageError(
            f"{STORIES} not found: the tests need the shared models (set JAXINFER_SHARED to the "
            "shared/ folder)"
        )
    # With $JAXINFER_CACHE_DIR set (CI sets a fresh one for the run), every test process uses
    # JAX's persistent compilation cache from its first compilation, not only after its first
    # LLM(compilation_cache=True): step shapes one xdist worker compiled are read back by the
    # other and by the subprocess tests (which already use it) instead of compiled again.
    # (Tests that count compilations count lowerings or jit cache entries, which a persistent
    # cache hit does not skip.)
    if os.environ.get("JAXINFER_CACHE_DIR"):
        from jaxinfer.llm import enable_compilation_cache

        enable_compilation_cache()


def _memory_map_count() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(scope="module", autouse=True)
def bounded_compiled_code():
    """After each module: when this process's memory maps pass half of the kernel's limit, drop
    jax's in-memory caches of compiled programs.

    XLA:CPU maps each compiled program's code and data into memory, and jax's jit caches keep
    every program a process compiled (the engine's jitted step is one per process, so programs
    outlive their LLM: see docs/architecture.md). A test process builds hundreds of engines; at
    CI's stop 44 and in a local run an xdist worker passed ``vm.max_map_count`` (65,530) after
    ~15 minutes and died of a segfault inside XLA (the later map failed). Clearing only when
    the count is high keeps the sharing of compiled steps between modules (``STORIES_ENGINE``)."""
    yield
    n = _memory_map_count()
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except OSError:
        return
    if n is not None and n > limit // 2:
        import gc

        import jax

        gc.collect()
        jax.clear_caches()


def peak_alloc_bytes(fn) -> int:
    """Peak bytes allocated (Python and numpy, by tracemalloc) while ``fn()`` runs."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def engine_config(cfg, dtype="float32", mesh=None, **options):
    """The ``EngineConfig`` ``LLM`` gives an engine of model config ``cfg`` with weights of
    ``dtype`` for ``LLM`` options ``options`` (``jaxinfer.engine.config.resolve``: this backend's
    defaults, every check)."""
    from jaxinfer.args import EngineArgs
    from jaxinfer.engine.config import resolve

    return resolve(EngineArgs("<in memory>", **options), cfg, dtype, mesh=mesh)


def stories_reference() -> list[dict]:
    return json.loads((STORIES / "greedy_reference.json").read_text())


def assert_reproduces_stories_reference(llm) -> None:
    """``llm`` (stories260K) generates every llama2.c greedy reference text exactly: each prompt
    to the reference's step count, stopping at BOS (id 1) as llama2.c's run.c does."""
    from jaxinfer.sampling.params import SamplingParams

    cases = stories_reference()
    ids = [llm.tokenizer.encode(c["prompt"]) for c in cases]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=c["max_steps"] - (len(i) - 1), stop_token_ids=(1,)
        )
        for c, i in zip(cases, ids, strict=True)
    ]
    for c, i, o in zip(cases, ids, llm.generate(ids, params), strict=True):
        assert llm.tokenizer.decode(i + o.token_ids) == c["expected"], c["prompt"]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not STORIES.is_dir():
        pytest.fail(f"{STORIES} not found (set JAXINFER_SHARED to the shared/ folder)")
    return STORIES


@pytest.fixture(scope="session")
def stories_llm(stories_dir):
    from jaxinfer.llm import LLM

    return LLM(stories_dir, **STORIES_ENGINE, compilation_cache=False)


@pytest.fixture(scope="session")
def stories_llm_xla(stories_dir):
    """``stories_llm`` with the XLA attention (no native CPU decode kernel)."""
    from jaxinfer.llm import LLM

    return LLM(stories_dir, **STORIES_ENGINE, attn_impl="xla", compilation_cache=False)
