"""The `policy` section of a config: one section per placement policy, told apart by `name` (a discriminated
union), each holding only the keys its policy reads (router/policies/, one module per policy).

A key of another policy is an error that names the policies taking it (`policy.threshold_tokens: a key of the
prfaas policy; this section is name: least_loaded`). A section without `name` is the default policy's.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

DEFAULT = "least_loaded"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LeastLoadedPolicy(_Section):
    """`least_loaded`: the least loaded prefill and decode instances (the default)."""
    name: Literal["least_loaded"] = Field("least_loaded", description="the placement policy (docs/05-policies.md)")


class RoundRobinPolicy(_Section):
    """`round_robin`: instances in turn."""
    name: Literal["round_robin"] = Field(description="the placement policy")


class CacheAwarePolicy(_Section):
    """`cache_aware`: SGLang's or Dynamo's cache-affine rule (`rule`), as published."""
    name: Literal["cache_aware"] = Field(description="the placement policy")
    rule: Literal["sglang", "dynamo"] = Field("sglang", description="whose rule")
    cache_threshold: float = Field(0.5, ge=0, le=1, description="sglang: a prefix match ratio above this routes to "
                                   "the instance holding it")
    balance_abs: int = Field(32, ge=0, description="sglang: imbalanced when the most and least loaded instances "
                             "differ by more than this many requests ...")
    balance_rel: float = Field(1.5, ge=1, description="... and the most loaded carries more than this x the least")
    overlap_weight: float = Field(1.0, ge=0, description="dynamo: weight of prefill blocks in the cost")


class BanaServePolicy(_Section):
    """`banaserve`: load-aware dispatch over the global KV store (BanaServe Algorithm 2), and with `migrate` its
    migration of decode work (Algorithm 1)."""
    name: Literal["banaserve"] = Field(description="the placement policy")
    load_threshold: float = Field(1.5, gt=0, description="delta_L, the load U (busy fraction + KV use + queued "
                                  "tokens / token_budget) from which the shortest queue decides")
    token_budget: int = Field(8192, ge=1, description="prefill tokens that count as one full step of queued work")
    store: bool = Field(True, description="prefixes in the global KV store count as hits on every prefill "
                        "instance")
    control_s: float | None = Field(None, gt=0, description="with migrate: plan migrations this often")
    migrate: bool = Field(False, description="every control_s, move decode work (layers or KV heads of the running "
                          "requests) from the most to the least loaded decode instance (BanaServe Algorithm 1, "
                          "router/migration.py)")
    migrate_delta_up: float = Field(0.4, gt=0, description="migrate: a round starts when the load gap (busy "
                                    "fraction + KV use) exceeds this")
    migrate_delta_down: float = Field(0.15, ge=0, description="migrate: ... and goes on while it exceeds this")
    migrate_budget_s: float = Field(2.0, gt=0, description="migrate: the most one move may take (T_budget)")

    @model_validator(mode="after")
    def _migrate(self):
        if self.control_s is not None and not self.migrate:
            raise ValueError("control_s needs migrate (banaserve plans migrations every control_s)")
        if self.migrate and self.control_s is None:
            raise ValueError("migrate needs control_s (how often migrations are planned)")
        if self.migrate_delta_down >= self.migrate_delta_up:
            raise ValueError(f"migrate_delta_down ({self.migrate_delta_down}) must be below migrate_delta_up "
                             f"({self.migrate_delta_up})")
        return self


class FlowKVPolicy(_Section):
    """`flowkv`: load scores, normal / imbalanced / extreme scenarios, role changes and scaling (FlowKV
    Appendix B)."""
    name: Literal["flowkv"] = Field(description="the placement policy")
    token_budget: int = Field(8192, ge=1, description="prefill tokens that count as one full step of queued work")
    store: bool = Field(False, description="prefixes in the global KV store count as hits on every prefill "
                        "instance")
    load_window_s: float = Field(5.0, gt=0, description="the sliding window load indicators are smoothed over")
    load_low: float = Field(0.6, gt=0, description="epsilon_low; C^p and C^d at or under it: normal load")
    load_high: float = Field(1.2, gt=0, description="epsilon_high; both at or under it: imbalanced; above: extreme")
    idle_score: float = Field(0.3, ge=0, description="an instance whose load score is under this is idle")
    assist_s: float = Field(10.0, ge=0, description="how long idle decode instances prefill for an overloaded "
                            "prefill side")
    extreme_s: float = Field(30.0, ge=0, description="how long a scenario lasts before scaling")
    control_s: float | None = Field(None, gt=0, description="run the global controller this often (role changes, "
                                    "scaling); off when unset")

    @model_validator(mode="after")
    def _load_band(self):
        if self.load_low >= self.load_high:
            raise ValueError(f"load_low ({self.load_low}) must be below load_high ({self.load_high})")
        return self


class PrfaaSPolicy(_Section):
    """`prfaas`: selective offload of long uncached prefills to a PrfaaS cluster, bandwidth- and cache-aware, and
    with `replan_s` the long-term re-planning from observed traffic (PrfaaS 3.4.3)."""
    name: Literal["prfaas"] = Field(description="the placement policy")
    threshold_tokens: int = Field(1024, ge=0, description="a request whose uncached prompt length exceeds this is "
                                  "prefilled in a PrfaaS cluster, the rest in the PD cluster")
    adaptive: bool = Field(True, description="the effective threshold follows the PrfaaS -> PD link's utilisation "
                           "(raised before it saturates, lowered when there is room)")
    raise_utilisation: float = Field(0.8, gt=0, description="link utilisation at which the threshold rises")
    lower_utilisation: float = Field(0.4, ge=0, description="link utilisation below which it falls back")
    threshold_step: float = Field(1.5, gt=1, description="factor per threshold change")
    max_threshold_tokens: int | None = Field(None, ge=1, description="ceiling of the effective threshold "
                                             "(default 16 x threshold_tokens)")
    hold_s: float = Field(4.0, ge=0, description="a utilisation level moves the threshold once it has held this "
                          "long since it began and since the last change")
    window_s: float = Field(20.0, gt=0, description="the recent uncached prompt lengths the link's predicted "
                            "demand is taken over (the threshold's floor)")
    scarce_utilisation: float = Field(0.6, ge=0, description="link utilisation from which bandwidth counts as "
                                      "scarce: each cluster's cached prefix is judged alone, none moves across")
    affinity_slack: int = Field(2, ge=0, description="the instance holding the request's prefix is chosen unless "
                                "it has more than this many requests in flight beyond the least loaded one")
    local_prefill_tokens: int = Field(256, ge=0, description="a decode instance that holds all but this many "
                                      "prompt tokens (a conversation's next turn) prefills them itself")
    replan_s: float | None = Field(None, gt=0, description="re-plan this often from the observed traffic "
                                   "(router/replan.py): the optimal threshold, and PD instances flipped between "
                                   "prefill and decode in place; off when unset")
    prfaas_profile: str | None = Field(None, description="replan: profile JSON of a PrfaaS prefill instance "
                                       "(`jaxserve profile`)")
    pd_profile: str | None = Field(None, description="replan: profile JSON of a PD-cluster instance")
    replan_window_s: float = Field(600.0, gt=0, description="replan: the traffic it plans from")
    replan_min_samples: int = Field(20, ge=1, description="replan: requests observed before any decision")
    replan_min_gain: float = Field(0.1, ge=0, description="replan: a flip needs the planned throughput to grow by "
                                   "this fraction (hysteresis)")
    replan_min_interval_s: float = Field(120.0, ge=0, description="replan: the least time between two flips")

    @model_validator(mode="after")
    def _replan(self):
        if self.replan_s is not None:
            missing = [f for f in ("prfaas_profile", "pd_profile") if getattr(self, f) is None]
            if missing:
                raise ValueError(f"replan_s needs {' and '.join(missing)} (profiles from `jaxserve profile`)")
        return self

    @model_validator(mode="after")
    def _band(self):
        if self.raise_utilisation <= self.lower_utilisation * self.threshold_step:
            raise ValueError(f"raise_utilisation ({self.raise_utilisation}) must exceed lower_utilisation x "
                             f"threshold_step ({self.lower_utilisation} x {self.threshold_step}): one change of "
                             f"the threshold must not carry the link across both levels")
        return self


SECTIONS = (LeastLoadedPolicy, PrfaaSPolicy, RoundRobinPolicy, CacheAwarePolicy, BanaServePolicy, FlowKVPolicy)
BY_NAME = {s.model_fields["name"].annotation.__args__[0]: s for s in SECTIONS}
PolicySection = Annotated[Union[SECTIONS], Field(discriminator="name")]
_ADAPTER = TypeAdapter(PolicySection)


class PolicyKeyError(ValueError):
    """A policy section's key in the wrong place; `key` names it (config.parse puts it in the error's path)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def check_keys(data):
    """Before validation: a section without `name` is the default policy's; an unknown `name` fails naming the
    policies there are; a key its policy does not take, but another does, fails naming the policies that take
    it. Anything else is left to the union."""
    if not isinstance(data, dict):
        return data
    name = data.get("name", DEFAULT)
    section = BY_NAME.get(name) if isinstance(name, str) else None
    if section is None:
        raise PolicyKeyError("name", f"unknown policy {name!r} (one of {', '.join(BY_NAME)})")
    for key in data:
        if key not in section.model_fields:
            takes = [n for n, s in BY_NAME.items() if key in s.model_fields]
            if takes:
                raise PolicyKeyError(key, f"a key of the {' and '.join(takes)} "
                                     f"{'policy' if len(takes) == 1 else 'policies'}; this section is name: {name}")
    return {**data, "name": name}


def policy_section(**keys) -> PolicySection:
    """A policy section from its keys, as the config's `policy` mapping (name: the policy; default least_loaded)."""
    return _ADAPTER.validate_python(check_keys(keys))
