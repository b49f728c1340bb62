"""Per-layer profiles for planner tests: random units with an embedding, layers and a head."""

from __future__ import annotations

import random

from zbsearch.formats.layers import LayerProfile, LinkEstimate, TiedParams, Unit


def random_layers(seed: int, layers: int, *, head: float = 3.0, tied: bool = False, comm: float = 0.05,
                  recompute: str = "none") -> LayerProfile:
    """``layers`` decoder layers of random costs between an embedding and a head about ``head``
    times a layer's; memory in bytes (a layer keeps about 1 MB per microbatch).

    ``recompute``: ``full`` adds full recomputation's costs to every unit (a checkpointed forward
    a little cheaper than a plain one, keeping its input, a few percent of its activations; a
    recompute pass about as long as the forward), ``both`` selective recomputation too on the
    layers (keeping about half, recomputing a fifth of the forward); drawn apart, so the other
    costs are those of the same seed without."""
    rng = random.Random(seed)
    rrng = random.Random(seed + 10_000)

    def with_recompute(u: Unit) -> Unit:
        if recompute == "none":
            return u
        extra = dict(t_fc=u.t_f * rrng.uniform(0.85, 1.0), t_r=u.t_f * rrng.uniform(0.9, 1.1),
                     m_fc=0.0 if u.kind == "embedding" else u.m_f * rrng.uniform(0.03, 0.12))
        if recompute == "both" and u.kind == "layer":
            extra.update(t_fs=u.t_f * rrng.uniform(0.95, 1.0), t_rs=u.t_f * rrng.uniform(0.1, 0.3),
                         m_fs=u.m_f * rrng.uniform(0.35, 0.65))
        return u.model_copy(update=extra)

    def unit(name: str, kind: str, scale: float, mem: float, params: int, **extra) -> Unit:
        t_f = scale * rng.uniform(0.7, 1.3)
        t_b = scale * rng.uniform(0.8, 1.5)
        t_w = scale * rng.uniform(0.4, 1.0)
        m_f = mem * rng.uniform(0.8, 1.2)
        m_w = -m_f * rng.uniform(0.3, 0.9)
        return Unit(name=name, kind=kind, t_f=t_f, t_b=t_b, t_w=t_w, t_bw=(t_b + t_w) * rng.uniform(0.9, 1.0),
                    m_f=m_f, m_b=-(m_f + m_w), m_w=m_w, output_bytes=1e5, params=params, param_bytes=4.0 * params,
                    **extra)

    units = [unit("embedding", "embedding", 0.1, 0.0 + 1e3, 0 if tied else 50_000, tied=["embedding"] if tied else [])]
    units += [unit(f"layer.{i}", "layer", 1.0, 1e6, 100_000) for i in range(layers)]
    units.append(unit("head", "head", head, 2e6, 1_000 if tied else 51_000, tied=["embedding"] if tied else []))
    units = [with_recompute(u) for u in units]
    return LayerProfile(name=f"random-{seed}", units=units,
                        tied={"embedding": TiedParams(params=50_000, param_bytes=2e5)} if tied else {},
                        link=LinkEstimate(latency_ms=comm, bandwidth_gb_s=10.0), microbatch_size=1)


def on_grid(L: LayerProfile) -> LayerProfile:
    """``L`` with times on a 1/8 ms grid, memory on an 8 KiB one and links of one latency (the
    oracle's integer model needs a grid), and fused backwards as long as split ones (the oracle
    splits every backward, so no schedule may gain by fusing)."""
    units = []
    for u in L.units:
        d = {k: round(v * 8) / 8 for k, v in u.model_dump().items() if isinstance(v, float) and k.startswith("t_")}
        d.update({k: float(round(getattr(u, k) / 8192) * 8192) for k in ("m_f", "m_w", "m_fc", "m_fs")
                  if getattr(u, k) is not None})
        d.update(m_b=-(d["m_f"] + d["m_w"]), t_bw=d["t_b"] + d["t_w"], output_bytes=0.0)
        units.append(u.model_copy(update=d))
    assert L.link is not None
    return L.model_copy(update={"units": units, "link": L.link.model_copy(update={"latency_ms": 0.125})})


def moe_layers(seed: int, layers: int, share: float = 0.3, ep: int = 8, **kw) -> LayerProfile:
    """``random_layers`` of a mixture-of-experts model: each decoder layer's F and B hold
    expert-parallel all-to-all, ``share`` of their times (about; drawn per layer), measured at
    ``ep``; the embedding and the head hold none."""
    L = random_layers(seed, layers, **kw)
    rng = random.Random(seed + 20_000)
    units = [u if u.kind != "layer" else u.model_copy(update={"a_f": u.t_f * share * rng.uniform(0.8, 1.2),
                                                                "a_b": u.t_b * share * rng.uniform(0.8, 1.2)})
             for u in L.units]
    return L.model_copy(update={"units": units, "ep": ep, "name": f"moe-{seed}"})
