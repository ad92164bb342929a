"""BanaServe's adaptive module migration (4.4.1, Algorithm 1): which layers or KV heads to move between
instances, and when. Plain Python, no I/O: the router's control loop measures, calls `plan`, and carries the
moves out (a move of layers or heads of the requests running on `src`).

Each instance's load is U = C/Cmax + M/Mmax (eq. 32: busy fraction plus KV use, 0..2). An instance is
overloaded when its load exceeds the least loaded one's by more than delta, underloaded when it is below the
most loaded one's by more than delta (eq. 33). Hysteresis (distinct thresholds): a migration round starts
only when the largest gap exceeds `delta_up`, and once started keeps balancing (later cycles included) while
the gap exceeds `delta_down`; under it the planner goes quiet again. So a steady load between the two
thresholds never starts a round, and one inside a round is not chased below delta_down (no oscillation).

For the most overloaded / underloaded pair with gap Delta (eq. 34):
- layer-level (when the source supports it): move k contiguous layers (the last k the source runs, so the
  ranges stay contiguous); their share of the source's compute and KV moves across, about U_src x k / n_layers.
  Payload: k x (weight bytes + KV bytes per layer) (eq. 3), time payload / bandwidth + sync (eq. 4).
- attention-level: move h KV heads; the attention share of the source's load x h / n_heads moves across.
  Payload: h x KV bytes per head (eq. 11), no weights.
Candidates are every k (h) whose transfer fits `budget_s` (T_mig <= T_budget); each has Benefit =
Delta_before - Delta_after and Cost = transfer + sync (eq. 35); the best benefit among those with
Benefit / Cost >= rho is taken, layers tried first (Algorithm 1 lines 12-15), heads when no layer move
qualifies. Loads are then updated and the loop repeats until no pair is left or no move qualifies; an
instance sends or receives at most once per round (a move takes effect before the next measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Unit:
    """One instance as the planner sees it."""
    name: str
    load: float  # U = busy + KV use (0..2)
    layers: tuple[int, int] | None = None  # [lo, hi) it runs for its requests (None: layer moves unsupported)
    heads: int = 0  # KV heads it computes attention for (0: head moves unsupported)
    running: int = 0  # requests running: a move applies to them; none -> nothing to move
    weight_bytes_per_layer: float = 0.0
    kv_bytes_per_layer: float = 0.0  # the running requests' KV, one layer
    attention_share: float = 0.5  # fraction of its load that is attention over the KV (what head moves shift)


@dataclass(frozen=True)
class MigrationParams:
    delta_up: float = 0.4  # a round starts when the largest load gap exceeds this
    delta_down: float = 0.15  # ... and goes on while it exceeds this
    rho: float = 1.0  # Benefit / Cost (load units per second) a move needs
    budget_s: float = 2.0  # T_budget: the most one move may take
    bandwidth_bytes_s: float = 1e9  # B_net between instances
    sync_s: float = 0.05  # T_sync: the pause to hand over running requests

    def __post_init__(self):
        if not 0 <= self.delta_down < self.delta_up:
            raise ValueError(f"migration: delta_down ({self.delta_down}) must be below delta_up ({self.delta_up})")
        if self.bandwidth_bytes_s <= 0 or self.budget_s <= 0:
            raise ValueError("migration: bandwidth_bytes_s and budget_s must be positive")


@dataclass(frozen=True)
class Move:
    kind: str  # layers / heads
    src: str
    dst: str
    layers: tuple[int, int] | None  # [lo, hi) for a layer move
    heads: int  # for a head move: how many (the source's last ones)
    benefit: float
    cost_s: float
    why: str


@dataclass
class MigrationPlanner:
    params: MigrationParams = field(default_factory=MigrationParams)
    active: bool = False  # inside a round (hysteresis)
    rounds: int = 0
    moves: int = 0

    def plan(self, units: list[Unit]) -> list[Move]:
        p = self.params
        load = {u.name: u.load for u in units}
        by = {u.name: u for u in units}
        if len(units) < 2:
            return []
        gap = max(load.values()) - min(load.values())
        if not self.active and gap > p.delta_up:
            self.active, self.rounds = True, self.rounds + 1
        elif self.active and gap <= p.delta_down:
            self.active = False
        if not self.active:
            return []
        delta = p.delta_down  # inside a round: balance down to delta_down
        out: list[Move] = []
        used: set[str] = set()
        while True:
            lo_l, hi_l = min(load.values()), max(load.values())
            over = [n for n in load if load[n] - lo_l > delta and n not in used and by[n].running]
            under = [n for n in load if hi_l - load[n] > delta and n not in used]
            if not over or not under:
                break
            o = max(over, key=lambda n: (load[n], n))
            u = min(under, key=lambda n: (load[n], n))
            if o == u:
                break
            m = self._best(by[o], by[u], load[o], load[u])
            if m is None:
                used.add(o)  # nothing it can send qualifies: try the next overloaded instance
                continue
            after = self._after(m, by[o], load[o])
            load[o], load[u] = load[o] - after, load[u] + after
            used.update((o, u))
            out.append(m)
        self.moves += len(out)
        return out

    def _after(self, m: Move, src: Unit, load_src: float) -> float:
        """The load that moves with m."""
        if m.kind == "layers":
            lo, hi = src.layers
            return load_src * (m.layers[1] - m.layers[0]) / (hi - lo)
        return load_src * src.attention_share * m.heads / src.heads

    def _best(self, src: Unit, dst: Unit, lo: float, lu: float) -> Move | None:
        p = self.params
        gap = lo - lu
        cands: list[Move] = []
        if src.layers is not None and src.layers[1] - src.layers[0] > 1:
            a, b = src.layers
            n = b - a
            for k in range(1, n):  # keep at least one layer
                t = k * (src.weight_bytes_per_layer + src.kv_bytes_per_layer) / p.bandwidth_bytes_s + p.sync_s
                if t > p.budget_s:
                    break
                shift = lo * k / n
                cands.append(Move("layers", src.name, dst.name, (b - k, b), 0, gap - abs(gap - 2 * shift), t,
                                  f"U {lo:.2f} vs {lu:.2f}: layers {b - k}-{b - 1} ({k} of {n})"))
        best = self._pick(cands)
        if best is not None:
            return best
        cands = []
        n_layers = src.layers[1] - src.layers[0] if src.layers else 1
        for h in range(1, src.heads):  # keep at least one head
            t = h * src.kv_bytes_per_layer * n_layers / src.heads / p.bandwidth_bytes_s + p.sync_s
            if t > p.budget_s:
                break
            shift = lo * src.attention_share * h / src.heads
            cands.append(Move("heads", src.name, dst.name, None, h, gap - abs(gap - 2 * shift), t,
                              f"U {lo:.2f} vs {lu:.2f}: {h} of {src.heads} KV heads"))
        return self._pick(cands)

    def _pick(self, cands: list[Move]) -> Move | None:
        ok = [m for m in cands if m.benefit > 0 and m.benefit / m.cost_s >= self.params.rho]
        return max(ok, key=lambda m: (round(m.benefit, 9), -m.cost_s), default=None)
