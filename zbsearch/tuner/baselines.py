"""What a user would run without a search: torchtitan's and Megatron-LM's defaults, as
configurations costed beside the search, the same way and at the same memory.

For every pipeline degree pp >= 2 of the ranks (the data-parallel degree the rest):

* ``torchtitan 1F1B``: one stage per rank, torchtitan's default cut (the embedding and the
  head counted as one layer each, ``zbsearch.planner.baseline_cuts``), microbatches = 2 pp,
  so the microbatch size is what the global batch then gives each of them;
* ``torchtitan interleaved``: ``Interleaved1F1B`` with two stages per rank, looping, the same
  rule cutting 2 pp stages, 2 pp microbatches;
* ``Megatron 1F1B``: Megatron-LM's layer split at each microbatch size searched: the layers
  shared out evenly, the embedding on the first stage and the head on the last, where they
  divide evenly (its default), else with the embedding and the loss counted as layers
  (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``),
  where those divide evenly; Megatron refuses other splits without a layout of your own;
* ``Megatron interleaved``: its interleaved schedule, two model chunks per rank, where the
  microbatches are a multiple of pp, as Megatron requires.

* ``DualPipeV``: where the units hold expert-parallel all-to-all (a mixture-of-experts model),
  DeepSeek's DualPipeV with its overlapped pairs, the even split cutting 2 pp pieces of a V, at
  each microbatch size searched whose microbatches are at least 2 pp, as it requires.

With an expert-parallel degree ``ep`` the expert groups lie in the data dimension, so only meshes
whose data-parallel degree ``ep`` divides are costed (as in the search).

A 1F1B baseline whose activations do not fit recomputes every microbatch fully (Megatron's
``--recompute-granularity full``, torchtitan's full activation checkpointing), where the
profile has recomputation costs; an interleaved one that does not fit is left out (no
interleaved schedule here recomputes).
"""

from __future__ import annotations

from ..formats.layers import LayerProfile
from ..planner import baseline_cuts
from .cluster import Mesh
from .space import Config, divisors

__all__ = ["baseline_configurations", "AS_NEEDED", "FAMILIES"]

AS_NEEDED = "full where needed"
FAMILIES = ("torchtitan 1F1B", "torchtitan interleaved", "Megatron 1F1B", "Megatron interleaved", "DualPipeV")


def baseline_configurations(layers: LayerProfile, ranks: int, tp: int, global_batch: int,
                            sizes: list[int], ep: int = 1) -> tuple[list[Config], list[str]]:
    """The baselines' configurations (see the module), and, in words, those that do not apply."""
    out: list[Config] = []
    left_out: list[str] = []
    layer_count = sum(u.kind == "layer" for u in layers.units)
    for pp in divisors(ranks // tp):
        if pp < 2:
            continue
        dp = ranks // (tp * pp)
        mesh = Mesh(pp, dp, tp)
        if dp % ep:
            continue  # (the search leaves the mesh out and says why)
        if layers.has_all_to_all:
            out += _dualpipe_v(layers, mesh, global_batch, sizes, left_out)
        for chunks, kind, placement in ((1, "1f1b", "one"), (2, "interleaved-1f1b", "looped")):
            rules = {b.name: b for b in baseline_cuts(layers, pp, "one" if chunks == 1 else "v")}
            family = "1F1B" if chunks == 1 else "interleaved"
            recompute = AS_NEEDED if chunks == 1 else "none"
            titan = rules.get("torchtitan")
            megatron = rules.get("even") if layer_count % (pp * chunks) == 0 else rules.get("megatron")
            name = f"torchtitan {family}"
            m = 2 * pp
            if titan is None or titan.cut is None:
                left_out.append(f"{name} at {mesh}: {titan.note if titan else 'no layers to cut'}")
            elif global_batch % (dp * m):
                left_out.append(f"{name} at {mesh}: the global batch of {global_batch} is not {dp} replicas' {m} "
                                "microbatches of whole sequences")
            else:
                out.append(Config(mesh, global_batch // (dp * m), m, placement, recompute, kind, name, titan.cut.counts))
            name = f"Megatron {family}"
            if megatron is None or megatron.cut is None:
                left_out.append(f"{name} at {mesh}: {megatron.note if megatron else 'no layers to cut'}; the "
                                f"{layer_count} layers do not divide evenly by {pp * chunks} stages either")
                continue
            for b in sizes:
                if global_batch % (dp * b):
                    continue
                m = global_batch // (dp * b)
                if chunks == 2 and m % pp:
                    left_out.append(f"{name} at {mesh}, b={b}: {m} microbatches are not a multiple of {pp}")
                    continue
                out.append(Config(mesh, b, m, placement, recompute, kind, name, megatron.cut.counts))
    return out, left_out


def _dualpipe_v(layers: LayerProfile, mesh: Mesh, global_batch: int, sizes: list[int], left_out: list[str]) -> list[Config]:
    """DualPipeV's configurations at ``mesh`` (see the module)."""
    name, pp, dp = "DualPipeV", mesh.pp, mesh.dp
    even = next((b for b in baseline_cuts(layers, pp, "v") if b.name == "even"), None)
    if even is None or even.cut is None:
        left_out.append(f"{name} at {mesh}: {even.note if even else 'no layers to cut'}")
        return []
    out = []
    for b in sizes:
        if global_batch % (dp * b):
            continue
        m = global_batch // (dp * b)
        if m < 2 * pp:
            left_out.append(f"{name} at {mesh}, b={b}: {m} microbatches, fewer than the {2 * pp} it needs")
            continue
        out.append(Config(mesh, b, m, "v", "none", "dualpipe-v", name, even.cut.counts))
    return out
