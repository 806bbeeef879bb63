"""The decoder with its model state sharded by PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

``fsdp`` shards every parameter over the whole world (ZeRO-3, Rajbhandari et al., arXiv 1910.02054); ``hsdp``
shards within groups of ``shard_size`` and replicates across them, on a 2-D device mesh ``(replicate, shard)``
(the layout torchtitan builds for HSDP). One FSDP unit per decoder layer plus the root (embedding, final norm, LM
head), as in torchtitan's ``apply_fsdp``. Gradients are *summed* over the mesh, not averaged
(``set_gradient_divide_factor(1.0)`` with plain SUM collectives, which gloo supports): the trainer divides by the
step's global count of predicted tokens, so every token weighs the same (docs/design.md §1). Parameters no rank
used in a micro-batch still take part in the reduce-scatter (``set_reduce_scatter_unused_params``; torch 2.11 lacks
it, :func:`_reduce_unused_params` falls back), so every rank issues the same collectives.

Mixed precision (``bf16``): FSDP2's ``MixedPrecisionPolicy`` gathers the fp32 master weights cast to bf16 for
compute and reduces gradients in fp32; AdamW's moments stay fp32 on the shards.

No worker materialises the whole model: the decoder is built on the meta device, sharded, then only the local
shard is allocated and filled from the same generator stream as :func:`~flexorch.workers.model.init_model`
(one parameter at a time), so the parameters are the same whatever the world size.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from flexorch.config.model import ModelConfig
from flexorch.config.sharding import effective_shard_size
from flexorch.solver.model_state import shard_rows
from flexorch.workers.compile import compile_layers, wants_compile
from flexorch.workers.model import Decoder
from flexorch.workers.model_source import initial_parameters, meta_model, set_activation_checkpointing
from flexorch.workers.optim import resident_bytes

__all__ = [
    "build_mesh",
    "fill_initial",
    "forget_closed_meshes",
    "gathered_parameters",
    "local_rows",
    "resident_bytes",
    "sharded_decoder",
    "stage_sharded_decoder",
    "shard_position",
]


def build_mesh(mode: str, world_size: int, shard_size: int | None, device_type: str) -> DeviceMesh:
    """The device mesh of the world now open (a collective: every rank calls it): 1-D ``(shard,)`` for fsdp,
    2-D ``(replicate, shard)`` for hsdp with :func:`~flexorch.config.sharding.effective_shard_size`."""
    s = effective_shard_size(mode, world_size, shard_size)
    if mode == "fsdp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // s, s), mesh_dim_names=("replicate", "shard"))


def _check_own_groups(model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise unless every parameter's mesh has exactly ``mesh``'s process groups (a DTensor cache can hand back an
    equal mesh of a closed world, whose groups are gone or are other groups now: see :func:`forget_closed_meshes`)."""
    own = [id(g) for g in mesh.get_all_groups()]
    for m in {id(p.device_mesh): p.device_mesh for p in model.parameters()}.values():
        try:
            same = m is mesh or [id(g) for g in m.get_all_groups()] == own
        except RuntimeError:  # "Could not resolve the process group registered under the name ..."
            same = False
        if not same:
            raise RuntimeError(
                f"parameters were sharded on a {m!r} whose process groups are not this world's: a DTensor cache kept "
                "a mesh of a closed world (call forget_closed_meshes when a world closes)"
            )


def param_groups(state) -> list:
    """The parameter groups of one FSDP unit's state: ``_fsdp_param_groups`` (torch 2.13: a list), or the one
    ``_fsdp_param_group`` of earlier releases (torch 2.11, the lent GPU machines' image), or none."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def reshard_after_failure(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its sharded parameters after a forward or backward that an error (a
    broken world, a device out of memory) stopped mid-flight. ``FSDPModule.reshard`` alone is not enough: a group
    stopped in its forward keeps its FORWARD state, and the root (not resharded after forward) then skips the
    reshard, leaving plain unsharded parameters registered ("'Parameter' object has no attribute 'to_local'" when
    the next world took the state). torch 2.13's ``reset_iter_state`` on the root resets those states for this;
    without it (torch 2.11), each group's state is reset by hand. Local: no collective runs."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    reset = getattr(model, "reset_iter_state", None)
    if isinstance(model, FSDPModule) and reset is not None:
        try:
            reset()  # waits on in-flight work of the broken world: it has failed or is aborted, so it returns
            return
        except Exception:  # noqa: BLE001 - fall back to the states by hand
            pass
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError:  # pragma: no cover - a torch without the module: reshard as is
        TrainingState = None  # noqa: N806
    for m in units:
        for group in param_groups(m._get_fsdp_state()):
            if TrainingState is not None:
                group._training_state = TrainingState.IDLE
            group._all_gather_result = None
        m.reshard()


def forget_closed_meshes() -> None:
    """Empty DTensor's sharding-propagation caches; call it whenever a world closes, before the next mesh is built.

    The caches (a Python ``lru_cache`` and, in torch 2.13, a C++ fast-path cache) key an op's output spec on the
    input specs, and a ``DeviceMesh`` compares *equal* to any other of the same ranks, layout and dimension names
    (``DeviceMesh.__eq__``), whichever world made it and whichever rank this process held there. So after a world
    closes, ops on a new mesh of the same shape return specs naming the closed world's mesh, and with it the process
    groups of the rank this process held in that world: when the process is at another rank now, those names do not
    resolve, or name another rank's group. For example, an hsdp run of 4 workers lost worker 1, went on with
    workers 0 and 3 and grew back to 4 (worker 3 from rank 3 to rank 1); ``model.to_empty`` (an ``empty_like`` per
    DTensor parameter) gave the new (2, 2) mesh's parameters the first world's (2, 2) mesh, and reading their shard
    position failed with "Could not resolve the process group registered under the name 4".
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` clears both caches; older torch lacks it and has
    the Python cache only."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # private: looked up, not assumed
    if clear is not None:
        clear()
        return
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def sharded_decoder(
    cfg: ModelConfig, mesh: DeviceMesh, *, precision: str = "fp32", recompute: str = "none", device=None
) -> Decoder:
    """A decoder sharded on ``mesh`` with its local shards allocated (uninitialised: fill them with
    :func:`fill_initial` or a checkpoint)."""
    model = meta_model(cfg)
    set_activation_checkpointing(model, recompute)
    if wants_compile(cfg.compile, torch.device(device) if device is not None else None):
        compile_layers(model)  # before fully_shard, as TorchTitan orders it; FSDP2's hooks stay outside the graphs
    _shard_units(model, [*model.layers, model], mesh, precision, device)  # the root last: it wraps the layers
    return model


def _shard_units(model: nn.Module, units: list, mesh: DeviceMesh, precision: str, device) -> None:
    """``fully_shard`` each of ``units`` (in order) on ``mesh``, allocate ``model``'s local shards, and make every
    unit's gradient reduction a plain SUM (these setters act on one unit each, not recursively)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    kw = {"mesh": mesh, "mp_policy": mp} if mp is not None else {"mesh": mesh}
    for unit in units:
        fully_shard(unit, **kw)
    model.to_empty(device=device or "cpu")
    _check_own_groups(model, mesh)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        _reduce_unused_params(unit)


def _reduce_unused_params(unit: nn.Module) -> None:
    """Parameters of ``unit`` that got no gradient on this rank (a rank idle in a micro-batch uses no ``wk``/``wv``)
    still take part in its reduce-scatter, with zeros, so every rank issues the same collectives.

    ``FSDPModule.set_reduce_scatter_unused_params`` does it in torch 2.13; torch 2.11 lacks it (it reached PyTorch's
    main branch after the 2.11 branch cut), so there :func:`_zero_missing_grads` does the same from a forward hook."""
    if hasattr(unit, "set_reduce_scatter_unused_params"):
        unit.set_reduce_scatter_unused_params(True)
        return
    inner = [name for name, m in unit.named_modules() if name and isinstance(m, FSDPModule)]
    own = [n for n, _ in unit.named_parameters() if not any(n.startswith(f"{i}.") for i in inner)]
    # prepended: runs before FSDP's post-forward hook, while the unit's parameters are still the gathered ones
    unit.register_forward_hook(functools.partial(_zero_missing_grads, names=own), prepend=True)


def _zero_missing_grads(module: nn.Module, args, output, *, names: list[str]) -> None:
    """Forward hook (torch 2.11): when the gradient of ``module``'s output arrives in backward, before the unit's
    backward and so before FSDP's post-backward reduce-scatter, each of its gathered parameters ``names`` that has no
    gradient gets a zero one; autograd adds the real gradient into it where there is one. Forward values and the
    reduced sums are unchanged."""
    if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
        return
    params = [p for p in map(module.get_parameter, names) if p.requires_grad]

    def fill(grad: torch.Tensor) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    output.register_hook(fill)


class _Absent(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds (no parameters)."""


def stage_sharded_decoder(
    cfg: ModelConfig,
    mesh: DeviceMesh,
    first: int,
    last: int,
    *,
    is_first: bool,
    is_last: bool,
    precision: str = "fp32",
    device=None,
) -> Decoder:
    """The parts of a decoder one pipeline stage runs (layers ``[first, last)``, the embedding on the first stage,
    the final norm and LM head on the last), each an FSDP2 unit sharded over the stage's workers (``mesh``); the
    other parts are absent, so ``named_parameters`` names this stage's parameters as the whole model does. Local
    shards are allocated uninitialised (fill them with :func:`fill_initial`)."""
    if cfg.tie_embeddings:
        raise ValueError("sharded pipeline stages need untied embeddings (the first and last stage share it)")
    with torch.device("meta"):
        model = Decoder(cfg)
    for i in range(cfg.num_layers):
        if not first <= i < last:
            model.layers[i] = _Absent()
    units = [model.layers[i] for i in range(first, last)]
    if wants_compile(cfg.compile, torch.device(device) if device is not None else None):
        compile_layers(model)  # this stage's layers (the others are absent)
    if is_first:
        units.append(model.tok_embeddings)
    else:
        model.tok_embeddings = None
    if is_last:
        units += [model.norm, model.output]
    else:
        model.norm = model.output = None
    _shard_units(model, units, mesh, precision, device)
    if is_last:  # the stage calls the head's fused loss, not its forward: FSDP gathers around that method
        register_fsdp_forward_method(model.output, "loss_sum")
    return model


def shard_position(p: DTensor) -> tuple[int, int]:
    """(index, count) of the dim-0 shard ``p``'s local tensor is, on the mesh dimension that shards it."""
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"expected parameters sharded on dim 0, got {p.placements}")
            return p.device_mesh.get_local_rank(mesh_dim=dim), p.device_mesh.size(mesh_dim=dim)
    return 0, 1


def local_rows(p: DTensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the full parameter that ``p.to_local()`` holds."""
    index, count = shard_position(p)
    return shard_rows(p.shape[0], count, index)


def fill_initial(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Copy this rank's rows of every initial parameter it holds (``flexorch.workers.model_source.
    initial_parameters``: generated values drawn for the whole model in order, so they do not depend on what a rank
    holds; checkpoint weights read for this rank's rows only)."""
    params = dict(model.named_parameters())

    def rows(name):
        return local_rows(params[name]) if name in params else None

    with torch.no_grad():
        for name, value in initial_parameters(cfg, seed, cfg.param_shapes(), rows):
            params[name].to_local().copy_(value)


def gathered_parameters(model: torch.nn.Module) -> list:
    """``(name, numpy array)`` of every whole parameter, gathered from the shards (a collective)."""
    out = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out.append((name, full.detach().float().cpu().numpy().copy()))
    return out
