"""Batch-invariant mode (issue 17): a request's raw logits are bitwise the same alone, in batches
of other sizes and compositions, with its prompt prefilled in chunks, with async scheduling on
or off and after preemption; and they are the right logits (llama2.c's greedy reference, the
cache-less dense forward).

The raw logits come from a hook on the engine's sampling call: each row is keyed by (request
seed, output index), both of which the row's ``SamplingTensors`` carry, so every request here
has its own seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import engine_config, stories_reference

from jaxinfer.args import EngineArgs
from jaxinfer.engine.config import resolve
from jaxinfer.errors import RequestError
from jaxinfer.llm import LLM
from jaxinfer.models.batch_invariant import invariant_forward_logits
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import dense_logits
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.paged_attention import AttentionMetadata
from jaxinfer.models.params import init_random
from jaxinfer.sampling.sampler import SamplingParams

FILLERS = [
    "Lily",
    "The cat sat on the mat and looked at the big red ball.",
    "Tom had a toy car.",
    "One day, a little bird flew into the garden and saw a shiny",
    "Sam and Ben",
    "There was a big tree in the park. Every day, the children played under it.",
]


def record_logits(engine) -> dict:
    """Hooks the runner's jitted sampling call (replacing any earlier hook): returns a dict that
    fills with (seed, output index) -> the raw logits row f32[V] of every sampled row (a later
    row of the same key replaces it: the last prefill chunk comes after the others)."""
    runner = engine.runner
    sample = runner.__dict__.setdefault("_unhooked_sample", runner._sample)
    seen = {}

    def hook(logits, st, *rest, **kw):  # rest: the logits controls, the grammar bitmask
        lg, seeds, steps = np.asarray(logits), np.asarray(st.seeds), np.asarray(st.steps)
        for r in range(lg.shape[0]):
            if seeds[r]:  # padding rows have seed 0
                seen[int(seeds[r]), int(steps[r])] = lg[r].copy()
        return sample(logits, st, *rest, **kw)

    runner._sample = hook
    return seen


def targets(tokenizer):
    """(prompt ids, params, llama2.c's expected text or None) of the requests followed: the two
    short greedy reference cases (cut by max_model_len), a seeded top-p row and a row with
    penalties (logits controls)."""
    out = []
    for i, case in enumerate(c for c in stories_reference() if c["prompt"]):
        sp = SamplingParams(temperature=0.0, stop_token_ids=(1,), seed=101 + i, logprobs=20)
        out.append((tokenizer.encode(case["prompt"]), sp, case["expected"]))
    out.append(
        (
            tokenizer.encode("Once upon a time, in a small town"),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=20),
            None,
        )
    )
    out.append(
        (
            tokenizer.encode("Mia liked to paint"),
            SamplingParams(
                temperature=0.7,
                repetition_penalty=1.3,
                frequency_penalty=0.2,
                seed=8,
                ignore_eos=True,
                logprobs=20,
            ),
            None,
        )
    )
    return out


def fillers(tokenizer, n: int, base_seed: int):
    return [
        (
            tokenizer.encode(FILLERS[i % len(FILLERS)]),
            SamplingParams(
                temperature=0.9 if i % 2 else 0.0,
                seed=base_seed + i,
                max_tokens=3 + 5 * i,
                ignore_eos=True,
                logprobs=20,
            ),
        )
        for i in range(n)
    ]


def run(llm, reqs):
    seen = record_logits(llm.engine)
    outs = llm.generate([ids for ids, _ in reqs], [sp for _, sp in reqs])
    return outs, seen


def assert_same(tokenizer, want, got, reqs):
    """Every target row's logits bitwise equal, and its tokens and logprobs (the sampling step's
    own reductions); the greedy rows' text is a prefix of llama2.c's."""
    (outs_a, seen_a), (outs_b, seen_b) = want, got
    by_seed = {sp.seed: o for o, (_, sp) in zip(outs_b, reqs, strict=True)}
    for (ids, sp, expected), a in zip(targets(tokenizer), outs_a, strict=True):
        b = by_seed[sp.seed]
        assert b.token_ids == a.token_ids and len(a.token_ids) > 12, sp.seed
        assert b.logprobs == a.logprobs, sp.seed  # floats compared with ==: bitwise
        for k in range(len(a.token_ids)):
            assert seen_b[sp.seed, k].tobytes() == seen_a[sp.seed, k].tobytes(), (sp.seed, k)
        if expected is not None:
            assert expected.startswith(tokenizer.decode(ids + b.token_ids))


# Sizes shared by both stories260K engines, so they share compiled steps (every request asks for
# logprobs, so the sampling steps have one variant): sequences of at most
# 32 tokens (block tables of 4 pages of 8: one width bucket); 8 pages hold 7 pages of sequences,
# so batches of several sequences are preempted and recomputed, their pages reassigned.
SIZES = dict(
    max_model_len=32, max_num_seqs=8, kv_pages=8, compilation_cache=False, batch_invariant=True
)


@pytest.fixture(scope="module")
def inv_llm(stories_dir):
    return LLM(stories_dir, **SIZES)


def test_prompt_logprobs_refused_by_a_batch_invariant_engine(inv_llm):
    """Its forward makes the last tokens' logits only: a request for prompt logprobs fails
    validation, naming why."""
    assert not inv_llm.engine.capabilities.prompt_logprobs
    with pytest.raises(RequestError, match="not supported with batch_invariant=True"):
        inv_llm.engine.validate([1, 2, 3], SamplingParams(prompt_logprobs=1))


@pytest.fixture(scope="module")
def alone(inv_llm):
    """Each target run alone: the reference every other run must match bit for bit."""
    outs, seen = [], {}
    for ids, sp, _ in targets(inv_llm.tokenizer):
        o, s = run(inv_llm, [(ids, sp)])
        outs += o
        seen.update(s)
    assert inv_llm.engine.scheduler.num_preemptions == 0
    return outs, seen


def test_batches_of_other_sizes_and_compositions(inv_llm, alone):
    tok = inv_llm.tokenizer
    tg = [(ids, sp) for ids, sp, _ in targets(tok)]
    for reqs in (
        tg,  # the four together
        tg[2:] + fillers(tok, 5, 500) + tg[1::-1],
    ):  # 9 rows: more than max_num_seqs
        assert_same(tok, alone, run(inv_llm, reqs), reqs)
    assert inv_llm.engine.scheduler.num_preemptions > 0


def test_chunked_prefill_sync_scheduling(stories_dir, alone):
    """Prompts prefilled 8 tokens a step (the token budget), no async scheduling."""
    tight = LLM(stories_dir, max_num_batched_tokens=8, async_scheduling=False, **SIZES)
    tok = tight.tokenizer
    reqs = fillers(tok, 2, 600) + [(ids, sp) for ids, sp, _ in targets(tok)]
    assert_same(tok, alone, run(tight, reqs), reqs)


def test_invariant_logits_equal_dense_forward(inv_llm, alone):
    """The mode's logits are the model's: each target's at every output index match the
    cache-less dense forward over prompt + output (float32, to 1e-5 of the scale)."""
    outs, seen = alone
    seqs = [
        ids + out.token_ids[:-1]
        for (ids, _, _), out in zip(targets(inv_llm.tokenizer), outs, strict=True)
    ]
    # One batch, right-padded: a causal model's earlier positions do not see the padding.
    padded = jnp.asarray([s + [0] * (32 - len(s)) for s in seqs], jnp.int32)
    dense = np.asarray(dense_logits(inv_llm.params, inv_llm.config, padded))
    for (ids, sp, _), out, want in zip(targets(inv_llm.tokenizer), outs, dense, strict=True):
        want = want[len(ids) - 1 : len(ids) - 1 + len(out.token_ids)]
        got = np.stack([seen[sp.seed, k] for k in range(len(out.token_ids))])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_window_softcap_random_model_chunked_among_others():
    """A tiny random Gemma-2-like model (GQA, a sliding-window layer of 5 tokens, attention and
    final soft-caps, pages of 4): the logits of every position of a 21-token sequence, one-shot
    in a step of 32 tokens, equal bitwise those of the same sequence prefilled in two chunks
    (12 + 9 tokens, on other pages) in steps of 16 and 64 tokens, with block tables of 16 and 8
    pages, behind other rows' tokens; and the dense forward's."""
    cfg = ModelConfig(
        "gemma2",
        96,
        32,
        64,
        2,
        4,
        2,
        8,
        max_position_embeddings=64,
        norm_weight_offset=1.0,
        hidden_act="gelu_tanh",
        post_norms=True,
        embed_scale=True,
        attn_logit_softcap=3.0,
        final_logit_softcap=5.0,
        layer_windows=(5, 0),
    )
    _assert_chunked_among_others_equals_one_shot(cfg)


def _assert_chunked_among_others_equals_one_shot(cfg: ModelConfig) -> None:
    """Random weights of ``cfg`` (pages of 4): the logits of every position of a 21-token
    sequence, one-shot in a step of 32 tokens, equal bitwise those of the same sequence
    prefilled in two chunks (12 + 9 tokens, on other pages) in steps of 16 and 64 tokens, with
    block tables of 16 and 8 pages, behind other rows' tokens; and the dense forward's."""
    params = init_random(cfg, jax.random.PRNGKey(0), scale=0.3)
    vocab = cfg.vocab_size
    rng = np.random.default_rng(0)
    seq, other = rng.integers(3, vocab, 21), rng.integers(3, vocab, 11)
    z = 4

    @jax.jit
    def step(kv, tokens, md, idx):
        return invariant_forward_logits(params, cfg, kv, tokens, md, idx)

    def batch(rows, t, m):
        """rows: (token ids, first position, pages) of each row -> a step of t tokens (every
        token's logits), block tables of m pages."""
        tokens, pos, slots, seq_ids = (np.zeros(t, np.int32) for _ in range(4))
        seq_ids[:] = -1
        b = len(rows)
        tables, lens, cu, at = np.zeros((b, m), np.int32), np.zeros(b, np.int32), [0], 0
        for r, (ids, start, pages) in enumerate(rows):
            n, p = len(ids), np.arange(start, start + len(ids))
            tokens[at : at + n], pos[at : at + n], seq_ids[at : at + n] = ids, p, r
            slots[at : at + n] = np.asarray(pages)[p // z] * z + p % z
            tables[r, : len(pages)], lens[r] = pages, start + n
            at += n
            cu.append(at)
        md = AttentionMetadata(
            positions=pos,
            slot_mapping=slots,
            block_tables=tables,
            kv_lens=lens,
            cu_q_lens=np.array(cu, np.int32),
            seq_ids=seq_ids,
        )
        return jnp.asarray(tokens), md, jnp.arange(t, dtype=jnp.int32)

    def fresh():
        return init_kv_cache(cfg, 24, z, jnp.float32)

    _, one = step(fresh(), *batch([(seq, 0, [5, 2, 9, 1, 7, 3])], 32, 8))
    one = np.asarray(one)[:21]
    pages = [11, 4, 16, 6, 13, 8]
    kv, first = step(fresh(), *batch([(other[:3], 0, [10]), (seq[:12], 0, pages)], 16, 16))
    _, second = step(
        kv,
        *batch(
            [(other, 0, [17, 18, 19]), (other[:7], 4, [20, 21, 22]), (seq[12:], 12, pages)], 64, 8
        ),
    )
    chunked = np.concatenate([np.asarray(first)[3:15], np.asarray(second)[18:27]])
    assert chunked.tobytes() == one.tobytes()
    want = np.asarray(dense_logits(params, cfg, jnp.asarray([seq], jnp.int32)))[0]
    np.testing.assert_allclose(one, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_refused_where_not_supported(stories_dir):
    with pytest.raises(ValueError, match="speculative"):
        LLM(stories_dir, speculative="ngram", batch_invariant=True, compilation_cache=False)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        LLM(stories_dir, batch_invariant=1, compilation_cache=False)
    cfg = ModelConfig("llama", 32, 16, 32, 1, 2, 2, 8)
    kw = dict(max_model_len=16, kv_pages=8, page_size=8, batch_invariant=True)
    with pytest.raises(ValueError, match="attn_impl='pallas_tpu_interpret'"):
        engine_config(cfg, attn_impl="pallas_tpu_interpret", **kw)  # before the params exist
    with pytest.raises(ValueError, match="--attn-impl pallas_tpu_interpret"):
        resolve(EngineArgs("m", attn_impl="pallas_tpu_interpret", **kw, origin="cli"), cfg, "f4")
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineArgs("m", batch_invariant="yes")


def test_cli_flag_reaches_llm(monkeypatch, tmp_path):
    import jaxinfer.llm
    from jaxinfer.cli.main import _load_llm, build_parser

    got = []
    monkeypatch.setattr(jaxinfer.llm.LLM, "from_engine_args", got.append)
    base = ["generate", "--model", "m", "--prompts", "p", "--out", str(tmp_path / "o")]
    for extra, want in (([], False), (["--batch-invariant"], True)):
        _load_llm(build_parser().parse_args(base + extra))
        assert got.pop().batch_invariant is want


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_random_model_chunked_among_others(family):
    """Mixture of experts (4 experts, top-2; Qwen2-MoE: a dense first layer and a gated shared
    expert): routing is per token, and each tile of tokens sorts its own (token, expert) pairs,
    so a token's expert rows meet the grouped matmul beside other tokens' rows; its numbers must
    not change with them (the grouped matmul of ``moe.grouped_matmul``'s default impl)."""
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if family == "qwen2_moe":
        extra.update(
            sparse_layers=(False, True),
            shared_expert_intermediate_size=24,
            shared_expert_gate=True,
            attention_bias=True,
        )
    else:
        extra.update(norm_topk_prob=True)
    cfg = ModelConfig(family, 96, 32, 64, 2, 4, 2, 8, max_position_embeddings=64, **extra)
    _assert_chunked_among_others_equals_one_shot(cfg)
