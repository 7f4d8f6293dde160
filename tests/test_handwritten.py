"""Decoders written by hand, not by transformers (issue 14): GQA by ``repeat_interleave`` and an
in-place scaled query, through TP (standard and DP attention) and AFD on real gloo processes."""

from __future__ import annotations

import pytest
import torch
from handwritten import GQADecoder, export

from afd_compile.layout import AFDLayout
from afd_compile.scatter import TPLayout
from afd_compile.verify import Case, TPCase, run_cases, run_tp_cases


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("handwritten") / "gqa.pt2")
    torch.export.save(export(GQADecoder()), path)
    return path


def test_gqa_by_repeat_interleave_shards_and_matches(gqa_path):
    results = run_tp_cases([TPCase(gqa_path, TPLayout(2)), TPCase(gqa_path, TPLayout(4, 2), (3, 1))])
    for res in results:
        assert res and max(r["max_rel_err"] for r in res.values()) <= 1e-5, res
        assert all(r["compared"] for r in res.values())


def test_gqa_by_repeat_interleave_splits_for_afd(gqa_path):
    (res,) = run_cases([Case(gqa_path, AFDLayout(2, 1), (2, 3))])
    errs = [r["max_rel_err"] for r in res.values() if r["role"] == "attention"]
    assert len(errs) == 2 and max(errs) <= 1e-5


def test_replicated_kv_heads_cannot_be_repeat_interleaved(gqa_path):
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.passes.shard import ShardError
    from afd_compile.passes.tp_rewrite import shard_for_rank
    from afd_compile.programs import load_program

    gm = load_program(gqa_path).module()
    annotate_roles(gm)
    with pytest.raises(ShardError, match=r"combines tensors split into different numbers of heads per rank"):
        shard_for_rank(gm, TPLayout(4), 0)  # 2 KV heads over 4 ranks: replicated, then repeated twice
