r"""Every claim a comparison page can make, under one Holm correction, from a committed run's per-prompt scores
(docs/comparison.md, "Claims"): each row against the base and against each of its controls, on the greedy and
on the sampled score, "above" and "below" alike, and every ordered pair of methods on the greedy score (the
Δ matrix: "A − B above" for each order, which holds "B below A" too): compare_stats.claims_of's family, the
one compare.py's report corrects over, on both scores; the same family again with the prompts fixed (a t
over the seed means: seed_means). Also the matrix read at equal FLOPs: each method's eval-split curve
(results.json's `curves_eval`) at the largest training budget every method reached.

    python benchmarks/claims.py docs/comparison_run      # writes docs/comparison_run/claims.json

Reads `results.json` (rows, controls, curves, a sweep's kept settings) and `scores.npz`
(`{row}[/{setting}]/seed{s}|{score,score_sampled}`, [P]);
the intervals and one-sided p-values are compare.py's (compare_stats: seeds and prompts both random).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from compare_stats import claims_of, holm, pairwise, row_stats  # noqa: E402

ALPHA = 0.025  # one-sided, as compare.py's: a lone claim holds exactly when its 95% interval is past 0
METRICS = {"score": "greedy", "score_sampled": "sampled"}


def run(results, row, seed):
    """A row's run of one seed as scores.npz names it: `row/seed{s}`, or `row/{setting}/seed{s}` where a
    --sweep chose the row's setting (results.json's `kept`)."""
    kept = results.get("kept", {}).get(row)
    return f"{row}/{kept}/seed{seed}" if kept else f"{row}/seed{seed}"


def family(results, scores):
    """{claim: {"delta": [Δ, ±], "p": p, "holds": bool, "of": [A, B, score key, side]}} over every claim,
    Holm over all of them at ALPHA: the claims compare.py's report makes (claims_of: each row against the base
    and its controls, above and below, and the greedy Δ matrix), once on the greedy score and once more, the
    matrix aside, on the sampled score.
    A claim reads "A − B (greedy) above" (A beats B) or "… below" (A falls below B)."""
    table = lambda row, m: {
        "score": np.stack([scores[f"{run(results, row, s)}|{m}"] for s in results["seeds"]])
    }
    base = next(iter(results["rows"]))
    methods = list(dict.fromkeys(m.split(" − ")[0] for m in results["matrix"]))
    claims = []
    for m, name in METRICS.items():  # each row's stats on this score, as compare.py's row_stats makes them
        stats = {
            row: {
                **row_stats(table(row, m), table(base, m)),
                "versus": {c: row_stats(table(row, m), table(c, m)) for c in r["stats"].get("versus", {})},
            }
            for row, r in results["rows"].items()
        }
        matrix = pairwise({a: table(a, m)["score"] for a in methods}) if m == "score" else None
        claims += [(a, b, d, p, side, m) for a, b, d, p, side in claims_of(stats, base, matrix)]
    held = holm([c[3] for c in claims], ALPHA)
    return {
        f"{a} − {b} ({METRICS[m]}) {side}": {"delta": list(d), "p": p, "holds": ok, "of": [a, b, m, side]}
        for (a, b, d, p, side, m), ok in zip(claims, held)
    }


def seed_means(results, scores, claims):
    """The same family (family's claims) with the prompts fixed: each claim's Δ per seed (its mean over the
    prompts), a paired t over those S seed means (S − 1 df, one-sided), Holm at ALPHA over all of them ->
    {"p": {claim: p}, "holds": [claims]}. A check on the random-effects interval, which the prompts' spread
    narrows too."""
    import scipy.stats

    ps = {}
    for claim, v in claims.items():
        a, b, m, side = v["of"]
        d = np.array(
            [
                (scores[f"{run(results, a, s)}|{m}"] - scores[f"{run(results, b, s)}|{m}"]).mean()
                for s in results["seeds"]
            ]
        )
        t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d))) * (1 if side == "above" else -1)
        ps[claim] = float(scipy.stats.t.sf(t, len(d) - 1))
    held = holm(list(ps.values()), ALPHA)
    return {"p": ps, "holds": [c for c, ok in zip(ps, held) if ok]}


def at_equal_flops(results):
    """Each method's eval-split greedy score at the largest training budget (FLOPs past its base) that every
    method's curve reaches, linearly between its checkpoints: {"flops": F, "rows": {row: [mean, lo, hi]}}
    (mean and range over seeds), beside each at its own final budget."""
    curves = {r: c for r, c in results["curves_eval"].items() if r != next(iter(results["rows"]))}
    spent = lambda seed_curve: [(f - seed_curve[0][0], s) for f, s in seed_curve]  # FLOPs past the base
    budget = min(spent(c)[-1][0] for cs in curves.values() for c in cs)
    rows = {}
    for row, cs in curves.items():
        at = [float(np.interp(budget, *zip(*spent(c)))) for c in cs]
        end = [c[-1][1] for c in cs]
        rows[row] = {
            "at_budget": [float(np.mean(at)), min(at), max(at)],
            "at_end": [float(np.mean(end)), min(end), max(end)],
        }
    return {"flops": budget, "rows": rows}


def main(folder):
    results = json.load(open(os.path.join(folder, "results.json")))
    scores = np.load(os.path.join(folder, "scores.npz"))
    claims = family(results, scores)
    out = {
        "alpha": ALPHA,
        "family": len(claims),
        "claims": claims,
        "seed_means": seed_means(results, scores, claims),
        "equal_flops": at_equal_flops(results),
    }
    with open(os.path.join(folder, "claims.json"), "w") as f:
        json.dump(out, f, indent=1)
    held = [c for c, v in claims.items() if v["holds"]]
    print(f"{len(held)} of {len(claims)} claims hold under Holm at {ALPHA}:")
    for c in held:
        print(f"  {c}: Δ {claims[c]['delta'][0]:+.3f} ± {claims[c]['delta'][1]:.3f}, p {claims[c]['p']:.1e}")
    print(f"with the prompts fixed (a t over the seed means), {len(out['seed_means']['holds'])} hold:")
    for c in out["seed_means"]["holds"]:
        print(f"  {c}: p {out['seed_means']['p'][c]:.1e}")
    print(
        f"eval score at {out['equal_flops']['flops']:.2e} training FLOPs (every method's curve reaches it):"
    )
    for row, v in out["equal_flops"]["rows"].items():
        print(f"  {row}: {v['at_budget'][0]:.3f} (its own budget: {v['at_end'][0]:.3f})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "comparison_run"))
