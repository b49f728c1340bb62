"""A Hugging Face model's attention cores as modules of their own, for selective recomputation.

Transformers' attention modules run their projections themselves and hand the core (QK^T,
softmax, dropout, the weighted sum of V) to a function the config's ``_attn_implementation``
chooses (``ALL_ATTENTION_FUNCTIONS``; "eager": the modeling file's own
``eager_attention_forward``). ``declare_cores`` gives each attention module of the layers a
``core_attention`` submodule that calls that same function, declared for selective
recomputation in the mode ``"attention"`` (``zbsearch.runtime.selective``), and routes the
attention module's call through it: the attention module gets its own copy of the config,
naming the routing implementation registered here, so the model's masks and every other module
go on as before and the numbers are the model's own. What there is to drop depends on the
implementation: eager saves the attention probabilities for the backward (heads x seq x seq
per sequence), which RS rebuilds; a fused one (sdpa) saves little besides its inputs.

The routed call returns no attention weights, as sdpa does: they are the probabilities the
backward needs, and handing them out would keep them alive. The attention module's config is
copied when it is declared: later changes to the model's config do not reach it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any, cast

from torch import nn

from ...errors import ZbError

__all__ = ["HFCoreAttention", "declare_cores", "ROUTE"]

ROUTE = "zbsearch_core_attention"  # the implementation name the declared attention modules' configs carry


class HFCoreAttention(nn.Module):
    """The core of one attention module: its implementation's function, called as the module
    would call it (the attention module passed first), the attention output only."""

    selective_recompute = "attention"

    def __init__(self, owner: nn.Module, implementation: str) -> None:
        super().__init__()
        self.__dict__["_zb_owner"] = owner  # not registered: the attention module holds this one
        self.implementation = implementation

    def forward(self, query, key, value, attention_mask, **kwargs):
        """The implementation's attention output for these projections."""
        owner = self.__dict__["_zb_owner"]
        default = sys.modules[type(owner).__module__].eager_attention_forward
        fn = _functions().get_interface(self.implementation, default)
        out, _ = fn(owner, query, key, value, attention_mask, **kwargs)
        return out

    def extra_repr(self) -> str:
        return f"implementation={self.implementation!r}"


def _route(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered implementation ``ROUTE``: the attention module's declared core, no weights."""
    core = cast(HFCoreAttention, module.core_attention)
    return core(query, key, value, attention_mask, **kwargs), None


def _functions():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as interface

    if ROUTE not in interface:
        interface.register(ROUTE, _route)
    return interface


def _routable(m: nn.Module) -> bool:
    """An attention module that calls transformers' attention functions with its config's
    implementation (one whose modeling file has the eager function every such module falls back on)."""
    config = getattr(m, "config", None)
    return (type(m).__name__.endswith("Attention") and isinstance(getattr(config, "_attn_implementation", None), str)
            and hasattr(sys.modules.get(type(m).__module__), "eager_attention_forward"))


def declare_cores(layers: Sequence[nn.Module]) -> list[HFCoreAttention]:
    """Give every attention module of ``layers`` its core (module docstring); the cores, in
    order. A layer without such an attention module is refused in one line. Declaring twice
    changes nothing."""
    _functions()
    cores = []
    for i, layer in enumerate(layers):
        found = [m for m in layer.modules() if isinstance(getattr(m, "core_attention", None), HFCoreAttention) or _routable(m)]
        if not found:
            raise ZbError(f"selective recomputation of the attention: layer {i} ({type(layer).__name__}) has no attention "
                          f"module that calls transformers' attention functions (declare the modules to recompute with "
                          f"selective_recompute, or use --selective mlp)")
        for attn in found:
            core = getattr(attn, "core_attention", None)
            if not isinstance(core, HFCoreAttention):
                config: Any = copy.copy(attn.config)
                core = HFCoreAttention(attn, config._attn_implementation)
                attn.add_module("core_attention", core)
                config._attn_implementation = ROUTE
                attn.config = config
            cores.append(core)
    return cores
