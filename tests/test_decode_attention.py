"""The decode-attention pass: SDPA over a static KV cache becomes FlexAttention over the cache
(its block mask from the same boolean mask, grouped-query heads shared): which SDPA it takes and
why it leaves the others, and the numerics of the replaced program against the original."""

from __future__ import annotations

import pytest
import torch

from afd_compile.passes import decode_attention as da
from afd_compile.passes.decode_attention import flex_decode, replace_decode_attention

OP = torch.ops.afd.decode_attention.default


@pytest.fixture(scope="module")
def llama_graphs():
    from test_generate import _cached_graphs

    return _cached_graphs("llama")


def _decode_inputs(seed: int = 1) -> list[torch.Tensor]:
    """Inputs of the captured decode graph (batch 2, cache of 7 positions, 4 filled), with
    left padding in one sequence and random cache contents."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 1), generator=g)
    mask = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., :5] = True
    mask[1, ..., 2:5] = True  # two padding positions, then the filled ones
    caches = [torch.randn(2, 2, 7, 16, generator=g) for _ in range(4)]
    return [ids, torch.tensor([[4], [4]]), mask, torch.tensor(4), caches[0], caches[1], torch.tensor(4), caches[2],
            caches[3]]


def test_flex_decode_is_masked_grouped_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g), torch.randn(
        3, 2, 40, 16, generator=g)
    mask = torch.arange(40)[None, None, None, :] < torch.tensor([5, 17, 40])[:, None, None, None]
    mask[1, ..., :3] = False  # left padding
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask, scale=0.3)
    torch.testing.assert_close(flex_decode(q, k, v, mask, 0.3), ref, rtol=1e-5, atol=1e-6)


def test_decode_sdpa_over_the_cache_is_replaced_and_prefill_is_left(llama_graphs):
    prefill, decode = (ep.module() for ep in llama_graphs)
    left = replace_decode_attention(prefill)
    assert len(left) == 2 and not any(r.replaced for r in left)  # prefill: SDPA reads what it computes
    done = replace_decode_attention(decode)
    assert [r.replaced for r in done] == [True, True]
    targets = [n.target for n in decode.graph.nodes]
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    assert targets.count(OP) == 2
    assert targets.count(da.decode_blocks) == 1  # one block mask per step, shared by both layers
    writes = [n for n in decode.graph.nodes if n.target == torch.ops.aten.index_copy_.default]
    caches = {n.args[0] for n in writes}
    for n in decode.graph.nodes:  # the op reads the caches themselves: K/V heads shared, repeat_kv gone
        if n.target == OP:
            assert {n.args[1], n.args[2]} <= caches | set(writes)
            assert not any(u.target == torch.ops.aten.expand.default for c in caches for u in c.users)
    assert targets.count(torch.ops.aten.index_copy_.default) == 4  # the cache writes stay


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_the_replaced_decode_step_matches_the_original(llama_graphs, inductor):
    from afd_compile.backend import PerLayout

    original, replaced = llama_graphs[1].module(), llama_graphs[1].module()
    replace_decode_attention(replaced)
    with torch.no_grad():
        ref = original(*_decode_inputs())
        run = PerLayout(replaced, "decode-attention-test", True, False, "t", static=[3, 4, 5, 6, 7, 8]) \
            if inductor else replaced
        out = run(("l",), *_decode_inputs()) if inductor else run(*_decode_inputs())
    ref, out = (x[-1] if isinstance(x, (tuple, list)) else x for x in (ref, out))
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_sdpa_without_a_cache_or_a_boolean_mask_is_left_with_a_reason():
    import torch.fx as fx

    g = fx.Graph()
    q, k, v, m = (g.placeholder(n) for n in ("q", "k", "v", "m"))
    for node, shape, dtype in ((q, (2, 4, 1, 16), torch.float32), (k, (2, 4, 8, 16), torch.float32),
                               (v, (2, 4, 8, 16), torch.float32), (m, (2, 1, 1, 8), torch.bool)):
        node.meta["val"] = torch.empty(shape, dtype=dtype)
    out = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), {"attn_mask": m})
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert replace_decode_attention(gm) == []  # no cache in the program: nothing to do
    assert out in gm.graph.nodes


def test_the_backend_option_is_checked_and_auto_replaces_on_cuda_only(llama_graphs):
    from afd_compile.backend import BackendOptionError, BackendOptions
    from afd_compile.pipeline import Build, lower

    assert BackendOptions.parse(None).decode_attention == "auto"
    assert BackendOptions.parse({"decode_attention": "flex"}).decode_attention == "flex"
    with pytest.raises(BackendOptionError,
                       match="option decode_attention='paged' \\(str\\) must be 'auto', 'flex' or 'sdpa'"):
        BackendOptions.parse({"decode_attention": "paged"})
    for value, device, replaced in [("auto", "cuda", 2), ("auto", "cpu", 0), ("flex", "cpu", 2), ("sdpa", "cuda", 0)]:
        decode = llama_graphs[1].module()  # (the pass only rewrites the graph: no GPU needed)
        lower(decode, Build("afd-attention", device=device, inductor=False,
                            decode_attention=BackendOptions.parse({"decode_attention": value}).decode_attention))
        assert [n.target for n in decode.graph.nodes].count(OP) == replaced, (value, device)


def test_explicit_attention_over_the_cache_is_left_with_a_reason():
    # Gemma-2 soft-caps its attention logits: attention written out (matmul, tanh, softmax), not
    # SDPA; the pass leaves it and says why (the decode step keeps reading the whole cache)
    from test_generate import _cached_graphs

    decode = _cached_graphs("gemma2", attn_implementation="eager")[1].module()  # (some transformers releases
    # run Gemma-2 on SDPA, without the soft-capping: that SDPA is replaced like any other)
    records = replace_decode_attention(decode)
    assert len(records) == 2 and not any(r.replaced for r in records), records  # one per layer
    assert all("explicit attention" in r.why for r in records)
    assert OP not in [n.target for n in decode.graph.nodes]


def test_the_op_compiles_its_kernel_once_per_shape_and_runs_sdpa_where_it_cannot(monkeypatch, caplog):
    # measured: Inductor compiling FlexAttention inside a whole 8B-shaped program failed (torch 2.11);
    # the op compiles its kernel alone, once per shape; where even that fails the shape runs
    # masked SDPA, the attention the pass replaced, with a warning and a count
    from torch._inductor.exc import InductorError

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g), torch.randn(
        2, 2, 24, 16, generator=g)
    mask = torch.arange(24)[None, None, None, :] < torch.tensor([9, 20])[:, None, None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask, scale=0.25)
    blocks = da.decode_blocks(q, mask)
    monkeypatch.setattr(da, "_KERNELS", {})
    before = dict(da.STATS)
    out = OP(q, k, v, *blocks, 0.25)
    # compiled and checked once; where this host's Inductor kernel disagrees with masked SDPA
    # (its CPU template on an AVX2 host, head_dim 16) the shape runs SDPA instead
    made = da.STATS["compiled"] + da.STATS["kernel_mismatches"]
    assert made == before["compiled"] + before["kernel_mismatches"] + 1
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    OP(q, k, v, *blocks, 0.25)
    assert da.STATS["compiled"] + da.STATS["kernel_mismatches"] == made and len(da._KERNELS) == 1  # once

    def failing(*args, **kwargs):
        def fn(*a):
            raise InductorError(RuntimeError("no template for this flex_attention"), None)
        return fn

    monkeypatch.setattr(torch, "compile", failing)
    q2 = torch.randn(2, 8, 1, 16, generator=g)  # a new shape: compiled now, and that fails
    out = OP(q2, k, v, *blocks, 0.25)
    assert da.STATS["compile_failures"] == before["compile_failures"] + 1
    assert "could not compile FlexAttention for q (2, 8, 1, 16)" in caplog.text and "no template" in caplog.text
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(
        q2, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=0.25))


def test_a_compiled_kernel_that_disagrees_with_sdpa_is_never_used(monkeypatch, caplog):
    # the first call of each shape checks the compiled kernel against masked SDPA on random inputs
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 1, 32, generator=g), torch.randn(2, 2, 24, 32, generator=g), torch.randn(
        2, 2, 24, 32, generator=g)
    mask = torch.arange(24)[None, None, None, :] < torch.tensor([9, 20])[:, None, None, None]
    monkeypatch.setattr(da, "_KERNELS", {})
    monkeypatch.setattr(da, "flex_over_blocks", lambda q, k, v, *rest: q * 0.5)  # wrong, and compiles
    before = dict(da.STATS)
    out = OP(q, k, v, *da.decode_blocks(q, mask), 0.25)
    assert da.STATS["kernel_mismatches"] == before["kernel_mismatches"] + 1
    assert da.STATS["compiled"] == before["compiled"]
    assert "disagrees with masked SDPA" in caplog.text and "q (2, 4, 1, 32)" in caplog.text
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask, scale=0.25)
    assert torch.equal(out, ref)


def test_one_process_generate_with_flex_decode_attention_matches_eager():
    # no layout: the backend applies the decode-attention pass alone (one GPU); greedy tokens of
    # generate() with a static cache are those of the uncompiled model, and the decode graph ran
    # the op (its kernel compiled once per shape)
    import transformers

    from afd_compile.backend import STATS
    from afd_compile.models import FAMILIES

    cls, cfg_cls, kwargs = FAMILIES["llama"]
    cfg = getattr(transformers, cfg_cls)(**{**kwargs, "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).eval()
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(**gen)
    compiled, no_layout = da.STATS["compiled"] + da.STATS["kernel_mismatches"], STATS["no_layout"]
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="afd", options={"decode_attention": "flex"}, dynamic=True)
    out = model.generate(**gen)
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    # (each shape's kernel compiled and checked; on a host whose Inductor kernel is wrong, SDPA runs)
    assert da.STATS["compiled"] + da.STATS["kernel_mismatches"] > compiled and STATS["no_layout"] == no_layout


def test_the_kernel_check_compares_a_few_sequences(monkeypatch):
    # the reference repeats K/V per query head: over a whole serving batch at a long context that is tens
    # of GB; the check compares the first CHECK_SEQUENCES sequences (sequences do not mix in attention)
    seen: list[int] = []
    sdpa = da._sdpa_decode
    monkeypatch.setattr(da, "_sdpa_decode", lambda q, *rest: seen.append(q.shape[0]) or sdpa(q, *rest))
    monkeypatch.setattr(da, "_KERNELS", {})
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(6, 4, 1, 32, generator=g), torch.randn(6, 2, 24, 32, generator=g), torch.randn(
        6, 2, 24, 32, generator=g)
    mask = torch.arange(24)[None, None, None, :] < torch.tensor([9, 20, 3, 24, 1, 12])[:, None, None, None]
    out = OP(q, k, v, *da.decode_blocks(q, mask), 0.25)
    assert seen[0] == da.CHECK_SEQUENCES == 2
    # the whole batch right, whichever ran it (the compiled kernel once checked, or SDPA where it disagreed)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
