"""Model configuration: one frozen dataclass whose fields cover every supported family.

Family differences (Llama, Mistral, Qwen2/3, Gemma 1/2/3, llama2.c) are expressed as fields,
never as subclasses. The config is hashable and passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.models.checks import check_bool, check_float, check_int
from jaxinfer.models.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes:
        model_type: family name as in Hugging Face ``config.json`` (``"llama"``, ``"gemma2"``, ...),
            ``"llama2c"`` for llama2.c checkpoints. Informational only: behaviour comes from the
            fields below.
        vocab_size: V, tokens.
        hidden_size: D.
        intermediate_size: F, MLP width.
        num_layers: L.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (K == N: MHA; K == 1: MQA; otherwise GQA).
        head_dim: H.
        max_position_embeddings: longest context the model was trained for, tokens.
        rms_norm_eps: epsilon of every RMSNorm.
        norm_weight_offset: 0.0 (``x * w``, Llama) or 1.0 (``x * (1 + w)``, Gemma).
        hidden_act: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
        rope_theta: RoPE base of global-attention layers.
        rope_scaling: scaling of the global layers' RoPE, or None.
        rope_local_theta: RoPE base of sliding-window layers when it differs (Gemma 3), else None.
        attention_bias: q/k/v projections carry a bias (Qwen2, gpt-oss).
        attention_out_bias: the output projection (o_proj) carries a bias
            (``LayerParams.bo``, gpt-oss).
        attention_sinks: each layer has a learned logit per query head (``LayerParams.sinks``
            f32[L, N]) that joins the softmax's denominator and takes no value (gpt-oss;
            transformers' ``eager_attention_forward`` of modeling_gpt_oss; Xiao et al. 2023).
        qk_norm: RMSNorm over H applied to q and k before RoPE (Qwen3, Gemma 3).
        post_norms: Gemma 2/3 "sandwich" norms after attention and after the MLP.
        embed_scale: multiply embeddings by sqrt(D) (Gemma).
        query_pre_attn_scalar: attention scale is ``query_pre_attn_scalar ** -0.5`` when set (Gemma
            2/3), else ``head_dim ** -0.5``.
        attn_logit_softcap: ``cap * tanh(scores / cap)`` on attention scores (Gemma 2), or None.
        final_logit_softcap: the same on the output logits (Gemma 2), or None.
        layer_windows: per-layer sliding window in tokens (query at position i sees keys j with
            ``i - j < window``); 0 means global attention. Length L.
        tie_word_embeddings: LM head is the embedding matrix transposed.
        qk_norm_flat: the q/k RMSNorm runs over the whole projection (N*H for q, K*H for k, its
            weights [N*H] and [K*H]) instead of each head's H (OLMoE); needs ``qk_norm``.
        num_experts: E, routed experts of a sparse (mixture-of-experts) MLP; 0 for a dense model.
        num_experts_per_tok: A (top-k), experts each token is routed to (0 when dense).
        moe_intermediate_size: I, the MLP width of one expert (0 when dense).
        norm_topk_prob: the top-k routing weights are divided by their sum (Mixtral always;
            Qwen-MoE and OLMoE as configured).
        router_order: ``"softmax_topk"`` (softmax over all E router logits, then the top-k of
            the probabilities: Mixtral, Qwen2/3-MoE, OLMoE) or ``"topk_softmax"`` (top-k of the
            logits, then a softmax over the k chosen: gpt-oss).
        router_bias: the router adds a bias [E] to its logits (gpt-oss).
        shared_expert_intermediate_size: U, width of the shared expert every token of a sparse
            layer also runs (Qwen2-MoE), 0 for none.
        shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x . w)`` with a
            learned ``w`` [D] (Qwen2-MoE); needs a shared expert.
        sparse_layers: per layer, whether its MLP is the mixture of experts (True) or the dense
            MLP of width F (False). Length L; empty means every layer sparse when
            ``num_experts`` > 0, else every layer dense (a dense model's always follows L).
        expert_bias: the experts' gate_up and down projections carry biases
            (``LayerParams.expert_gate_up_bias`` [L, E, 2I], ``expert_down_bias`` [L, E, D];
            gpt-oss).
        expert_glu: the experts' gated activation of (gate, up): ``"silu"`` (``silu(gate) *
            up``) or ``"gpt_oss_clamped"`` (``(clamp(up, -limit, limit) + 1) * g *
            sigmoid(alpha * g)`` with ``g = min(gate, limit)``; transformers'
            ``GptOssExperts._apply_gate``).
        swiglu_limit: the clamp ``limit`` of ``"gpt_oss_clamped"`` (gpt-oss: 7.0).
        swiglu_alpha: the sigmoid gain ``alpha`` of ``"gpt_oss_clamped"`` (gpt-oss: 1.702).
        expert_split: how the routed experts are split over the "model" mesh axis
            (``models.expert_sharding``): ``"none"`` (one device, or a dense model),
            ``"experts"`` (expert parallel: E / tp whole experts a device) or ``"width"`` (each
            expert's width I split, as a dense MLP's). Set by the sharding plan, not the
            checkpoint.

    Raises:
        ValueError: a field of the wrong type or out of range: sizes are integers (not bools) in
            [1, 2**31 - 1], ``rms_norm_eps`` finite and >= 0, ``rope_theta``, the softcaps and
            ``query_pre_attn_scalar`` finite and > 0, flags bools, windows integers >= 0; or
            ``layer_windows`` not of length L, N not a multiple of K, odd H, an unsupported
            activation or RoPE scaling.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    norm_weight_offset: float = 0.0
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    attention_sinks: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_windows: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    qk_norm_flat: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_order: str = "softmax_topk"
    router_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    sparse_layers: tuple[bool, ...] = ()
    expert_bias: bool = False
    expert_glu: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    expert_split: str = "none"

    def __post_init__(self):
        if not isinstance(self.model_type, str):
            raise ValueError(f"model_type must be a string, got {self.model_type!r}")
        for name in _INT_FIELDS:
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        object.__setattr__(
            self, "rms_norm_eps", check_float("rms_norm_eps", self.rms_norm_eps, allow_zero=True)
        )
        object.__setattr__(
            self,
            "norm_weight_offset",
            check_float("norm_weight_offset", self.norm_weight_offset, False),
        )
        object.__setattr__(self, "rope_theta", check_float("rope_theta", self.rope_theta))
        for name in (
            "rope_local_theta",
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
        ):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_float(name, getattr(self, name)))
        for name in (
            "attention_bias",
            "attention_out_bias",
            "attention_sinks",
            "qk_norm",
            "post_norms",
            "embed_scale",
            "tie_word_embeddings",
            "qk_norm_flat",
            "norm_topk_prob",
            "router_bias",
            "shared_expert_gate",
            "expert_bias",
        ):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        if not isinstance(self.layer_windows, tuple | list):
            raise ValueError(f"layer_windows must be a tuple of ints, got {self.layer_windows!r}")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        object.__setattr__(
            self,
            "layer_windows",
            tuple(
                check_int(f"layer_windows[{i}]", w, low=0) for i, w in enumerate(self.layer_windows)
            ),
        )
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries, expected num_layers="
                f"{self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r}; supported: 'silu', 'gelu_tanh'")
        self._check_moe()
        self._check_expert_glu()

    def _check_expert_glu(self) -> None:
        """Checks the experts' bias and activation fields (gpt-oss's)."""
        for name in ("swiglu_limit", "swiglu_alpha"):
            object.__setattr__(self, name, check_float(name, getattr(self, name)))
        if self.expert_glu not in EXPERT_GLUS:
            raise ValueError(f"expert_glu={self.expert_glu!r}; supported: {EXPERT_GLUS}")
        if self.num_experts == 0 and (self.expert_bias or self.expert_glu != "silu"):
            raise ValueError("expert_bias / expert_glu are set but num_experts=0 (a dense model)")
        if self.expert_split not in EXPERT_SPLITS:
            raise ValueError(f"expert_split={self.expert_split!r}; supported: {EXPERT_SPLITS}")
        if self.expert_split != "none" and self.num_experts == 0:
            raise ValueError(f"expert_split={self.expert_split!r} but num_experts=0 (dense)")

    def _check_moe(self) -> None:
        """Checks and normalises the mixture-of-experts fields (see the class docstring)."""
        for name in _MOE_INT_FIELDS:
            object.__setattr__(self, name, check_int(name, getattr(self, name), low=0))
        e, k = self.num_experts, self.num_experts_per_tok
        if self.qk_norm_flat and not self.qk_norm:
            raise ValueError("qk_norm_flat=True needs qk_norm=True")
        if self.router_order not in ROUTER_ORDERS:
            raise ValueError(f"router_order={self.router_order!r}; supported: {ROUTER_ORDERS}")
        if not isinstance(self.sparse_layers, tuple | list):
            raise ValueError(f"sparse_layers must be a tuple of bools, got {self.sparse_layers!r}")
        sparse = tuple(self.sparse_layers) or (e > 0,) * self.num_layers
        sparse = tuple(check_bool(f"sparse_layers[{i}]", b) for i, b in enumerate(sparse))
        if e == 0 and not any(sparse):  # dense: follows num_layers (e.g. a replace of it)
            sparse = (False,) * self.num_layers
        object.__setattr__(self, "sparse_layers", sparse)
        if len(sparse) != self.num_layers:
            raise ValueError(
                f"sparse_layers has {len(sparse)} entries, expected num_layers={self.num_layers}"
            )
        if e == 0:
            if (
                any(sparse)
                or k
                or self.moe_intermediate_size
                or self.shared_expert_intermediate_size
            ):
                raise ValueError(
                    "num_experts=0 (a dense model) but sparse_layers, num_experts_per_tok, "
                    "moe_intermediate_size or shared_expert_intermediate_size is set"
                )
            return
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} with experts; supported: 'silu'")
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok={k} must be in [1, num_experts={e}]")
        if self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be >= 1 with num_experts > 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate_size > 0")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return any(self.sparse_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer's MLP is the dense one (of width F)."""
        return not all(self.sparse_layers)

    @property
    def queries_per_kv(self) -> int:
        """G = N // K."""
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """Multiplier of q.k scores."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5

    @property
    def has_local_rope(self) -> bool:
        return self.rope_local_theta is not None and any(w > 0 for w in self.layer_windows)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied); a sparse layer counts its
        experts, router and shared expert instead of the dense MLP."""
        dense = num_params(
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.tie_word_embeddings,
        )
        d, n_sparse = self.hidden_size, sum(self.sparse_layers)
        moe = (
            3 * d * self.moe_intermediate_size * self.num_experts
            + d * self.num_experts
            + 3 * d * self.shared_expert_intermediate_size
            + d * self.shared_expert_gate
            + self.num_experts * (2 * self.moe_intermediate_size + d) * self.expert_bias
            + self.num_experts * self.router_bias
        )
        return dense + n_sparse * (moe - 3 * d * self.intermediate_size)


_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


_MOE_INT_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
EXPERT_GLUS = ("silu", "gpt_oss_clamped")
EXPERT_SPLITS = ("none", "experts", "width")


def num_params(
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tied: bool,
) -> int:
    """Parameter count of the core weights (embedding counted once when tied; biases and q/k
    norms left out), in Python ints so absurd sizes do not overflow. A lower bound used to check
    sizes read from a config against the bytes of the files that should hold them."""
    d, f, n, k, h = hidden, intermediate, heads, kv_heads, head_dim
    attn = d * n * h + 2 * d * k * h + n * h * d
    per_layer = attn + 3 * d * f + 2 * d
    total = layers * per_layer + vocab * d + d
    return total if tied else total + vocab * d
