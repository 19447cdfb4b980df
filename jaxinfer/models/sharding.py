"""Tensor and data parallelism with ``jax.sharding``: the device mesh, partitioning rules, sharded
loading, per-replica views and multi-host start-up.

Mesh: ``Mesh(devices[dp, tp], ("data", "model"))``. Tensor parallelism (Megatron-LM, Shoeybi et al.
2019) splits every layer over the "model" axis and lets XLA's SPMD partitioner insert the
collectives; data parallelism runs ``dp`` independent engine replicas, one per row of the mesh
(``replica_views``), each with its own KV pool and scheduler.

Partitioning rules (``param_specs``; ``tp`` = size of "model"):

| field | shape | split over "model" |
| --- | --- | --- |
| wq, bq | [L, D, N, H], [L, N, H] | N (query heads) |
| wk, wv, bk, bv | [L, D, K, H], [L, K, H] | K (KV heads) |
| wo | [L, N, H, D] | N |
| sinks | [L, N] | N (gpt-oss attention sinks, with their query heads) |
| bo | [L, D] | replicated (gpt-oss o_proj bias, added after the all-reduce) |
| w_gate, w_up | [L, D, F] | F |
| w_down | [L, F, D] | F |
| embed | [V, D] | D (the lookup stays local); V when D is not divisible |
| lm_head | [D, V] | V (logits are all-gathered); D when V is not divisible |
| norms, q/k norms | [L, D], [L, H], [D] | replicated |
| KV pool k/v_pages | [L, K, P, Z, H] | K (axis 1; any per-page scale array follows axis 1) |
| router, experts, shared expert | | ``expert_sharding`` (experts: E or I; shared: U) |

Rules that keep the numbers exact when a size does not divide (applied at load by ``prepare``; the
engine runs with the adjusted config ``ShardingPlan.cfg``):

- **KV head replication**: when ``K % tp != 0`` but ``tp % K == 0`` (and ``N % tp == 0``), each KV
  head is repeated ``r = tp // K`` times in wk/wv (bk/bv), so K' = tp and the pool holds K' heads.
  Query head n used KV head ``n // G``; it now uses head ``n // (G / r)``, which is copy
  ``(n // (G / r)) % r`` of the same head, so attention is unchanged bit for bit.
- **MLP width padding**: when ``F % tp != 0``, w_gate/w_up get zero columns and w_down zero rows up
  to F' = ceil(F / tp) * tp. A padded unit computes act(0) * 0 = 0 (SwiGLU and GeGLU) and adds
  nothing through its zero w_down row, so the output is exact.
- Anything else raises ``ShardingError`` naming the numbers: N not divisible by tp; K neither
  divisible by tp nor dividing it; neither D nor V divisible by tp.

Quantized weights: a weight's per-output-channel scale has the weight's shape without its
contraction axes, so it takes the weight's spec restricted to the output axes (``scale_spec``):
wq/wk/wv/w_gate/w_up scales split with their weight, wo/w_down scales (output D) are replicated.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ShardingError
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.expert_sharding import expert_field_spec, plan_experts, prepare_expert
from jaxinfer.models.params import Params, params_from_flat

AXES = ("data", "model")
KV_SPEC = P(None, "model")  # [L, K, ...]: KV heads on axis 1 (also fits [L, K, P, Z] scale arrays)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How one model is split over ``tp`` devices.

    Attributes:
        tp: tensor-parallel size (devices on the "model" axis).
        kv_repeat: r, copies of each KV head (1 = none); K' = K * r.
        ffn_size: F' >= F, MLP width after zero padding to a multiple of tp.
        embed_axis: "width" (embed split over D) or "vocab" (over V); "none" when tp == 1.
        head_axis: "vocab" (lm_head split over V) or "width" (over D); "none" when tp == 1.
        cfg: the config the engine runs with (K' KV heads, F' MLP width).
    """

    tp: int
    kv_repeat: int
    ffn_size: int
    embed_axis: str
    head_axis: str
    cfg: ModelConfig


def plan_sharding(cfg: ModelConfig, tp: int, enable_expert_parallel: bool = False) -> ShardingPlan:
    """The partitioning of ``cfg`` over ``tp`` devices (see the module docstring for the rules;
    a mixture-of-experts model's experts: ``expert_sharding.plan_experts``, expert parallel with
    ``enable_expert_parallel``, else each expert's width split).

    Raises:
        ShardingError: the heads or the embedding cannot be split over ``tp`` devices; the
            experts cannot be split as asked (``plan_experts``).
    """
    n, k, f, d, v = (
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.hidden_size,
        cfg.vocab_size,
    )
    if tp < 1:
        raise ShardingError(f"tensor_parallel_size={tp} must be >= 1")
    if n % tp:
        raise ShardingError(
            f"cannot split num_heads={n} query heads over tensor_parallel_size={tp} devices "
            f"({n} % {tp} = {n % tp}); use a tensor-parallel size that divides {n}"
        )
    if k % tp == 0:
        r = 1
    elif tp % k == 0:
        r = tp // k  # n % tp == 0 and k' = tp divides n
    else:
        raise ShardingError(
            f"cannot split num_kv_heads={k} over tensor_parallel_size={tp}: {k} is neither a "
            f"multiple nor a divisor of {tp} (KV heads are replicated only when {tp} % {k} == 0)"
        )
    ffn = -(-f // tp) * tp
    if tp == 1:
        embed_axis = head_axis = "none"
    elif d % tp == 0 or v % tp == 0:
        embed_axis = "width" if d % tp == 0 else "vocab"
        head_axis = "vocab" if v % tp == 0 else "width"
    else:
        raise ShardingError(
            f"cannot split the embedding over tensor_parallel_size={tp}: neither hidden_size={d} "
            f"nor vocab_size={v} is divisible by {tp}"
        )
    run_cfg = dataclasses.replace(cfg, num_kv_heads=k * r, intermediate_size=ffn)
    run_cfg = plan_experts(run_cfg, tp, enable_expert_parallel)
    return ShardingPlan(tp, r, ffn, embed_axis, head_axis, run_cfg)


_LAYER_SPECS = {
    "wq": P(None, None, "model", None),
    "wk": P(None, None, "model", None),
    "wv": P(None, None, "model", None),
    "wo": P(None, "model", None, None),
    "bq": P(None, "model", None),
    "bk": P(None, "model", None),
    "bv": P(None, "model", None),
    "sinks": P(None, "model"),
    "w_gate": P(None, None, "model"),
    "w_up": P(None, None, "model"),
    "w_down": P(None, "model", None),
}
# Output-channel axes of each weight (the axes its per-channel scale keeps), for ``scale_spec``.
OUTPUT_AXES = {
    "wq": (2, 3),
    "wk": (2, 3),
    "wv": (2, 3),
    "wo": (3,),
    "w_gate": (2,),
    "w_up": (2,),
    "w_down": (2,),
    "embed": (0,),
    "lm_head": (1,),
}


def field_spec(plan: ShardingPlan, field: str) -> P:
    """PartitionSpec of a ``param_shapes`` field (``"embed"``, ``"layers.wq"``, ...)."""
    if plan.tp == 1:
        return P()
    if field == "embed":
        return P(None, "model") if plan.embed_axis == "width" else P("model", None)
    if field == "lm_head":
        return P(None, "model") if plan.head_axis == "vocab" else P("model", None)
    if field.startswith("layers."):
        name = field.split(".", 1)[1]
        moe = expert_field_spec(plan.cfg, name)
        return moe if moe is not None else _LAYER_SPECS.get(name, P())
    return P()  # final_norm


def scale_spec(plan: ShardingPlan, field: str) -> P:
    """PartitionSpec of the per-output-channel scale of ``field``'s quantized weight: the weight's
    spec restricted to its output axes (contraction axes dropped). The leading L axis is kept."""
    spec = tuple(field_spec(plan, field)) + (None,) * 4
    name = field.split(".", 1)[-1]
    keep = ((0,) if field.startswith("layers.") else ()) + OUTPUT_AXES[name]
    return P(*(spec[i] for i in keep))


def qtensor_specs(plan: ShardingPlan, field: str, num_in: int) -> tuple[P, P]:
    """(values spec, scales spec) of a ``quant.QTensor`` standing for ``field``: its values are
    stored ``[*lead, *out, *in]`` (contracted axes last), so the float spec's axes are permuted
    the same way; the scales ``[*lead, *out]`` follow the output channels (``scale_spec``)."""
    name = field.split(".", 1)[-1]
    nd = {"wq": 4, "wk": 4, "wv": 4, "wo": 4, "embed": 2, "lm_head": 2}.get(name, 3)
    spec = (tuple(field_spec(plan, field)) + (None,) * nd)[:nd]  # float layout [*lead, *in, *out]
    if name == "embed":  # quantized as embed.T [D, V]: in D, out V -> values [V, D] as embed
        return P(*spec), P(spec[0])
    lead = 1 if field.startswith("layers.") else 0
    ins, outs = spec[lead : lead + num_in], spec[lead + num_in :]
    return P(*spec[:lead], *outs, *ins), P(*spec[:lead], *outs)


def shard_quantized(params: Params, plan: ShardingPlan, mesh: Mesh) -> Params:
    """Re-lays the ``QTensor`` leaves of params quantized after sharded loading onto the mesh so
    that values and scales shard consistently (``qtensor_specs``); float leaves are kept."""
    from jaxinfer.quant.tensor import QTensor

    def put(field: str, x):
        if not isinstance(x, QTensor):
            return x
        vs, ss = qtensor_specs(plan, field, x.num_in)
        return dataclasses.replace(
            x,
            values=jax.device_put(x.values, NamedSharding(mesh, vs)),
            scales=jax.device_put(x.scales, NamedSharding(mesh, ss)),
        )

    layers = {
        f.name: put(f"layers.{f.name}", getattr(params.layers, f.name))
        for f in dataclasses.fields(params.layers)
    }
    return dataclasses.replace(
        params,
        embed=put("embed", params.embed),
        lm_head=put("lm_head", params.lm_head),
        layers=dataclasses.replace(params.layers, **layers),
    )


def param_specs(plan: ShardingPlan, params: Params) -> Params:
    """A Params-shaped pytree of PartitionSpecs (None where the field is None)."""
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    flat.update(
        {
            f"layers.{f.name}": getattr(params.layers, f.name)
            for f in dataclasses.fields(params.layers)
        }
    )
    return params_from_flat({k: field_spec(plan, k) for k, x in flat.items() if x is not None})


def prepare(plan: ShardingPlan, field: str, x: np.ndarray) -> np.ndarray:
    """Applies the exactness rules to one host tensor: repeats KV heads, zero-pads the MLP width."""
    name = field.split(".", 1)[-1]
    x = prepare_expert(plan.cfg, plan.tp, name, x)
    if plan.kv_repeat > 1 and name in ("wk", "wv", "bk", "bv"):
        x = np.repeat(x, plan.kv_repeat, axis=2 if name in ("wk", "wv") else 1)
    f_axis = {"w_gate": 2, "w_up": 2, "w_down": 1}.get(name)
    if f_axis is not None and x.shape[f_axis] < plan.ffn_size:
        pad = plan.ffn_size - x.shape[f_axis]
        widths = [(0, 0)] * x.ndim
        widths[f_axis] = (0, pad)
        x = np.pad(x, widths)
    return x


# ------------------------------------------------------------------------------------ the mesh


def make_mesh(tp: int, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(dp, tp)`` mesh with axes ("data", "model") over the first ``dp * tp`` devices.

    Under several processes (multi-host), every replica (mesh row) takes ``tp / process_count``
    devices of each process, so every process takes part in every replica's step.

    Raises:
        ShardingError: fewer than ``dp * tp`` devices, or (multi-host) ``tp`` not a multiple of
            the process count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if dp < 1 or tp < 1:
        raise ShardingError(f"tensor_parallel_size={tp} and data_parallel_size={dp} must be >= 1")
    if dp * tp > len(devices):
        kinds = sorted({d.platform for d in devices})
        raise ShardingError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} = {dp * tp} devices, but only "
            f"{len(devices)} are available ({len(devices)} {'/'.join(kinds)} device(s)); "
            "to try tensor/data parallelism on CPU, start the process with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={dp * tp} (that many CPU "
            "devices)"
        )
    procs = sorted({d.process_index for d in devices})
    if len(procs) > 1:
        if tp % len(procs):
            raise ShardingError(
                f"multi-host: tensor_parallel_size={tp} must be a multiple of the {len(procs)} "
                "processes (each replica spans every host)"
            )
        per = tp // len(procs)
        local = {
            p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
            for p in procs
        }
        rows = [[d for p in procs for d in local[p][r * per : (r + 1) * per]] for r in range(dp)]
        return Mesh(np.array(rows, dtype=object), AXES)
    return Mesh(np.array(devices[: dp * tp], dtype=object).reshape(dp, tp), AXES)


def device_memory_bytes(device: jax.Device) -> int | None:
    """Memory of one device in bytes (``memory_stats()["bytes_limit"]``); None where unknown
    (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def default_parallelism(
    cfg: ModelConfig, dtype, devices: Sequence[jax.Device] | None = None
) -> tuple[int, int]:
    """(tp, dp) when none is given: all devices tensor parallel when the weights exceed 90% of one
    device's memory, else (1, 1) (one device; pass ``data_parallel_size`` for replicas)."""
    devices = list(jax.devices() if devices is None else devices)
    limit = device_memory_bytes(devices[0])
    need = cfg.num_params() * np.dtype(dtype).itemsize
    if limit is not None and need > 0.9 * limit:
        return len(devices), 1
    return 1, 1


# ------------------------------------------------------------------------------ loading


class ShardedPlacer:
    """The loaders' ``place`` hook: puts each host tensor straight onto the mesh, shard by shard.

    Called as ``place(cfg, field, x)`` with the host numpy tensor of a ``param_shapes`` field; on
    the first call it settles the sizes (defaults from ``default_parallelism``), the mesh and the
    plan. Each device receives only its shard (``jax.make_array_from_callback`` slices the host
    array); the full tensor never sits on one device. With tp = dp = 1 it is ``jax.device_put``.

    Attributes (after the first call): ``mesh`` (None for one device), ``plan``.
    """

    def __init__(
        self,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        devices: Sequence[jax.Device] | None = None,
        enable_expert_parallel: bool = False,
    ):
        self.tp, self.dp, self.devices = tensor_parallel_size, data_parallel_size, devices
        self.enable_expert_parallel = enable_expert_parallel
        self.mesh: Mesh | None = None
        self.plan: ShardingPlan | None = None

    def setup(self, cfg: ModelConfig, dtype) -> None:
        if self.plan is not None:
            return
        tp, dp = self.tp, self.dp
        if tp is None and dp is None:
            tp, dp = default_parallelism(cfg, dtype, self.devices)
        tp, dp = tp or 1, dp or 1
        self.plan = plan_sharding(cfg, tp, self.enable_expert_parallel)
        if tp * dp > 1:
            self.mesh = make_mesh(tp, dp, self.devices)

    def __call__(self, cfg: ModelConfig, field: str, x: np.ndarray) -> jax.Array:
        self.setup(cfg, x.dtype)
        if self.mesh is None:
            return jax.device_put(x)
        x = prepare(self.plan, field, x)
        sharding = NamedSharding(self.mesh, field_spec(self.plan, field))
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_params(params: Params, cfg: ModelConfig, placer: ShardedPlacer) -> Params:
    """Places already-loaded params (e.g. ``init_random``) through ``placer`` via the host."""
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    flat.update(
        {
            f"layers.{f.name}": getattr(params.layers, f.name)
            for f in dataclasses.fields(params.layers)
        }
    )
    return params_from_flat(
        {k: placer(cfg, k, np.asarray(jax.device_get(x))) for k, x in flat.items() if x is not None}
    )


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, tp)`` mesh per data-parallel replica (a row of ``mesh``)."""
    return [Mesh(mesh.devices[r : r + 1], AXES) for r in range(mesh.devices.shape[0])]


def replica_view(tree, mesh: Mesh):
    """The arrays of ``tree`` (placed over a bigger mesh, replicated over "data") seen on the
    sub-mesh ``mesh``: built from the shards already on its devices, nothing is copied."""
    devs = set(mesh.devices.flat)

    def view(x: jax.Array) -> jax.Array:
        if set(x.sharding.device_set) == devs:
            return x
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        shards = [s.data for s in x.addressable_shards if s.device in devs]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, spec), shards)

    return jax.tree.map(view, tree)


# ------------------------------------------------------------------------------ the step


def sharded_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh):
    """A zeroed KV pool created directly in shards (K heads split over "model")."""
    from jaxinfer.models.kv_cache import init_kv_cache

    make = jax.jit(
        init_kv_cache, static_argnums=(0, 1, 2, 3), out_shardings=NamedSharding(mesh, KV_SPEC)
    )
    return make(cfg, num_pages, page_size, dtype)


def step_out_shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """out_shardings of ``forward_step``: the KV pool stays split over heads, logits replicated."""
    return NamedSharding(mesh, KV_SPEC), NamedSharding(mesh, P())


# ------------------------------------------------------------------------------ multi-host


def multihost_requested(multihost: bool | None = None) -> bool:
    """Whether to run multi-host: ``multihost`` when True or False (``EngineArgs.multihost``,
    ``--multihost`` / ``--no-multihost``); None (the default) on a TPU slice of several hosts
    (``TPU_WORKER_HOSTNAMES`` lists more than one host, or ``MEGASCALE_COORDINATOR_ADDRESS`` is
    set)."""
    if multihost is not None:
        return multihost
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    many_hosts = len([h for h in hosts.split(",") if h]) > 1
    return many_hosts or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


_initialized = False


def initialize_multihost(multihost: bool | None = None) -> bool:
    """Calls ``jax.distributed.initialize()`` (once, before any other JAX call) when
    ``multihost_requested(multihost)``; the coordinator is found from the TPU environment (or
    ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID`` elsewhere). Returns
    whether this process runs multi-host."""
    global _initialized
    if _initialized or not multihost_requested(multihost):
        return _initialized
    jax.distributed.initialize()
    _initialized = True
    return True


def is_output_host() -> bool:
    """Process 0 writes the outputs; the other hosts only compute."""
    return jax.process_index() == 0


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated device array as numpy, also when it spans several processes."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


__all__ = [
    "AXES",
    "KV_SPEC",
    "ShardedPlacer",
    "ShardingError",
    "ShardingPlan",
    "default_parallelism",
    "field_spec",
    "initialize_multihost",
    "is_output_host",
    "make_mesh",
    "param_specs",
    "plan_sharding",
    "prepare",
    "qtensor_specs",
    "replica_meshes",
    "replica_view",
    "scale_spec",
    "shard_params",
    "shard_quantized",
    "sharded_kv_cache",
    "step_out_shardings",
    "to_host",
]
