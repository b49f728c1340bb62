"""What the user sees: a progress bar while measuring, a summary table of the profile."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rich import box
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..formats.layers import LayerProfile
from ..formats.profile import Profile, StageSpread

__all__ = ["progress_bar", "summary_table", "mesh_summary", "layers_table"]


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator:
    """A callback ``(description, done, total)`` drawing a transient bar on ``console``; under
    torchrun only rank 0 draws (None elsewhere), so that ranks do not overwrite each other."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield None
        return
    if not console.is_terminal:  # logs, pipes: no bar (a disabled one still writes an empty line on some rich releases)
        yield lambda description, done, total: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def update(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total)

        yield update


def summary_table(profile: Profile) -> Group:
    """Per stage: the pass times (T_FF: the forward before a fused backward, T_BW that backward)
    and their spread (the widest half interquartile range of F, B and W, relative to the
    median), memory, boundary size and link time (with the host time a message costs the
    sender and the receiver, where measured); the runtime's host time per action where measured;
    then the profiler's warnings about disturbed measurements."""
    measured = profile.measured
    spread: list[StageSpread | None] = list(measured.stages) if measured and measured.stages else [None] * profile.num_stages
    sizes = measured.boundary_bytes if measured else []
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0), title=profile.name)
    for col in ("stage", "T_F\nms", "T_FF\nms", "T_B\nms", "T_W\nms", "T_BW\nms", "spread\n±", "T_B+T_W\n/ T_F", "M_B\nMiB",
                "M_W\n/ M_B", "sends\nKiB", "t_comm (+send/recv\nhost) ms"):
        t.add_column(col, justify="right")
    for s, (st, sp) in enumerate(zip(profile.stages, spread)):
        t.add_row(
            str(s), f"{st.t_f:.3g}", f"{st.fused_forward:.3g}", f"{st.t_b:.3g}", f"{st.t_w:.3g}", f"{st.fused_backward:.3g}",
            _spread(sp),
            f"{(st.t_b + st.t_w) / st.t_f:.2f}", f"{st.m_f / 2**20:.3g}", f"{-st.m_w / st.m_f:.2f}" if st.m_f else "-",
            f"{sizes[s] / 2**10:.0f}" if s < len(sizes) else "-",
            _link(profile, s),
        )
    # Below the table rather than as its caption: a long caption would squeeze the columns.
    selective = f"; selective recomputation: {profile.selective}" if profile.selective else ""
    action = f"; runtime host time per action {profile.t_action:.3g} ms" if profile.t_action else ""
    where = Text(f"{profile.device or '?'}, {profile.dtype or '?'}, {profile.mode or '?'}; "
                 f"links {profile.links.method if profile.links else '?'}{selective}{action}", style="dim")
    warnings = [Text(f"warning: {w}", style="yellow") for w in (measured.warnings if measured else [])]
    mesh = [Text(line, style="dim") for line in mesh_summary(profile)]
    return Group(t, where, *mesh, *_first_stage_w(profile, spread[0]), *warnings)


def mesh_summary(profile: Profile) -> list[str]:
    """The mesh the profile's costs hold for, and the link of each of its dimensions: the
    pipeline's messages, the replicas' gradient reductions, the tensor-parallel all-reduce."""
    made = profile.made_for
    per = f"; times and bytes are one of the {made.tp} tensor-parallel ranks'" if made.tp > 1 else ""
    lines = [f"mesh: {made.describe()}{per}"]
    crossing = [profile.comm(b) for b in range(profile.num_stages - 1)
                if profile.placement is None or profile.placement[b] != profile.placement[b + 1]]
    if crossing:
        how = profile.links.method if profile.links else "given"
        lines.append(f"  pp link: {sum(crossing) / len(crossing):.3g} ms per message on average ({how})")
    dp = profile.data_parallel
    if dp is not None and dp.replicas > 1:
        what = "reduce-scatter" if dp.sharded else "all-reduce"
        how = (f"measured on {dp.group or 'a real group'}, {dp.backend or '?'}" if dp.how == "measured"
               else f"priced at {dp.bandwidth_gbs:.3g} GB/s per rank")
        times = [c.t_reduce or 0.0 for c in profile.stages]
        lines.append(f"  {'dp_shard' if dp.sharded else 'dp_replicate'} link: {what} of each stage's gradients, "
                     f"{min(times):.3g}-{max(times):.3g} ms per stage ({how})")
        factors = [c.reduce_slowdown for c in profile.stages if c.reduce_slowdown is not None]
        if factors:
            lines.append(f"    passes beside it run {min(factors):.3g}-{max(factors):.3g} times slower (reduce_slowdown, "
                         f"{len(factors)} of {profile.num_stages} stages measured)")
        stretch = [c.reduce_stretch for c in profile.stages if c.reduce_stretch is not None]
        if stretch:
            lines.append(f"    and it runs {min(stretch):.3g}-{max(stretch):.3g} times slower beside them (reduce_stretch, "
                         f"{len(stretch)} of {profile.num_stages} stages measured)")
        share = dp.sharing
        if share is not None:
            where = "every rank" if share.ranks_per_link is None else f"each {share.ranks_per_link} ranks"
            lines.append(f"    k ranks' reductions at once on one link ({where}) each run at 1 / (1 + {share.share:.3g} (k - 1)) "
                         "of their speed alone (share)")
    if profile.has_all_to_all:
        a_f, a_b = [c.a_f for c in profile.stages], [c.a_b for c in profile.stages]
        lines.append(f"  ep link: all-to-all inside F {min(a_f):.3g}-{max(a_f):.3g} ms, inside B {min(a_b):.3g}-"
                     f"{max(a_b):.3g} ms per stage")
        shares = [c.pair_exposed for c in profile.stages if c.pair_exposed is not None]
        if shares:
            lines.append(f"    an overlapped pair leaves {min(shares):.2g}-{max(shares):.2g} of what it hides exposed "
                         f"(pair_exposed, {len(shares)} of {profile.num_stages} stages measured)")
    link = made.tp_link
    if link is not None:
        q, bus = link.all_reduce_ms, made.tp_bandwidth_gbs()
        lines.append(f"  tp link: all-reduce of {link.bytes / 2**10:.0f} KiB (one microbatch's hidden state, two per "
                     f"layer in F and two in B) {q.median:.3g} ms median [{q.q1:.3g}, {q.q3:.3g}]"
                     + (f", {bus:.3g} GB/s bus bandwidth" if bus else "") + f" ({link.group}, {link.backend})")
    return lines


def _first_stage_w(profile: Profile, first: StageSpread | None) -> list[Text]:
    """How the first stage's W (its whole backward) runs, against the other way measured."""
    if first is None or first.not_taken is None:
        return []
    st, other = profile.stages[0], first.not_taken
    way = "deferred (the split's fast path)" if st.deferred_first else "one plain backward"
    mine = st.t_f + st.t_b + st.t_w
    theirs = sum(q.mean if q.mean is not None else q.median for q in (other.t_f, other.t_b, other.t_w))
    return [Text(f"stage 0's W runs {way}: F+B+W {mine:.3g} ms, {theirs:.3g} ms {other.w}", style="dim")]


def _link(profile: Profile, s: int) -> str:
    """Stage s's link to the next: its time, "local" between two pieces of one rank."""
    if s == profile.num_stages - 1:
        return "-"
    if profile.placement is not None and profile.placement[s] == profile.placement[s + 1]:
        return "local"
    host = f" (+{profile.comm(s, 't_send'):.2g}/{profile.comm(s, 't_recv'):.2g})" if profile.t_send or profile.t_recv else ""
    return f"{profile.comm(s):.3g}{host}"


def _spread(stats: StageSpread | None) -> str:
    if stats is None:
        return "-"
    return f"{max((q.q3 - q.q1) / 2 / q.median for q in (stats.t_f, stats.t_b, stats.t_w)):.0%}"


def layers_table(layers: LayerProfile) -> Group:
    """Per unit: kind, pass times, activation memory, what it sends and its parameters (and,
    where measured, its recompute pass and what its checkpointed forward keeps); then the link
    estimate and the profiler's warnings."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0), title=layers.name)
    full = any(u.t_r is not None for u in layers.units)
    cols = ["unit", "kind", "T_F\nms", "T_B\nms", "T_W\nms", "T_BW\nms", "M_B\nMiB"]
    cols += ["T_R\nms", "kept\nMiB"] if full else []
    for col in (*cols, "sends\nKiB", "params\nM", "tied"):
        t.add_column(col, justify="right")
    for u in layers.units:
        rec = [("-" if u.t_r is None else f"{u.t_r:.3g}"), ("-" if u.m_fc is None else f"{u.m_fc / 2**20:.3g}")]
        t.add_row(u.name, u.kind, f"{u.t_f:.3g}", f"{u.t_b:.3g}", f"{u.t_w:.3g}", f"{u.fused_backward:.3g}",
                  f"{u.m_f / 2**20:.3g}", *(rec if full else []), f"{u.output_bytes / 2**10:.0f}",
                  f"{u.params / 1e6:.3g}", ",".join(u.tied) or "-")
    link = layers.link
    where = Text(f"{layers.device or '?'}, {layers.dtype or '?'}; link {link.method}: {link.latency_ms:.3g} ms + bytes at "
                 f"{link.bandwidth_gb_s:.3g} GB/s", style="dim")
    warnings = [Text(f"warning: {w}", style="yellow") for w in (layers.measured.warnings if layers.measured else [])]
    return Group(t, where, *warnings)
