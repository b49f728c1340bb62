"""Overlapped pairs on DeepSeek-like MoE profiles: the solved schedule against DualPipeV.

Profiles: p stages of equal cost (F 2.0, B 2.0, W 1.6 ms per stage, M_B 1 per stage, 0.05 ms
links), expert-parallel all-to-all a share of F and B (20%, 30%, 40%), V placement. For each
case: DualPipeV with its pairs overlapped (as DeepSeek and torch run it) and without, ZB-V
(no pairs), and ``zbsearch.solve`` at DualPipeV's peak memory, which chooses the order and
the pairs. Everything is simulated (predicted), with the solver's lower bound.

Targets: solved at least as fast as DualPipeV; at least 1.2x ZB-V without overlap where the
all-to-all is 30% or more. The larger m (64) show the steady state: a rank's forwards in
its warm-up cannot pair, which costs the same at any m (the solver's pairing bound).

Run: PYTHONPATH=. python bench/moe.py [--time-limit 20]
"""

from __future__ import annotations

import argparse
import time

from common import save

from zbsearch import Profile, StageCost, build_classic, solve, validate
from zbsearch.formats.mesh import ProfileMesh

CASES = [(8, 16), (8, 32), (16, 32), (8, 64), (16, 64)]
SHARES = [0.2, 0.3, 0.4]
T_F, T_B, T_W = 2.0, 2.0, 1.6


def profile(p: int, share: float) -> Profile:
    """A DeepSeek-like MoE profile: every stage alike, the all-to-all ``share`` of F and of B."""
    st = StageCost(t_f=T_F, t_b=T_B, t_w=T_W, m_f=1.0, m_b=-0.5, m_w=-0.5, a_f=share * T_F, a_b=share * T_B)
    return Profile(name=f"moe-p{p}-a2a{round(share * 100)}", memory_unit="activations", stages=[st] * p, t_comm=0.05,
                   mesh=ProfileMesh(pp=p, ep=8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    args = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    for p, m in CASES:
        for share in SHARES:
            prof = profile(p, share)
            dv = build_classic("dualpipe-v", prof, m)
            serial = build_classic("dualpipe-v", prof, m, overlap=False)
            zbv = build_classic("zb-v", prof, m)
            limit = max(dv.predicted.peak_memory)
            t = time.perf_counter()
            res = solve(prof, m, [limit] * p, chunks=2, time_limit=args.time_limit)
            validate(res.schedule)
            row = {"p": p, "m": m, "a2a_share": share, "dualpipe_v": max(dv.predicted.span),
                   "dualpipe_v_no_overlap": max(serial.predicted.span), "zb_v": max(zbv.predicted.span),
                   "zb_v_peak": max(zbv.predicted.peak_memory), "limit": limit, "solved": res.info.value,
                   "bound": res.info.lower_bound, "status": res.info.status, "pairs": res.info.overlapped_pairs,
                   "construction": res.info.construction, "solve_s": round(time.perf_counter() - t, 1)}
            row["vs_dualpipe_v"] = row["dualpipe_v"] / row["solved"]
            row["vs_zb_v"] = row["zb_v"] / row["solved"]
            rows.append(row)
            print(f"p={p} m={m} a2a {share:.0%}: solved {row['solved']:.2f} (bound {row['bound']:.2f}, {row['pairs']} pairs), "
                  f"dualpipe-v {row['dualpipe_v']:.2f} / no overlap {row['dualpipe_v_no_overlap']:.2f}, zb-v {row['zb_v']:.2f}; "
                  f"{row['vs_dualpipe_v']:.3f}x dualpipe-v, {row['vs_zb_v']:.3f}x zb-v", flush=True)
    save({"benchmark": "moe", "time_limit_s": args.time_limit, "wall_s": time.perf_counter() - t0,
          "stage": {"t_f": T_F, "t_b": T_B, "t_w": T_W}, "rows": rows}, "moe")


if __name__ == "__main__":
    main()
