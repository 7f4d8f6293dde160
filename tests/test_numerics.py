"""Numerics on real gloo processes: every attention rank's output equals the original model on
that rank's input alone (fp32, max relative error <= 1e-5).

All cases run in one spawn (each case on its own process group) so the suite stays fast.
"""

from __future__ import annotations

import pytest

from afd_compile.layout import AFDLayout
from afd_compile.verify import Case, run_cases

TOL = 1e-5
LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 2), (3, 2)]

# (model, layout, gate on attention, batch per attention rank)
CASES = [("llama3", a, f, False) for a, f in LAYOUTS]
CASES += [("qwen3moe3_mixed", a, f, False) for a, f in LAYOUTS if a >= 2]  # (1A1F, 3A1F: llama3's)
CASES += [("qwen3moe3_mixed", a, f, True) for a, f in [(2, 1), (3, 2)]]
# ALiBi attention through baddbmm; the MLP module adds the residual itself (its add stays attention's)
CASES += [("bloom", 3, 2, False)]
# a hybrid: layer 0's token mixer is Mamba (a state-space scan, not attention), run whole on the attention ranks
CASES += [("jamba", 3, 2, False)]
# every mixer a block of its own (Nemotron-H): layers end at each MLP / MoE block; one has no token mixer
CASES += [("nemotron_h", 3, 2, True)]
# an MLP and an MoE side by side (Gemma-4): both on the FFN ranks
CASES += [("gemma4_moe", 2, 1, False)]
# zero-token attention ranks: the FFN rank fans in only the peers that have tokens
ZERO = [("llama3", 2, 1, False, (3, 0)), ("qwen3moe3_mixed", 3, 2, True, (0, 2, 0))]


def _id(case: tuple) -> str:
    name, a, f, gate, *rest = case
    return f"{name}-{a}A{f}F{'-gate_on_attention' if gate else ''}{'-tokens' + str(rest[0]) if rest else ''}"


@pytest.fixture(scope="module")
def results(exported):
    cases = [Case(exported(n)[1], AFDLayout(a, f), tuple(2 + (3 * i) % 5 for i in range(a)), g, steps=2)
             for n, a, f, g in CASES]
    cases += [Case(exported(n)[1], AFDLayout(a, f), b, g, steps=2) for n, a, f, g, b in ZERO]
    out = run_cases(cases)
    return {_id(c): r for c, r in zip(CASES + ZERO, out, strict=True)}


@pytest.mark.parametrize("case", CASES + ZERO, ids=_id)
def test_split_matches_single_process_model(results, case):
    per_rank = results[_id(case)]
    _, a, f, *_ = case
    layout = AFDLayout(a, f)
    attn = {r: v for r, v in per_rank.items() if v["role"] == "attention"}
    ffn = {r: v for r, v in per_rank.items() if v["role"] == "ffn"}
    assert sorted(attn) == [layout.attention_world_rank(i) for i in range(a)]
    assert sorted(ffn) == list(range(f))
    for r, v in attn.items():
        assert v["max_rel_err"] <= TOL, f"rank {r}: max_rel_err {v['max_rel_err']}"
    # every FFN rank served both steps; ranks had different batch sizes
    assert all(v["steps"] == 2 for v in ffn.values())
    if a > 1:
        assert len({tuple(v["batches"]) for v in attn.values()}) > 1
