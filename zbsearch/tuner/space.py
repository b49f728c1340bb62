"""The configurations ``tune`` searches: mesh, microbatches, placement and recomputation.

With ``ranks`` accelerators and the tensor-parallel degree ``tp`` given, the pipeline degree
``pp`` runs over the divisors of ``ranks / tp`` and the data-parallel degree is what is left,
``dp = ranks / (pp x tp)``. The global batch (sequences per iteration) is fixed: each replica
takes ``global_batch / dp`` sequences, as ``m`` microbatches of ``b`` sequences, for every
microbatch size ``b`` searched that divides it. With ``pp >= 2`` the stages are placed one per
rank (``one``) or two per rank in a V (``v``, where there are at least 2 pp units), and the
schedule may recompute as each mode searched allows (``none``, ``auto``); the cut is the
planner's. With ``pp = 1`` every unit is on one stage, run microbatch after microbatch. With
the expert-parallel degree ``ep`` given (a mixture-of-experts model), each expert group is
``ep`` data-parallel peers of one pipeline rank: meshes whose ``dp`` it does not divide are
left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Mesh

__all__ = ["Config", "configurations", "divisors", "PLACEMENTS", "RECOMPUTE_MODES"]

PLACEMENTS = ("one", "v")
RECOMPUTE_MODES = ("none", "auto")


@dataclass(frozen=True)
class Config:
    """One configuration: the mesh, microbatch size ``b`` and count ``m`` per replica, the
    placement (``one``, ``v``, or ``looped`` for interleaving), what the schedule may
    recompute, and how it is scheduled: ``plan`` (cut, placement and schedule planned),
    ``single`` (one stage), or a classic kind on a fixed cut ``counts`` (the baselines), with
    ``source`` naming the baseline."""

    mesh: Mesh
    b: int
    m: int
    placement: str
    recompute: str
    method: str = "plan"
    source: str = "tune"
    counts: tuple[int, ...] | None = None

    @property
    def stages(self) -> int:
        """Stages of the configuration: pp, or 2 pp for a V or interleaving."""
        return self.mesh.pp * (1 if self.placement == "one" else 2)

    def __str__(self) -> str:
        how = self.source if self.source != "tune" else f"{self.placement}, recompute {self.recompute}"
        return f"{self.mesh}, b={self.b}, m={self.m} ({how})"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, in order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(num_units: int, ranks: int, tp: int, global_batch: int, sizes: list[int],
                   placements: tuple[str, ...] = PLACEMENTS,
                   recompute: tuple[str, ...] = RECOMPUTE_MODES, ep: int = 1) -> tuple[list[Config], list[str]]:
    """Every configuration (see the module), and, in words, the meshes and sizes left out."""
    out: list[Config] = []
    left_out: list[str] = []
    for pp in divisors(ranks // tp):
        dp = ranks // (tp * pp)
        mesh = Mesh(pp, dp, tp)
        if dp % ep:
            left_out.append(f"{mesh}: the expert-parallel degree {ep} does not divide the {dp} data-parallel ranks "
                            "its expert groups lie in")
            continue
        if pp > num_units:
            left_out.append(f"{mesh}: {num_units} units cannot fill {pp} stages")
            continue
        for b in sizes:
            if global_batch % (dp * b):
                left_out.append(f"{mesh}, b={b}: the global batch of {global_batch} is not {dp} replicas' whole "
                                f"microbatches of {b}")
                continue
            m = global_batch // (dp * b)
            if pp == 1:
                out.append(Config(mesh, b, m, "one", "none", method="single"))
                continue
            for pl in placements:
                if pl == "v" and num_units < 2 * pp:
                    continue
                out.extend(Config(mesh, b, m, pl, rc) for rc in recompute)
    return out, left_out
