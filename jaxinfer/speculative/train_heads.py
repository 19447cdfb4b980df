"""Training of Medusa draft heads by self-distillation: the target's own greedy generations are
the labels (``jaxinfer train-draft-heads``; ``scripts/train_draft_heads.py``).

1. The target generates greedy continuations of random short prompts (BOS + 1-4 random tokens,
   EOS ignored) with the engine.
2. The target's final-normed hidden states h_t of every sequence are computed once (dense
   forward; the target stays frozen).
3. Head k (k = 1..K) at h_t is trained with optax (AdamW, cross-entropy) to predict token
   t + k + 1, the token the target itself produces k places after its next one.
4. Top-1 agreement of each head with the target on held-out sequences, the loss curve (PNG) and
   the heads (orbax-checkpoint) are written.

Source: Cai et al. 2024, "Medusa" (Medusa-1 heads, self-distillation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.speculative.drafters import DraftHeads, heads_logits, init_heads, save_heads


def add_parser(sub, fmt) -> None:
    """Adds the ``train-draft-heads`` subcommand to the CLI's subparsers."""
    t = sub.add_parser(
        "train-draft-heads",
        formatter_class=fmt,
        usage="%(prog)s --model PATH --out DIR [options]",
        help="train Medusa draft heads on the model's own greedy generations",
        description=__doc__.split("\n\n")[0],
    )
    t.add_argument("--model", required=True, help="target model (as for generate)")
    t.add_argument("--out", required=True, type=Path, help="output directory of the heads")
    t.add_argument("--num-heads", type=int, default=8, help="K, heads (the largest R they serve)")
    t.add_argument("--num-sequences", type=int, default=384, help="greedy generations")
    t.add_argument("--gen-tokens", type=int, default=96, help="tokens generated per sequence")
    t.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=1024, help="positions per step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    t.add_argument("--held-out", type=float, default=0.1, help="fraction of sequences held out")
    t.add_argument("--seed", type=int, default=0, help="seed of prompts, split and batches")
    t.add_argument("--plot", type=Path, default=None, help="loss-curve PNG (default: OUT/loss.png)")


def cmd_train_draft_heads(args: argparse.Namespace) -> int:
    """CLI entry: trains, saves, prints a JSON summary on stdout."""
    summary = train_draft_heads(
        args.model,
        args.out,
        num_heads=args.num_heads,
        num_sequences=args.num_sequences,
        gen_tokens=args.gen_tokens,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        held_out=args.held_out,
        seed=args.seed,
        plot=args.plot,
    )
    print(json.dumps(summary), flush=True)
    return 0


def generate_corpus(llm, num_sequences: int, gen_tokens: int, seed: int) -> list[list[int]]:
    """Greedy generations (prompt + output ids) of random short prompts."""
    from jaxinfer.sampling.sampler import SamplingParams

    rng = np.random.default_rng(seed)
    v = llm.engine.cfg.vocab_size
    bos = llm.tokenizer.encode("")[:1] if llm.tokenizer is not None else []
    prompts = [
        bos + [int(x) for x in rng.integers(3, v, size=int(rng.integers(1, 5)))]
        for _ in range(num_sequences)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=False)]


def hidden_states(params, cfg, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Final-normed hidden states f32[N, S, D] of the sequences padded to S, and i32[N, S] ids
    (-1 padding). Padding sits after each sequence, so causal attention keeps it invisible."""
    from jaxinfer.models.dense import dense_hidden

    s = max(len(x) for x in seqs)
    ids = np.full((len(seqs), s), -1, np.int32)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = x

    @jax.jit
    def run(tok):  # i32[b, S]
        return dense_hidden(params, cfg, tok).astype(jnp.float32)

    out = [
        np.asarray(run(jnp.asarray(np.maximum(ids[i : i + 32], 0))))
        for i in range(0, len(seqs), 32)
    ]
    return np.concatenate(out), ids


def head_examples(h: np.ndarray, ids: np.ndarray, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(features f32[P, D], labels i32[P, K]): positions t with all K labels ids[t + k + 1]."""
    n, s, _ = h.shape
    t_max = s - num_heads - 1
    feats = h[:, :t_max].reshape(n * t_max, -1)
    labels = np.stack([ids[:, k + 1 : k + 1 + t_max] for k in range(1, num_heads + 1)], -1)
    labels = labels.reshape(n * t_max, num_heads)
    keep = (labels >= 0).all(axis=1)
    return feats[keep], labels[keep]


def agreement(heads: DraftHeads, feats: np.ndarray, labels: np.ndarray) -> list[float]:
    """Top-1 agreement of each head with the target's tokens, f32[K] as a list."""
    pred = np.concatenate(
        [
            np.asarray(jnp.argmax(heads_logits(heads, jnp.asarray(feats[i : i + 4096])), -1))
            for i in range(0, len(feats), 4096)
        ]
    )
    return [float(x) for x in (pred == labels).mean(axis=0)]


def train_draft_heads(
    model,
    out,
    *,
    num_heads=8,
    num_sequences=384,
    gen_tokens=96,
    steps=1500,
    batch_size=1024,
    lr=3e-3,
    held_out=0.1,
    seed=0,
    plot=None,
) -> dict:
    """Trains K Medusa heads on the target's greedy generations; saves them under ``out``.

    Returns:
        A summary dict: held-out top-1 agreement per head, final losses, sizes, paths.
    """
    import optax

    from jaxinfer.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=64, max_model_len=gen_tokens + 8)
    cfg, params = llm.engine.cfg, llm.engine.params
    seqs = generate_corpus(llm, num_sequences, gen_tokens, seed)
    h, ids = hidden_states(params, cfg, seqs)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(seqs))
    n_test = max(1, int(round(held_out * len(seqs))))
    test, train = order[:n_test], order[n_test:]
    xf, yf = head_examples(h[train], ids[train], num_heads)
    xt, yt = head_examples(h[test], ids[test], num_heads)

    heads = init_heads(params, num_heads)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps, lr * 0.05)
    opt = optax.adamw(sched, weight_decay=0.0)
    state = opt.init(heads)

    def loss_fn(hd, x, y):
        logits = heads_logits(hd, x)  # [B, K, V]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(hd, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(hd, x, y)
        upd, state = opt.update(g, state, hd)
        return optax.apply_updates(hd, upd), state, loss

    eval_loss = jax.jit(loss_fn)
    agree0 = agreement(heads, xt, yt)
    losses, test_losses = [], []
    for i in range(steps):
        idx = rng.integers(0, len(xf), size=batch_size)
        heads, state, loss = train_step(heads, state, jnp.asarray(xf[idx]), jnp.asarray(yf[idx]))
        losses.append(float(loss))
        if i % 50 == 0 or i == steps - 1:
            test_losses.append(
                (i, float(eval_loss(heads, jnp.asarray(xt[:8192]), jnp.asarray(yt[:8192]))))
            )
    agree = agreement(heads, xt, yt)
    out = Path(out)
    summary = {
        "model": str(model),
        "num_heads": num_heads,
        "sequences": len(seqs),
        "train_positions": int(len(xf)),
        "held_out_positions": int(len(xt)),
        "steps": steps,
        "final_train_loss": float(np.mean(losses[-50:])),
        "final_held_out_loss": test_losses[-1][1],
        "held_out_top1_agreement": agree,
        "held_out_top1_agreement_untrained": agree0,
        "wall_s": time.perf_counter() - t0,
        "out": str(out),
    }
    save_heads(heads, out, meta={**summary, "loss": losses, "held_out_loss": test_losses})
    plot = Path(plot) if plot is not None else out / "loss.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(losses, lw=0.6, alpha=0.6, label="train (batch)")
        ax.plot(*zip(*test_losses, strict=False), "o-", ms=3, label="held out")
        ax.set_xlabel("step")
        ax.set_ylabel(f"cross-entropy, mean over {num_heads} heads")
        ax.set_title("Medusa heads self-distillation: " + Path(str(model)).name)
        ax.legend()
        fig.tight_layout()
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
        summary["plot"] = str(plot)
    except ImportError:
        summary["plot"] = None  # matplotlib is in the dev extra
    return summary
