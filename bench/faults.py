"""The runtime under faults: the whole fault-injection matrix, with the time from each fault to
each rank's error.

For p = 2 and 4 (ZB-H1, m = 4, small Linear stages on gloo, one process per rank), the second
and the last rank is made to fail at F, B and W of microbatch 1, in four ways: SIGKILL, a hang
(sleeps past the timeout), an exception raised in its stage code, a NaN in its activations or
gradients (``tests/helpers/faults.py``). Each case runs a good step, then the faulty step (and
one more, for ranks that can finish the faulty step without the faulty rank).

Expected, and checked per case (``ok``): every live rank ends with a PipelineError that names
its rank, action and peer (and, on the faulty rank itself, stage and microbatch), and then
refuses to step; a NaN case finishes on every rank. Reported: seconds from the fault to each
rank's error (a hang: about the timeout; a kill or exception: the time for the news to
travel), and the case's wall time including process start-up.

Prints a table and saves bench/results/faults.json.
Run: python bench/faults.py [--timeout 3] [--only p2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from a checkout

from tests.helpers.faults import Case, matrix, run_case  # noqa: E402


def _ok(case: Case, res: dict) -> bool:
    for rank, rep in enumerate(res["ranks"]):
        if rank == case.rank and case.fault in ("kill", "hang"):
            if rep is not None:
                return False
        elif case.fault == "nan":
            if rep is None or rep["outcome"] != "finished":
                return False
        elif rep is None or rep["outcome"] != "error" or not rep.get("refuses_next_step") \
                or not rep["message"].startswith(f"rank {rank}: "):
            return False
    return res["fault_injected"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=3.0, help="the runtime's timeout (s)")
    ap.add_argument("--only", choices=["p2", "p4"], help="one pipeline size only")
    args = ap.parse_args()
    cases = [c for c in matrix() if args.only is None or f"p{c.world}" == args.only]
    rows = []
    print(f"{'p':>2} {'fault':>5} {'at':>4}  {'ok':>3}  {'wall s':>6}  seconds from the fault to each rank's error")
    for case in cases:
        t0 = time.monotonic()
        res = run_case(case, timeout=args.timeout)
        res["wall_s"] = round(time.monotonic() - t0, 2)
        res["ok"] = _ok(case, res)
        rows.append(res)
        cells = []
        for rank, rep in enumerate(res["ranks"]):
            if rep is None:
                cells.append(f"r{rank}: -")
            elif rep["outcome"] == "error":
                cells.append(f"r{rank}: {rep.get('elapsed_s', float('nan')):.3f}")
            else:
                cells.append(f"r{rank}: {rep['outcome']}")
        print(f"{case.world:>2} {case.fault:>5} {case.action:>4}  {'yes' if res['ok'] else 'NO':>3}  {res['wall_s']:>6.1f}  "
              + "  ".join(cells), flush=True)
    load = os.getloadavg()
    out = {"timeout_s": args.timeout, "load_average": [round(x, 2) for x in load], "cases": rows,
           "all_ok": all(r["ok"] for r in rows)}
    path = Path(__file__).with_name("results") / "faults.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} cases as expected; load average {load[0]:.2f}; wrote {path}")


if __name__ == "__main__":
    main()
