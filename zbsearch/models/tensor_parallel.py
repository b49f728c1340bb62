"""Tensor-parallel plans for the stages of zbsearch's models: the built-in GPT and Llama, and
Hugging Face decoders.

A plan maps the module paths of one stage to torch's parallel styles, for
``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D device mesh over the ranks
that share the stage (its tensor-parallel group). The split is Megatron's: in attention the q, k
and v projections are split by output columns (each rank computes its share of the heads) and
the output projection by input rows; in the MLP the first projections by columns, the last by
rows. A layer's forward then all-reduces once after attention and once after the MLP, and its
backward once where the input gradient leaves the column-split projections. The token
embedding is split by vocabulary rows, the LM head by vocabulary columns with its logits
gathered; norms and position tables stay whole on every rank. Stage boundaries stay plain
tensors, the same on every rank of the group, so each rank sends its activations to its peer
of the next stage as without tensor parallelism.

``sequence_parallel=True`` (the built-in GPT) also splits the norms' and residuals' work along
the sequence: boundaries carry each rank's slice of the sequence (``(batch, seq / tp,
hidden)``), attention and MLP gather it before their column-split projections and reduce-scatter
after their row-split ones. The built-in Llama and the Hugging Face stages take the whole
sequence at every boundary: their layers build rotary tables and masks from their input's
length.

The Hugging Face plan is the model's own (``config.base_model_tp_plan`` for the decoder layers,
the model class's ``_tp_plan`` for the LM head), with its styles mapped to torch's; a family
whose plan names a style zbsearch does not map is refused in one line. A tied LM head stays
whole (its gradient is summed with the embedding's across stages).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import ZbError
from .gpt import Attention, Block, Embedding, Head
from .llama import LlamaBlock, TokenEmbedding, _Head

__all__ = ["FusedColwiseParallel", "tp_plan", "parallelize_stage", "fully_shard_layout", "full_tensor"]


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a Linear whose output is ``parts`` projections side by side (a
    fused q, k, v): each rank takes its share of the columns of each part, so its output is its
    q, its k and its v side by side. The weight and bias are DTensors whose full tensors are the
    unsplit ones (placement ``_StridedShard(0, split_factor=parts)``); the output is the rank's
    local share (``use_local_output``)."""

    def __init__(self, parts: int, *, input_layouts=None) -> None:
        super().__init__(input_layouts=input_layouts)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            split = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(split, requires_grad=param.requires_grad))
        module._zb_fused_parts = self.parts  # for fully_shard_layout

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # each rank's q, k, v columns, as they are

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ZbError(f"FusedColwiseParallel splits an nn.Linear, not a {type(module).__name__}")
        return super()._apply(module, device_mesh)


def _seq_in() -> PrepareModuleInput:
    """A module taking the sequence slices: gathered into the whole sequence (a DTensor)."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _gpt(path: str, m: nn.Module, sp: bool) -> dict[str, ParallelStyle] | None:
    if isinstance(m, Embedding):
        plan: dict[str, ParallelStyle] = {f"{path}tok": RowwiseParallel(input_layouts=Replicate())}
        if sp:  # token and position embeddings added whole, then each rank keeps its slice
            plan[path.rstrip(".")] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        return plan
    if isinstance(m, Block):
        out = Shard(1) if sp else None  # the row-split projections reduce-scatter into slices, or all-reduce
        plan = {f"{path}attn.qkv": FusedColwiseParallel(3), f"{path}attn.proj": RowwiseParallel(output_layouts=out),
                f"{path}mlp.0": ColwiseParallel(), f"{path}mlp.2": RowwiseParallel(output_layouts=out)}
        if sp:
            plan.update({f"{path}ln1": SequenceParallel(), f"{path}attn": _seq_in(),
                         f"{path}ln2": SequenceParallel(), f"{path}mlp": _seq_in()})
        return plan
    if isinstance(m, Head):
        if sp:
            return {f"{path}ln": SequenceParallel(),
                    f"{path}out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        return {f"{path}out": ColwiseParallel(output_layouts=Replicate())}
    return None


def _llama(path: str, m: nn.Module) -> dict[str, ParallelStyle] | None:
    if isinstance(m, LlamaBlock):
        return {f"{path}{n}": ColwiseParallel() for n in ("q", "k", "v", "mlp.gate", "mlp.up")} | {
            f"{path}o": RowwiseParallel(), f"{path}mlp.down": RowwiseParallel()}
    if isinstance(m, _Head):
        return {f"{path}out": ColwiseParallel(output_layouts=Replicate())}
    if isinstance(m, TokenEmbedding):
        return {path.rstrip("."): RowwiseParallel(input_layouts=Replicate())}
    return None


def _walk(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield f"{path}{name}.", child
        yield from _walk(child, f"{path}{name}.")


def _builtin(stage: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    covered: list[str] = []
    for path, m in _walk(stage):
        if any(path.startswith(c) for c in covered):
            continue
        part = _gpt(path, m, sp)
        if part is None:
            part = _llama(path, m)
            if part is not None and sp:
                raise ZbError("tensor parallelism: the built-in Llama takes no sequence parallelism (its layers build "
                              "their rotary tables from their input's length); leave sequence_parallel off")
        if part is not None:
            plan.update(part)
            covered.append(path)
    return plan


# Hugging Face's names of its tensor-parallel styles -> torch's (``transformers``' own plans)
_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def _hf_model(stage: nn.Module) -> nn.Module | None:
    """The Hugging Face model ``stage`` cuts, if it is an ``hf_stages`` stage."""
    if "transformers" not in sys.modules:  # no Hugging Face stage can exist
        return None
    from .hf.stages import HFStage

    return stage.hf_model if isinstance(stage, HFStage) else None


def _hf(stage: nn.Module) -> dict[str, ParallelStyle] | None:
    model = _hf_model(stage)
    if model is None:
        return None
    config = model.config
    kind = getattr(config, "model_type", type(config).__name__)
    entries = dict(getattr(config, "base_model_tp_plan", None) or {})
    layers = {k: v for k, v in entries.items() if k.startswith("layers.*.")}
    if not layers:
        raise ZbError(f"tensor parallelism: the Hugging Face model {kind!r} declares no plan for its layers "
                      "(config.base_model_tp_plan); write one for parallelize_module")
    plan: dict[str, ParallelStyle] = {}
    head = getattr(stage, "lm_head", None)
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    tied = embedding is not None and isinstance(head, nn.Linear) and head.weight is getattr(embedding, "weight", None)
    if isinstance(head, nn.Linear) and not tied:  # a tied head stays whole: its gradient is summed with the embedding's
        layers |= {k: v for k, v in (getattr(type(model), "_tp_plan", None) or {}).items() if k == "lm_head"}
    for key, style in layers.items():
        make = _HF_STYLES.get(style)
        if make is None:
            raise ZbError(f"tensor parallelism: {kind!r} plans {key!r} as {style!r}, which zbsearch does not map to "
                          f"torch's styles (it maps {', '.join(_HF_STYLES)}); write a plan for parallelize_module")
        plan[key] = make()
    return plan


def tp_plan(stage: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one stage (module path -> parallel style), for torch's
    ``parallelize_module``: a stage of ``gpt_stages``, ``llama_stages`` or ``hf_stages``
    (module docstring). ``sequence_parallel``: the built-in GPT's sequence-parallel plan. A
    stage of another model is refused in one line (ZbError)."""
    plan = _hf(stage)
    if plan is not None:
        if sequence_parallel:
            raise ZbError("tensor parallelism: Hugging Face stages take no sequence parallelism (each stage builds its "
                          "masks and rotary tables from its input's length); leave sequence_parallel off")
        return plan
    plan = _builtin(stage, sequence_parallel)
    if not plan:
        raise ZbError(f"tensor parallelism: no plan for a stage of type {type(stage).__name__} (zbsearch has plans for "
                      "its built-in GPT and Llama and for Hugging Face decoders); write one for parallelize_module")
    return plan


def _heads(stage: nn.Module) -> dict[str, int]:
    """What must split evenly across the ranks besides the split Linears: attention heads."""
    out: dict[str, int] = {}
    for name, m in stage.named_modules():
        if isinstance(m, (Attention, LlamaBlock)):
            out[f"{name}: attention heads"] = m.heads
    model = _hf_model(stage)
    if model is not None:
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(model.config, key, None)
            if isinstance(value, int):
                out[key] = value
    return out


def _split_size(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """The dimension a style splits on a module, and its size (None: nothing split)."""
    if isinstance(module, nn.Linear) and isinstance(style, FusedColwiseParallel):
        return "output features per part", module.out_features // style.parts
    if isinstance(module, nn.Linear) and isinstance(style, ColwiseParallel):
        return "output features", module.out_features
    if isinstance(module, nn.Linear) and isinstance(style, RowwiseParallel):
        return "input features", module.in_features
    if isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
        return "vocabulary rows", module.num_embeddings
    return None


def parallelize_stage(stage: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Split ``stage`` across the ranks of ``tp_mesh`` (a 1-D device mesh over the ranks that
    share the stage) with its plan (``tp_plan``); returns the stage, parallelized in place.

    Every rank of the mesh must call it on the same stage, built alike (same seed or
    checkpoint): each keeps its shares of the whole weights. Heads, split widths and the
    vocabulary must be multiples of the mesh's size (ZbError otherwise)."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ZbError(f"tensor parallelism: tp_mesh must be a 1-D DeviceMesh over the ranks that share the stage, not "
                      f"{tp_mesh!r} (slice a named mesh: mesh['tp'])")
    plan = tp_plan(stage, sequence_parallel=sequence_parallel)
    size = tp_mesh.size()
    need = _heads(stage)
    for key, style in plan.items():
        for name, module in stage.named_modules():
            if _matches(name, key):
                split = _split_size(module, style)
                if split is not None:
                    need[f"{name}: {split[0]}"] = split[1]
    bad = [f"{what} ({n})" for what, n in need.items() if n % size]
    if bad:
        raise ZbError(f"tensor parallelism over {size} ranks: {bad[0]} is not a multiple of {size}"
                      + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return parallelize_module(stage, tp_mesh, plan)


def _matches(name: str, key: str) -> bool:
    """Whether a module path matches a plan key (``*`` stands for one path segment)."""
    a, b = name.split("."), key.split(".")
    return len(a) == len(b) and all(y == "*" or x == y for x, y in zip(a, b))


# -- fused projections under fully_shard ------------------------------------------------------------
def fully_shard_layout(stage: nn.Module) -> nn.Module:
    """Lay the fused projections of a stage parallelized by ``parallelize_stage`` out so that
    ``fully_shard`` composes with them; returns the stage, changed in place. Call it after
    ``parallelize_stage`` and before ``fully_shard`` (``zbsearch.models.sharding.shard_stage``
    does).

    A fused projection's parameters are split with ``_StridedShard(0, split_factor=parts)``
    (each rank's q, k and v rows); ``fully_shard`` shards each rank's share again, and torch
    cannot describe that nested layout: the full tensors it assembles from it (``full_tensor()``,
    checkpoints) have their rows mixed up. Here each such parameter becomes ``Shard(0)`` of its
    rows reordered rank by rank (rank 0's q, k, v, then rank 1's, ...): every rank keeps the same
    local rows, so the forward and the gradients are unchanged, and FSDP's layout on top is one
    torch handles. The parameter's own ``full_tensor()`` is then in that order; the module's
    ``state_dict`` gives, and ``load_state_dict`` takes, the unparallelized model's order (the
    saved tensors are split over the tensor dimension only)."""
    for module in stage.modules():
        parts = getattr(module, "_zb_fused_parts", None)
        if parts is None or getattr(module, "_zb_blocked", False):
            continue
        for pname, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor) or param.placements != (_StridedShard(0, split_factor=parts),):
                layout = getattr(param, "placements", "a plain tensor")
                raise ZbError(f"fully_shard_layout: {type(module).__name__}.{pname} is laid out as {layout}, not as "
                              f"FusedColwiseParallel({parts}) splits it; call it before fully_shard")
            blocked = DTensor.from_local(param.to_local(), param.device_mesh, (Shard(0),), run_check=False,
                                         shape=param.shape, stride=param.stride())
            module.register_parameter(pname, nn.Parameter(blocked, requires_grad=param.requires_grad))
        module.register_state_dict_post_hook(_save_unblocked)
        module._register_load_state_dict_pre_hook(_load_blocked, with_module=True)
        module._zb_blocked = True  # type: ignore[assignment]
    return stage


def full_tensor(stage: nn.Module, name: str, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Parameter ``name`` of ``stage`` (or ``tensor``: its gradient, its optimizer state) as
    the unparallelized model holds it: a DTensor gathered whole, a fused projection's rows laid
    out by ``fully_shard_layout`` put back in order; a plain tensor as it is. Every rank of the
    parameter's mesh calls it (it gathers)."""
    t = stage.get_parameter(name) if tensor is None else tensor
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    module = stage.get_submodule(name.rpartition(".")[0])
    if not getattr(module, "_zb_blocked", False):
        return whole
    mesh = cast(DTensor, stage.get_parameter(name)).device_mesh
    order = _order(whole.shape[0], _parts(module), mesh.size(mesh.ndim - 1))
    return whole[torch.argsort(order).to(whole.device)]


def _parts(module: nn.Module) -> int:
    """How many projections a module split by ``FusedColwiseParallel`` fuses."""
    return int(module.__dict__["_zb_fused_parts"])


def _order(rows: int, parts: int, tp: int) -> torch.Tensor:
    """Rows of a fused projection in the blocked order: for each rank, its share of each part."""
    per = rows // parts
    return torch.arange(rows).view(parts, tp, per // tp).transpose(0, 1).reshape(-1)


def _save_unblocked(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """The fused parameters in the unparallelized order: the tensor dimension (the mesh's last)
    as ``FusedColwiseParallel`` splits it, gathered over the data-parallel dimensions."""
    parts = _parts(module)
    for pname, _ in module.named_parameters(recurse=False):
        value = state.get(prefix + pname)
        if not isinstance(value, DTensor):
            continue
        mesh, whole = value.device_mesh, [Replicate()] * (value.device_mesh.ndim - 1)
        local = value.redistribute(mesh, [*whole, Shard(0)]).to_local()
        state[prefix + pname] = DTensor.from_local(local, mesh, [*whole, _StridedShard(0, split_factor=parts)],
                                                   run_check=False, shape=value.shape, stride=value.stride())


def _load_blocked(module: nn.Module, state: dict, prefix: str, local_metadata, strict, missing, unexpected, errors) -> None:
    """The fused parameters of a state dict in the unparallelized order (whole tensors, or
    DTensors of any layout) laid out as the module's parameters (blocked)."""
    parts = _parts(module)
    for pname, param in module.named_parameters(recurse=False):
        value = state.get(prefix + pname)
        if value is None or not isinstance(param, DTensor) or tuple(value.shape) != tuple(param.shape):
            continue  # missing or mis-shaped: nn.Module's load reports it
        mesh, n = param.device_mesh, param.device_mesh.ndim
        tp, rank = mesh.size(n - 1), mesh.get_local_rank(n - 1)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        mine = full.detach()[_order(full.shape[0], parts, tp).view(tp, -1)[rank].to(full.device)]
        blocked = DTensor.from_local(mine.to(param.dtype), mesh, [Replicate()] * (n - 1) + [Shard(0)], run_check=False,
                                     shape=param.shape, stride=param.stride())
        state[prefix + pname] = blocked.redistribute(mesh, param.placements)
