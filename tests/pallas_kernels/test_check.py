"""The kernel self-test and `engine.kernels: auto`'s fallback: a kernel that does not lower, or that lowers and
gives wrong numbers, runs as its jnp reference; the engine's answers stay those of the references."""

import dataclasses

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.models.config import MLPSpec, MoESpec, load_config
from jaxserve.models.model import kernel_cases
from jaxserve.pallas_kernels import check, select
from jaxserve.pallas_kernels.select import KernelPlan
from tests.pallas_kernels.conftest import INTERPRET
from tests.tiny_models import FAMILIES

ENGINE = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                      max_num_seqs=4, num_snapshots=8)
PROMPTS = [[5, 7, 9], [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15], [30, 31, 5, 7, 9, 11]]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _tokens(path, kernels):
    llm = LLM(path, "float32", progress=False, engine=dataclasses.replace(ENGINE, kernels=kernels))
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_cases_follow_the_model_and_pass_in_interpret_mode(checkpoint_dir):
    cfg = load_config(checkpoint_dir("kimi_linear"))
    cases = kernel_cases(cfg, jnp.float32, 4)
    assert sorted({c.kernel for c in cases}) == ["batched_attention", "chunk_gated_delta_rule", "grouped_matmul",
                                                 "matmul", "paged_mla_attention", "paged_mla_prefill_attention",
                                                 "recurrent_gated_delta_rule"]
    by = {c.kernel: dict(c.dims) for c in cases}
    assert by["paged_mla_attention"]["L"] == 16 and by["chunk_gated_delta_rule"]["per_channel"] is True
    # the products of the dense MLP layers (gate and up fused: models/fuse.py), of the MoE layers' shared expert
    # (gate, up and down) and of the LM head (no Pallas kernel: XLA's dot on a GPU); the experts' grouped products
    H, I = cfg.hidden_size, next(s.mlp.intermediate_size for s in cfg.layers if isinstance(s.mlp, MLPSpec))
    moe = next(s.mlp for s in cfg.layers if isinstance(s.mlp, MoESpec))
    S, E, J = moe.shared_intermediate_size, moe.num_experts, moe.intermediate_size
    assert {(d["K"], d["N"], d["transposed"]) for c in cases if c.kernel == "matmul" for d in [dict(c.dims)]} == \
        {(H, 2 * I, False), (I, H, False), (H, S, False), (S, H, False),
         (H, min(cfg.vocab_size, 4096), cfg.tie_word_embeddings)}
    assert {(d["E"], d["K"], d["N"]) for c in cases if c.kernel == "grouped_matmul" for d in [dict(c.dims)]} == \
        {(E, H, J), (E, J, H)}
    # the kernels with a Pallas implementation (matmul and the MLA prefill have none: native or XLA's)
    assert check.self_test([c for c in cases if select.KERNELS[c.kernel][1] is not None], "interpret") == {}


def test_a_kernel_that_gives_wrong_numbers_fails_its_case(monkeypatch):
    ref, kernel = select.KERNELS["paged_attention"]
    case = check.Case.of("paged_attention", Hq=4, Hkv=2, Dk=8, Dv=8, dtype=jnp.float32, block_size=4)
    assert check.run_case(case, "interpret") is None
    monkeypatch.setitem(select.KERNELS, "paged_attention", (ref, lambda *a, **kw: kernel(*a, **kw) * 1.1))
    assert "differs from its reference" in check.run_case(case, "interpret")
    monkeypatch.setitem(select.KERNELS, "paged_attention", (ref, lambda *a, **kw: kernel(*a, **kw) * jnp.nan))
    assert check.run_case(case, "interpret") == "returns non-finite values"


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernels do lower")
def test_auto_where_no_kernel_lowers_runs_the_references(checkpoint_dir, monkeypatch):
    """'auto' on a machine it takes for a GPU: on this CPU every kernel compiled for real fails to lower
    ("only interpret mode"), so each runs as its reference and the tokens are the references'; an explicit
    'pallas' refuses to start, naming the kernel."""
    path = checkpoint_dir("qwen3_next")
    _, want = _tokens(path, "reference")
    monkeypatch.setattr(select, "auto_mode", lambda: "pallas")
    llm, got = _tokens(path, "auto")
    assert got == want
    assert set(llm.engine.kernel_fallbacks) == {"batched_attention", "paged_attention", "paged_prefill_attention",
                                                "chunk_gated_delta_rule", "recurrent_gated_delta_rule"}
    assert all("does not compile" in why for why in llm.engine.kernel_fallbacks.values())
    assert llm.engine.kernels == KernelPlan("pallas", frozenset(llm.engine.kernel_fallbacks))
    assert llm.engine.stats()["kernel_fallbacks"] == 5
    assert not llm.engine.runner.inplace_prefill  # its prefill kernel runs as the reference: the dense view
    with pytest.raises(check.KernelCheckError, match="engine.kernels: pallas.*does not compile"):
        _tokens(path, "pallas")


def test_auto_replaces_only_the_kernel_that_fails(checkpoint_dir, monkeypatch):
    """One kernel lowers but computes wrong numbers: it alone runs as its reference; the others stay kernels
    (interpret mode stands in for the compiled kernels here) and the tokens are the references'."""
    path = checkpoint_dir("llama")
    _, want = _tokens(path, "reference")
    ref, kernel = select.KERNELS["paged_attention"]
    monkeypatch.setitem(select.KERNELS, "paged_attention", (ref, lambda *a, **kw: kernel(*a, **kw) * 0.5))
    monkeypatch.setattr(select, "auto_mode", lambda: "interpret")
    llm, got = _tokens(path, "auto")
    assert list(llm.engine.kernel_fallbacks) == ["paged_attention"]
    assert llm.engine.kernels == KernelPlan("interpret", frozenset({"paged_attention"}))
    assert select.select("batched_attention", llm.engine.kernels).keywords == {"interpret": True}
    assert select.select("paged_attention", llm.engine.kernels) is ref
    assert got == want


@pytest.mark.skipif(INTERPRET, reason="needs a GPU: elsewhere auto means the references")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_on_a_gpu_gives_the_references_tokens(checkpoint_dir, family):
    """The engine with engine.kernels: auto on a GPU: the kernels that pass their self-test compiled, the others
    as references, the same greedy tokens as the references alone."""
    path = checkpoint_dir(family)
    _, want = _tokens(path, "reference")
    llm, got = _tokens(path, "auto")
    print(family, "fallbacks:", llm.engine.kernel_fallbacks)
    assert isinstance(llm.engine.kernels, KernelPlan) and llm.engine.kernels.mode == "pallas"
    assert got == want
