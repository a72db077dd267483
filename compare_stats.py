"""compare.py's statistics: pure functions of per-prompt score tables [seeds S, prompts P] and of p-values.

    mean_variance, mean_interval   a mean over seeds × prompts, both random (crossed two-way random effects)
    t_quantile, p_above_zero       Student's t: the interval's quantile, the one-sided p of "above 0"
    row_stats                      a row's cells against the base, paired per seed and prompt
    holm                           Holm's step-down correction over a family of claims
    pairwise                       the method-against-method Δ matrix, paired, each claim's p
    claims_of                      every claim a report could make of those: one family for holm
Imports nothing of the project's (docs/compare.md, "Intervals"); tested by hand in tests/test_compare.py.
"""

import math

import numpy as np


def t_quantile(p, df):
    """Student-t quantile t_p(df) (SciPy's, a dependency of JAX's)."""
    import scipy.stats  # here: `import compare` stays light

    return float(scipy.stats.t.ppf(p, df))


def mean_interval(x, level=0.95):
    """Mean of x [S seeds, P prompts] and the half-width of its `level` interval (t, mean_variance's)."""
    m, var, df = mean_variance(x)
    return m, float(t_quantile((1 + level) / 2, df) * math.sqrt(var)) if var > 0 else 0.0


def p_above_zero(x):
    """One-sided p-value of "the mean of x [S, P] is above 0", t with mean_variance's variance and df: the
    claim "beats" of a paired difference x holds alone at 2.5% exactly when its 95% interval lies above 0."""
    import scipy.stats

    m, var, df = mean_variance(x)
    return float(scipy.stats.t.sf(m / math.sqrt(var), df)) if var > 0 else float(m <= 0)


def mean_variance(x):
    """Mean of x [S seeds, P prompts], the variance of that mean and its degrees of freedom, seeds and
    prompts random (crossed two-way random effects, Cornfield–Tukey):
    Var(mean) = (MS_seed + MS_prompt − MS_resid) / (S·P), Satterthwaite's df, each MS floored at MS_resid;
    S = 1: prompts only (seed noise unmeasured); var 0: no spread."""
    x = np.asarray(x, np.float64)
    s, p = x.shape
    m = x.mean()
    rows = x.mean(1)  # each seed's mean [S]
    cols = x.mean(0)  # each prompt's mean [P]
    ms_p = s * np.sum((cols - m) ** 2) / max(p - 1, 1)
    if s == 1:
        terms = [(ms_p, p - 1)]
    else:
        ms_s = p * np.sum((rows - m) ** 2) / (s - 1)
        ms_e = np.sum((x - rows[:, None] - cols[None] + m) ** 2) / ((s - 1) * max(p - 1, 1))
        terms = [(max(ms_s, ms_e), s - 1), (max(ms_p, ms_e), p - 1), (-ms_e, (s - 1) * (p - 1))]
    var = sum(t for t, _ in terms) / (s * p)
    if var <= 0 or p < 2:
        return float(m), 0.0, 0.0
    return float(m), float(var), float(sum(t for t, _ in terms) ** 2 / sum(t * t / d for t, d in terms))


def row_stats(arrays, base_arrays):
    """{metric: [S, P]} of a row and of the base -> {metric: (mean, ±)}, `delta`: score row − base, paired,
    `p` and `p_below`: the one-sided p-values of "beats" and of "falls below"."""
    diff = arrays["score"] - base_arrays["score"]
    return {
        **{k: mean_interval(v) for k, v in arrays.items()},
        "delta": mean_interval(diff),
        "p": p_above_zero(diff),
        "p_below": p_above_zero(-diff),
    }


def holm(pvalues, alpha):
    """Holm's step-down correction (Holm 1979) -> which claims of a family hold, the chance that any of them
    is false kept ≤ alpha: sorted ascending, the k-th p-value (from 0) of m must be ≤ alpha / (m − k), as
    must all before it. One claim alone: p ≤ alpha."""
    holds = [False] * len(pvalues)
    for k, i in enumerate(np.argsort(pvalues, kind="stable")):
        if pvalues[i] > alpha / (len(pvalues) - k):
            break
        holds[i] = True
    return holds


def pairwise(tables):
    """{name: [S, P] greedy scores, the same seeds and prompts} -> {(a, b): (Δ, ±, p)} for every ordered pair
    a ≠ b: Δ = mean(a − b) paired per seed and prompt, its 95% half-width, the one-sided p of "a beats b"
    (p_above_zero; the pair's other order is its "falls below"). Holm's correction: the caller's, over every
    claim of its page (claims_of)."""
    pairs = [(a, b) for a in tables for b in tables if a != b]
    diffs = [np.asarray(tables[a], np.float64) - np.asarray(tables[b], np.float64) for a, b in pairs]
    return {pair: (*mean_interval(d), p_above_zero(d)) for pair, d in zip(pairs, diffs)}


def claims_of(stats, base_name, matrix=None):
    """Every claim the report could make, one Holm family: [(row, against, (Δ, ±), p, side)], each row against
    its seed's base and each of its controls (`versus`), "above" (beats) and "below" (falls below) alike, and
    each ordered pair of the Δ matrix (pairwise's; "above" only: the other order is the pair's "below")."""
    return [
        (name, against, st_["delta"], st_[key], side)
        for name, st in stats.items()
        if name != base_name
        for against, st_ in [(base_name, st), *st.get("versus", {}).items()]
        for side, key in (("above", "p"), ("below", "p_below"))
    ] + [(a, b, (d, h), p, "above") for (a, b), (d, h, p) in (matrix or {}).items()]
