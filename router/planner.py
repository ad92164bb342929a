"""The PrfaaS-PD throughput model and its optimiser (the PrfaaS document, sections 3.4.1-3.4.2).

Stages of a deployment with `n_prfaas` PrfaaS prefill instances, `n_p` PD prefill and `n_d` PD decode
instances, a PrfaaS egress of B_out bytes/s and routing threshold t (uncached length l > t goes to PrfaaS):
    p = P(L > t),  l_long = E[L | L > t],  l_short = E[L | L <= t]
    theta_prfaas = min(n_prfaas / T_prfaas(l_long), B_out / S_kv(l_long))                 (3)
    theta_pd_p   = n_p / T_pd(l_short)                                                    (4)
    theta_pd_d   = n_d * BS_max / (T_decode * L_out)                                      (5)
    lambda_max   = min(theta_prfaas / p, theta_pd_p / (1 - p), theta_pd_d)                (6)
`plan` searches t (steps of at most `t_step` tokens over the workload's length range) and every integer split
n_p + n_d = n_pd for the largest lambda_max, the optimum where eqs. (7) and (8) balance the stages. The two
baselines of the document's Table 6 use the same model: homogeneous PD (every prefill local, the best split of
`n_homogeneous` PD instances) and naive heterogeneous (every prefill in PrfaaS, all `n_pd` instances decode).

Profiles (`Profile`, the JSON `jaxserve profile` writes and `jaxserve plan` reads):
    {"prefill": {"tokens": [...], "seconds": [...], "kv_bytes": [...]},
     "decode": {"step_seconds": T_decode, "max_batch": BS_max}}
prefill time and KV size between listed lengths are linear in the length, outside them extrapolated from the
nearest two points. Workloads (`Workload`): {"length": {"lognormal": {"mu", "sigma", "min", "max"}},
"output_tokens": L_out}, a log-normal of uncached input lengths truncated to [min, max]; its probabilities and
conditional means are exact (the normal CDF), not sampled.

Plain Python, no JAX: the router's long-term loop and the simulator call it too.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math


class PlanError(ValueError):
    """A profile, workload or hardware count that the model cannot take; the message names the field."""


def _num(d: dict, key: str, where: str, positive: bool = True) -> float:
    if key not in d:
        raise PlanError(f"{where}.{key} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PlanError(f"{where}.{key} must be a number, got {v!r}")
    if positive and v <= 0:
        raise PlanError(f"{where}.{key} must be > 0, got {v!r}")
    return float(v)


def _series(d: dict, key: str, where: str) -> tuple[float, ...]:
    v = d.get(key)
    if not isinstance(v, list) or not v:
        raise PlanError(f"{where}.{key} must be a non-empty list of numbers, got {v!r}")
    out = tuple(_num({key: x}, key, where, positive=key not in ("kv_bytes", "extra_seconds")) for x in v)
    if any(x < 0 for x in out):
        raise PlanError(f"{where}.{key} must not be negative, got {v!r}")
    return out


def _curve(d: dict, keys: tuple[str, ...], where: str) -> tuple[tuple[float, ...], ...]:
    """The series `keys` of d, of one length, the first increasing (a PlanError naming the field if not)."""
    cols = tuple(_series(d, k, where) for k in keys)
    if len({len(c) for c in cols}) > 1:
        raise PlanError(f"{where}: {', '.join(keys[:-1])} and {keys[-1]} differ in length "
                        f"({', '.join(str(len(c)) for c in cols)})")
    if any(b <= a for a, b in zip(cols[0], cols[0][1:])):
        raise PlanError(f"{where}.{keys[0]} must increase, got {list(cols[0])}")
    return cols


def _linear(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear in x through (xs, ys) (xs increasing), extrapolated from the nearest two points."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional to the length
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclasses.dataclass(frozen=True)
class Profile:
    """One instance kind: prefill seconds and KV bytes at measured lengths, a decode step and its batch; and,
    where measured (`prefill.prefix`, optional), what a cached prefix of each listed length adds to a prefill of
    `new_tokens` behind it (attention over the prefix, reading it from the cache) over that prefill alone."""
    tokens: tuple[float, ...]
    seconds: tuple[float, ...]
    kv_bytes: tuple[float, ...]
    step_seconds: float
    max_batch: float
    prefix_tokens: tuple[float, ...] = ()
    prefix_extra: tuple[float, ...] = ()
    prefix_new_tokens: float = 0.0

    @classmethod
    def from_json(cls, d: dict, where: str = "profile") -> "Profile":
        if not isinstance(d, dict):
            raise PlanError(f"{where} must be an object with prefill and decode")
        pre, dec = d.get("prefill"), d.get("decode")
        if not isinstance(pre, dict):
            raise PlanError(f"{where}.prefill must be an object with tokens, seconds, kv_bytes")
        if not isinstance(dec, dict):
            raise PlanError(f"{where}.decode must be an object with step_seconds, max_batch")
        w = f"{where}.prefill"
        tokens, seconds, kv = _curve(pre, ("tokens", "seconds", "kv_bytes"), w)
        prefix = pre.get("prefix")
        ptoks, extra, new = (), (), 0.0
        if prefix is not None:
            wp = f"{w}.prefix"
            if not isinstance(prefix, dict):
                raise PlanError(f"{wp} must be an object with new_tokens, tokens, extra_seconds")
            ptoks, extra = _curve(prefix, ("tokens", "extra_seconds"), wp)
            new = _num(prefix, "new_tokens", wp)
        return cls(tokens, seconds, kv, _num(dec, "step_seconds", f"{where}.decode"),
                   _num(dec, "max_batch", f"{where}.decode"), ptoks, extra, new)

    def to_json(self) -> dict:
        pre = {"tokens": list(self.tokens), "seconds": list(self.seconds), "kv_bytes": list(self.kv_bytes)}
        if self.prefix_tokens:
            pre["prefix"] = {"new_tokens": self.prefix_new_tokens, "tokens": list(self.prefix_tokens),
                             "extra_seconds": list(self.prefix_extra)}
        return {"prefill": pre, "decode": {"step_seconds": self.step_seconds, "max_batch": self.max_batch}}

    def prefill_seconds(self, length: float) -> float:
        return max(_linear(self.tokens, self.seconds, length), 1e-12)

    def prefix_seconds(self, cached: float) -> float:
        """What a cached prefix of `cached` tokens adds to the prefill behind it (0 where not measured): linear
        from (0, 0) through the measured points, extrapolated from the last two."""
        if not self.prefix_tokens or cached <= 0:
            return 0.0
        return max(_linear((0.0,) + self.prefix_tokens, (0.0,) + self.prefix_extra, cached), 0.0)

    def kv_bytes_at(self, length: float) -> float:
        return max(_linear(self.tokens, self.kv_bytes, length), 0.0)

    def decode_rate(self, output_tokens: float) -> float:
        """Requests per second one instance decodes: BS_max / (T_decode * L_out)."""
        return self.max_batch / (self.step_seconds * output_tokens)


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """Uncached input lengths: log-normal(mu, sigma) truncated to [lo, hi]."""
    mu: float
    sigma: float
    lo: float
    hi: float

    def _mass(self, a: float, b: float) -> float:  # untruncated P(a < L <= b)
        return _phi((math.log(b) - self.mu) / self.sigma) - _phi((math.log(a) - self.mu) / self.sigma)

    def _moment(self, a: float, b: float) -> float:  # untruncated E[L; a < L <= b]
        s2 = self.sigma ** 2
        return math.exp(self.mu + s2 / 2) * (_phi((math.log(b) - self.mu - s2) / self.sigma)
                                             - _phi((math.log(a) - self.mu - s2) / self.sigma))

    def above(self, t: float) -> float:
        """P(L > t)."""
        t = min(max(t, self.lo), self.hi)
        return self._mass(t, self.hi) / self._mass(self.lo, self.hi)

    def mean_between(self, a: float, b: float) -> float | None:
        """E[L | a < L <= b] (clipped to the support); None where that has no mass."""
        a, b = max(a, self.lo), min(b, self.hi)
        if b <= a or self._mass(a, b) <= 0:
            return None
        return self._moment(a, b) / self._mass(a, b)

    def mean(self) -> float:
        return self.mean_between(self.lo, self.hi)


class Empirical:
    """Uncached input lengths as observed (the router's recent requests): the same interface as LogNormal."""

    def __init__(self, lengths):
        xs = sorted(float(x) for x in lengths)
        if not xs or xs[0] <= 0:
            raise PlanError("observed lengths must be a non-empty list of positive numbers")
        self.xs = xs
        self.lo, self.hi = xs[0], xs[-1]
        self._cum = [0.0]
        for x in xs:
            self._cum.append(self._cum[-1] + x)

    def _index(self, t: float) -> int:  # how many observed lengths are <= t
        return bisect.bisect_right(self.xs, t)

    def above(self, t: float) -> float:
        return 1.0 - self._index(t) / len(self.xs)

    def mean_between(self, a: float, b: float) -> float | None:
        i, j = self._index(a), self._index(b)
        return (self._cum[j] - self._cum[i]) / (j - i) if j > i else None

    def mean(self) -> float:
        return self._cum[-1] / len(self.xs)


@dataclasses.dataclass(frozen=True)
class Workload:
    lengths: LogNormal | Empirical
    output_tokens: float

    @classmethod
    def from_json(cls, d: dict, where: str = "workload") -> "Workload":
        ln = (d.get("length") or {}).get("lognormal") if isinstance(d, dict) else None
        if not isinstance(ln, dict):
            raise PlanError(f"{where}.length.lognormal must be an object with mu, sigma, min, max")
        w = f"{where}.length.lognormal"
        lo, hi = _num(ln, "min", w), _num(ln, "max", w)
        if hi <= lo:
            raise PlanError(f"{w}: max ({hi:g}) must be above min ({lo:g})")
        return cls(LogNormal(_num(ln, "mu", w, positive=False), _num(ln, "sigma", w), lo, hi),
                   _num(d, "output_tokens", where))

    def to_json(self) -> dict:
        ln = self.lengths
        if isinstance(ln, Empirical):
            return {"length": {"observed": {"count": len(ln.xs), "mean": ln.mean(), "min": ln.lo, "max": ln.hi}},
                    "output_tokens": self.output_tokens}
        return {"length": {"lognormal": {"mu": ln.mu, "sigma": ln.sigma, "min": ln.lo, "max": ln.hi}},
                "output_tokens": self.output_tokens}


def _ratio(theta: float, share: float) -> float:
    return math.inf if share <= 0 else theta / share


def stages(prfaas: Profile, pd: Profile, wl: Workload, t: float, n_prfaas: int, n_p: int, n_d: int,
           egress_gbps: float) -> dict:
    """Eqs. (3)-(6) at threshold t and split (n_p, n_d); egress_gbps: the PrfaaS egress the KV uses at
    lambda_max (p * lambda_max * S_kv(l_long))."""
    L = wl.lengths
    p = L.above(t)
    l_long, l_short = L.mean_between(t, L.hi), L.mean_between(0.0, t)  # (0, t]: the shortest length included
    b_out = egress_gbps * 1e9 / 8
    th_prfaas = 0.0 if l_long is None else min(n_prfaas / prfaas.prefill_seconds(l_long),
                                               math.inf if prfaas.kv_bytes_at(l_long) <= 0
                                               else b_out / prfaas.kv_bytes_at(l_long))
    th_p = 0.0 if l_short is None else n_p / pd.prefill_seconds(l_short)
    th_d = n_d * pd.decode_rate(wl.output_tokens)
    prefill = min(_ratio(th_prfaas, p), _ratio(th_p, 1 - p))
    lam = min(prefill, th_d)
    used = lam * p * prfaas.kv_bytes_at(l_long) * 8 / 1e9 if l_long is not None and p > 0 else 0.0
    return dict(lambda_max=lam, threshold_tokens=t, n_prfaas=n_prfaas, n_p=n_p, n_d=n_d, p=p, l_long=l_long,
                l_short=l_short, theta_prfaas=th_prfaas, theta_pd_p=th_p, theta_pd_d=th_d,
                prefill_capacity=prefill, egress_gbps=used)


def thresholds(wl: Workload, step: int) -> list[float]:
    """Candidate thresholds: the length range in steps of at most `step` tokens, both ends included (t just
    under min sends everything to PrfaaS, t = max nothing)."""
    lo, hi = wl.lengths.lo, wl.lengths.hi
    return [float(t) for t in range(int(lo) - 1, int(hi), step)] + [hi]


def best_of(rows: list[dict]) -> dict:
    # the most throughput; then the most prefill headroom; then the least egress
    return max(rows, key=lambda r: (round(r["lambda_max"], 12), round(r["prefill_capacity"], 12), -r["egress_gbps"]))


def best_threshold(prfaas: Profile, pd: Profile, wl: Workload, n_prfaas: int, n_p: int, n_d: int,
                   egress_gbps: float, t_step: int = 256) -> dict:
    """The optimum threshold for a split that is given (the instances as they are now): `stages` there."""
    return best_of([stages(prfaas, pd, wl, t, n_prfaas, n_p, n_d, egress_gbps) for t in thresholds(wl, t_step)])


def plan(prfaas: Profile, pd: Profile, wl: Workload, n_prfaas: int, n_pd: int, egress_gbps: float,
         n_homogeneous: int | None = None, t_step: int = 256) -> dict:
    """The optimum PrfaaS-PD configuration and the two baselines: {"prfaas_pd": ..., "homogeneous": ...,
    "naive": ...}, each with the fields of `stages` that apply."""
    for name, v in (("n_prfaas", n_prfaas), ("n_pd", n_pd), ("t_step", t_step)):
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    if not egress_gbps > 0:
        raise PlanError(f"egress_gbps must be > 0, got {egress_gbps!r}")
    n_h = n_prfaas + n_pd if n_homogeneous is None else n_homogeneous
    if not isinstance(n_h, int) or n_h < 2:
        raise PlanError(f"n_homogeneous must be an integer >= 2, got {n_h!r}")
    best = best_of([best_threshold(prfaas, pd, wl, n_prfaas, n_p, n_pd - n_p, egress_gbps, t_step)
                  for n_p in range(n_pd + 1)])
    hi = wl.lengths.hi
    homo = best_of([stages(prfaas, pd, wl, hi, 0, n_p, n_h - n_p, egress_gbps) for n_p in range(1, n_h)])
    naive = stages(prfaas, pd, wl, wl.lengths.lo, n_prfaas, 0, n_pd, egress_gbps)
    for r, drop in ((homo, ("n_prfaas", "theta_prfaas", "threshold_tokens", "l_long", "p", "egress_gbps")),
                    (naive, ("n_p", "theta_pd_p", "threshold_tokens", "l_short"))):
        for k in drop:
            r.pop(k)
    base = homo["lambda_max"]
    for r in (best, homo, naive):
        r["ratio_vs_homogeneous"] = r["lambda_max"] / base if base > 0 else None
    return {"prfaas_pd": best, "homogeneous": homo, "naive": naive,
            "inputs": {"n_prfaas": n_prfaas, "n_pd": n_pd, "n_homogeneous": n_h, "egress_gbps_available": egress_gbps,
                       "t_step": t_step, "workload": wl.to_json(), "mean_length": wl.lengths.mean()}}


def load_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise PlanError(f"{what} {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise PlanError(f"{what} {path} is not JSON: {e}") from e


def format_plan(result: dict) -> str:
    """The optimum and the baselines as a table (what `jaxserve plan` prints)."""
    rows = [("", "PrfaaS-PD", "homogeneous PD", "naive heterogeneous")]
    b, h, n = result["prfaas_pd"], result["homogeneous"], result["naive"]

    def f(r, k, fmt="{:.2f}"):
        return fmt.format(r[k]) if r.get(k) is not None else "-"
    rows.append(("threshold t (tokens)", f(b, "threshold_tokens", "{:.0f}"), "-", "-"))
    rows.append(("N_prfaas / N_p / N_d", f"{b['n_prfaas']} / {b['n_p']} / {b['n_d']}", f"- / {h['n_p']} / {h['n_d']}",
                 f"{n['n_prfaas']} / - / {n['n_d']}"))
    rows.append(("p (to PrfaaS)", f(b, "p", "{:.3f}"), "0", "1"))
    rows.append(("l_long / l_short (tokens)", f"{f(b, 'l_long', '{:.0f}')} / {f(b, 'l_short', '{:.0f}')}",
                 f"- / {f(h, 'l_short', '{:.0f}')}", f"{f(n, 'l_long', '{:.0f}')} / -"))
    rows.append(("theta prfaas / pd-p / pd-d (req/s)",
                 f"{f(b, 'theta_prfaas')} / {f(b, 'theta_pd_p')} / {f(b, 'theta_pd_d')}",
                 f"- / {f(h, 'theta_pd_p')} / {f(h, 'theta_pd_d')}",
                 f"{f(n, 'theta_prfaas')} / - / {f(n, 'theta_pd_d')}"))
    rows.append(("lambda_max (req/s)", f(b, "lambda_max"), f(h, "lambda_max"), f(n, "lambda_max")))
    rows.append(("ratio", f(b, "ratio_vs_homogeneous"), f(h, "ratio_vs_homogeneous"), f(n, "ratio_vs_homogeneous")))
    rows.append(("PrfaaS egress (Gbit/s)", f(b, "egress_gbps", "{:.1f}"), "-", f(n, "egress_gbps", "{:.1f}")))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)
