"""The KernelBench table of docs/PERFORMANCE.md from `python -m fused_linear.bench
--kernelbench ... --protocols graph,stream --json FILE` runs (one config, several files
merged, e.g. the two halves of the 36 problems; a later file's rows replace an earlier
one's for the same problem, e.g. a rerun of a few problems at a newer build):

    python3 scripts/kb-table.py kb-a.json kb-b.json

One row per problem: `graph` forward eager / compile / ours (ms) and min(eager, compile) /
ours, then that ratio for `graph` forward+backward and `stream` forward and
forward+backward; below it, per column, how many problems reach 1.0 and 1.3, the
geometric mean and the range.
"""

import json
import math
import sys

COLUMNS = [("fwd", "graph"), ("fwdbwd", "graph"), ("fwd", "stream"), ("fwdbwd", "stream")]


def main() -> None:
    times: dict = {}
    order: list = []
    for path in sys.argv[1:]:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if r["value"] is None:
                    continue
                times.setdefault((r["model"], r["mode"], r["protocol"]), {})[r["impl"]] = r["value"]
                if r["model"] not in order:
                    order.append(r["model"])

    def ratio(model: str, mode: str, protocol: str):
        t = times.get((model, mode, protocol), {})
        peers = [t[i] for i in ("eager", "compile") if t.get(i)]
        return min(peers) / t["ours"] if peers and t.get("ours") else None

    def cell(r) -> str:
        return "–" if r is None else f"{r:.2f}"

    head = ["problem", "graph fwd: eager / compile / ours ms, ratio", "graph fwd+bwd ratio"]
    print("| " + " | ".join(head + ["stream fwd", "stream fwd+bwd"]) + " |")
    print("|---|---|---|---|---|")
    columns: dict = {c: [] for c in COLUMNS}
    for model in order:
        rs = [ratio(model, *c) for c in COLUMNS]
        for c, r in zip(COLUMNS, rs):
            if r is not None:
                columns[c].append(r)
        t = times.get((model, "fwd", "graph"), {})
        ms = " / ".join(f"{t[i]:.3f}" if t.get(i) else "–" for i in ("eager", "compile", "ours"))
        print(f"| {model} | {ms} **{cell(rs[0])}** | {cell(rs[1])} | {cell(rs[2])} | {cell(rs[3])} |")
    print()
    for (mode, protocol), rs in columns.items():
        if not rs:
            continue
        geomean = math.exp(sum(math.log(r) for r in rs) / len(rs))
        ones, high = sum(r >= 1.0 for r in rs), sum(r >= 1.3 for r in rs)
        spread = f"geometric mean {geomean:.2f}, range {min(rs):.2f}-{max(rs):.2f}"
        print(f"- {protocol} {mode}: at or above 1.0 on {ones} of {len(rs)}, 1.3 on {high}; {spread}")


if __name__ == "__main__":
    main()
