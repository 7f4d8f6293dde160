"""KV-cache decoding: HF ``generate()`` with a static cache through the afd backend
(examples/generate.py under torchrun, real gloo processes), the cache's roles and shards in the
programs, and an FFN rank serving attention ranks that finish at different steps."""

from __future__ import annotations

import os
import re

import pytest
import torch
from clirun import Ran, run_cli
from scriptrun import run_script

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "generate.py")

RUNS = [  # (processes, example arguments)
    # micro-batch stages: each its own rows of the static cache (2 sequences | 3 over 2 stages)
    # (ranks finishing apart: test_an_ffn_rank_serves_until_the_last_attention_rank_stops; through
    # generate() in the slow runs). torch 2.11's graph of this run keeps a whole-batch slice and
    # expands the rotary frequencies to a size read off the batch: both followed per micro-batch
    (3, ("--attention", "2", "--ffn", "1", "--family", "qwen3_moe", "--stages", "2", "--no-inductor")),
    (4, ("--tp", "4", "--attn-dp", "2", "--idle-dp-group", "--no-inductor")),  # 2 sequences | none
    # a fixed slot over static caches (2 sequences | 3) of 3 stages: rank 1's program has 2 micro-batches
    # and sends the third in zeros (ghost stages); ranks finishing apart stop in band
    (3, ("--attention", "2", "--ffn", "1", "--stages", "3", "--buckets", "fixed:16", "--stagger", "2",
         "--no-inductor")),
]
SLOW_RUNS = [  # (CI time: FlexAttention through the backend is also compiled and checked in test_decode_attention.py;
    #            a Qwen3-MoE TP cache in the default decode-step verify runs)
    (2, ("--attention", "1", "--ffn", "1", "--decode-attention", "flex")),  # Inductor, FlexAttention decode
    (2, ("--tp", "2", "--family", "qwen3_moe", "--no-inductor")),
    (3, ("--attention", "2", "--ffn", "1", "--family", "qwen3_moe", "--no-inductor")),
    (3, ("--attention", "2", "--ffn", "1", "--stages", "3")),  # Inductor; 2 sequences over 3 stages: 2 run
    (3, ("--attention", "2", "--ffn", "1", "--no-inductor")),
    (2, ("--attention", "1", "--ffn", "1", "--family", "qwen3_moe", "--no-inductor")),
    (5, ("--attention", "3", "--ffn", "2", "--family", "qwen3_moe", "--no-inductor")),
    (2, ("--tp", "2")),
    (4, ("--tp", "4", "--attn-dp", "2", "--no-inductor")),  # 2 sequences | 3
    (5, ("--attention", "3", "--ffn", "2", "--stagger", "2", "--no-inductor")),
    (3, ("--attention", "2", "--ffn", "1", "--stagger", "2", "--no-inductor")),  # ranks finishing apart
]


def _run(n: int, *args: str):
    """The example on ``n`` ranks forked from a preloaded launcher (scriptrun: the same script and
    gloo processes as under torchrun, without each rank importing transformers again; the torchrun
    launch itself is tested with examples/compile_backend.py and the CLI's workers)."""
    return run_script(n, EXAMPLE, *args)


def _check(proc, args: tuple[str, ...]) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"OK tokens_match=(\d+)/(\d+)", last)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) > 0, proc.stdout[-2000:]
    ranks = re.findall(r"^rank (\d+) (attention|tp|ffn): (.*)$", proc.stdout, flags=re.M)
    if "--ffn" in args:
        ffn = int(args[args.index("--ffn") + 1])
        served = [line for r, role, line in ranks if role == "ffn"]
        assert len(served) == ffn and all("kv_cache_bytes=0 " in s for s in served)
        if "--stagger" in args:  # an FFN rank served until its last peer (16 new tokens) finished
            assert any(re.search(r"served 32 steps", s) for s in served), served  # 2 generate() x 16 steps
    generated = [line for r, role, line in ranks if role != "ffn"]
    assert generated and all(int(re.search(r"kv_cache_bytes=(\d+)", g).group(1)) > 0 for g in generated)
    if "--idle-dp-group" in args:  # the last DP group's ranks stepped a dummy; the first group's were compared
        assert sum("no sequences" in g for g in generated) == 2 and sum("tokens_match" in g for g in generated) == 2
    if "--tp" in args:  # a TP rank holds only its KV heads: 1 of the test models' 2 (attn_tp >= 2)
        for g in generated:
            held, full = map(int, re.search(r"kv_cache_bytes=(\d+) of (\d+) for all KV heads", g).groups())
            assert 2 * held == full, g


def _args(run) -> tuple[str, ...]:
    """The example arguments of a RUNS row (a plain tuple or a pytest.param)."""
    return run.values[1] if hasattr(run, "values") else run[1]


@pytest.mark.parametrize("n,args", RUNS, ids=[" ".join(_args(r)) for r in RUNS])
def test_generate_matches_single_process_tokens(n, args):
    _check(_run(n, *args), args)


@pytest.mark.slow
@pytest.mark.parametrize("n,args", SLOW_RUNS, ids=[" ".join(a) for _, a in SLOW_RUNS])
def test_generate_matches_single_process_tokens_more_layouts(n, args):
    _check(_run(n, *args), args)


# --- the cache in the programs: attention only; TP ranks their KV heads --------------------------


def _cached_graphs(family: str, static: bool = True, **overrides: object) -> list[torch.export.ExportedProgram]:
    """The prefill and decode graphs dynamo hands the backend under ``generate()`` with a static
    cache (or transformers' default DynamicCache), exported as the backend exports them."""
    import transformers
    from torch._guards import tracing

    from afd_compile.backend.lift import Lifted as _Lifted
    from afd_compile.backend.lift import export_lifted as _export
    from afd_compile.models import FAMILIES

    cls, cfg_cls, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**kwargs, "num_hidden_layers": 2, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).eval()
    if static:
        model.generation_config.cache_implementation = "static"
    graphs = []

    def capture(gm, example_inputs):
        with tracing(None):
            lifted = _Lifted(gm, example_inputs)
            graphs.append(_export(lifted, [example_inputs[i] for i in lifted.user_positions]))
        return lambda *args: lifted(*[args[i] for i in lifted.user_positions])

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=capture, dynamic=True)
    ids = torch.randint(1, 128, (2, 5))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                   pad_token_id=0)
    torch._dynamo.reset()
    assert len(graphs) == 2 or not static  # prefill (allocates the cache) and decode (reads and writes it)
    return graphs


def _cache_writes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target == torch.ops.aten.index_copy_.default]


@pytest.fixture(scope="module")
def llama_cached():
    return _cached_graphs("llama")


def test_the_cache_stays_with_attention_and_the_ffn_program_has_none(llama_cached):
    from afd_compile.split_api import split

    for ep in llama_cached:
        gm = ep.module()
        caches = {n.args[0].name for n in _cache_writes(gm)}
        assert len(caches) == 4  # K and V of 2 layers
        result = split(gm)
        attention, ffn = result.attention, result.ffn
        assert len(_cache_writes(attention)) == 4
        assert not _cache_writes(ffn)
        assert [n.name for n in ffn.graph.nodes if n.op == "placeholder"] == ["token_slots"]
        sizes = {tuple(t.shape) for t in [*ffn.parameters(), *ffn.buffers()]}
        assert all(len(s) == 2 for s in sizes), sizes  # MLP weights only: no [batch, heads, len, dim] cache
        assert not any(n.meta.get("afd.role") and n.meta["afd.role"].role.name == "FFN" for n in
                       _cache_writes(gm))


@pytest.mark.parametrize(("attn_tp", "slices"), [(2, 2), (4, 2)])  # 2 KV heads: split, then replicated x2
def test_a_tp_rank_writes_and_reads_only_its_kv_heads(llama_cached, attn_tp, slices):
    from afd_compile.deploy import tp_rank_program
    from afd_compile.passes.roles import POLICIES, annotate_roles
    from afd_compile.scatter import TPLayout

    decode = llama_cached[1].module()
    annotate_roles(decode, POLICIES["default"])
    for rank in range(attn_tp):
        prog = tp_rank_program(decode, TPLayout(attn_tp, 1), rank)
        states = prog.shards.states
        assert len(states) == 4 and {(s.dim, s.size, s.slices, s.parts) for s in states} == {(1, 2, slices, attn_tp)}
        narrows = [n for n in prog.program.graph.nodes if n.target == torch.ops.aten.narrow.default]
        start = rank // (attn_tp // slices)
        assert sorted(n.args[1:] for n in narrows) == [(1, start, 1)] * 4
        assert all(w.args[0] in narrows for w in _cache_writes(prog.program))


def test_a_backend_tp_rank_holds_only_its_kv_heads(llama_cached):
    # under the backend HF owns the cache: the program takes (decode) or allocates (prefill) the
    # rank's slice instead of narrowing HF's whole cache, and HF keeps a placeholder
    from afd_compile.deploy import tp_rank_program
    from afd_compile.passes.local_state import hold_local_states
    from afd_compile.passes.roles import POLICIES, annotate_roles
    from afd_compile.scatter import TPLayout

    held = {}
    for name, ep in zip(("prefill", "decode"), llama_cached, strict=True):
        gm = ep.module()
        annotate_roles(gm, POLICIES["default"])
        tp = tp_rank_program(gm, TPLayout(2, 1), 1)
        held[name] = hold_local_states(tp.program, [s.node for s in tp.shards.states])
        prog = tp.program
        assert len(held[name]) == 4
        assert {(h.dim, h.start, h.length, h.size) for h in held[name]} == {(1, 1, 1, 2)}
        assert not [n for n in prog.graph.nodes if n.target == torch.ops.aten.narrow.default]
        for w in _cache_writes(prog):  # written directly, one head
            assert w.args[0].meta["val"].shape[1] == 1 and w.args[0].meta["afd.held_state"] in held[name]
    assert all(h.input is None and len(h.outputs) == 1 for h in held["prefill"])  # allocated, returned
    assert all(h.input is not None and not h.outputs for h in held["decode"])  # received, updated in place


def test_the_state_store_exchanges_placeholders_for_slices(caplog):
    import gc

    from afd_compile.passes.local_state import HeldState
    from afd_compile.state_store import STORE, bind_inputs, bind_outputs, held_state_bytes

    alloc = HeldState("zeros", None, (1,), dim=1, start=2, length=2, size=4)
    local = torch.randn(3, 2, 8, 5)
    logits, stand_in = bind_outputs([alloc], [], (torch.ones(1), local))
    assert stand_in.shape == (3, 4, 8, 5) and stand_in.untyped_storage().nbytes() == 4  # one element
    assert held_state_bytes([stand_in]) == local.numel() * 4
    stand_in.zero_()  # HF's reset() of the placeholder: the slice is untouched
    received = HeldState("user_4", 0, (), dim=1, start=2, length=2, size=4)
    assert bind_inputs([received], [stand_in])[0] is local
    whole = torch.randn(3, 4, 8, 5)  # a cache HF allocated eagerly: a view of this rank's heads
    view = bind_inputs([received], [whole])[0]
    assert view.data_ptr() == whole[:, 2].data_ptr() and view.shape == (3, 2, 8, 5)
    assert "holds all 4 heads" in caplog.text
    with pytest.raises(ValueError, match="cache input user_4 has 2 entries along dim 1, expected 4"):
        bind_inputs([received], [torch.randn(3, 2, 8, 5)])
    before = STORE.bytes_held()
    del stand_in
    gc.collect()
    assert STORE.bytes_held() == before - local.numel() * 4  # dropped with its placeholder


def test_tp_refuses_a_cache_that_grows_by_concatenation():
    # transformers' default DynamicCache appends each step's K/V with cat: TP cannot keep its heads
    # in place; the error says so and names the fix (a static cache). AFD needs no change: the
    # cache, whatever its kind, stays on the attention side
    from afd_compile.deploy import tp_rank_program
    from afd_compile.passes.roles import POLICIES, annotate_roles
    from afd_compile.passes.shard import ShardError
    from afd_compile.scatter import TPLayout

    gm = _cached_graphs("llama", static=False)[0].module()
    annotate_roles(gm, POLICIES["default"])
    with pytest.raises(ShardError, match=r"a KV cache that grows by concatenation \(transformers' DynamicCache\).*"
                                         r"cache_implementation = 'static'"):
        tp_rank_program(gm, TPLayout(2, 1), 0)


def test_a_cache_written_along_its_split_dim_is_refused():
    from afd_compile.passes.shard import ShardError
    from afd_compile.passes.shard.follow import _write_into_state
    from afd_compile.passes.shard.operands import Track

    g = torch.fx.Graph()
    cache, pos, k = g.placeholder("cache"), g.placeholder("pos"), g.placeholder("k")
    cache.meta["val"], k.meta["val"] = torch.empty(2, 2, 8, 4), torch.empty(2, 1, 1, 4)
    write = g.call_function(torch.ops.aten.index_copy_.default, (cache, 1, pos, k))
    t = Track({k: 1}, {k: 2}, {k: None}, {}, {}, {}, [])
    with pytest.raises(ShardError, match="index_copy_.* indexes the split dim 1 of cache"):
        _write_into_state(write, t, "layer 0")


# --- an FFN rank serves attention ranks that stop at different steps ---------------------------


def _leaving(rank: int, world: int, steps: list[int]) -> object:
    import torch.distributed as dist

    from afd_compile.comm import AFDCommunicator
    from afd_compile.runtime import STOP, FFNWorker

    if rank > 0:
        for _ in range(steps[rank - 1]):
            dist.send(torch.tensor([3 + rank, 1], dtype=torch.int64), 0)
        dist.send(torch.tensor([STOP, 1], dtype=torch.int64), 0)
        return None
    seen: list[tuple[int, ...]] = []
    worker = FFNWorker(lambda slots: None, AFDCommunicator("ffn", 0, tuple(range(1, world)), check_wire=True),
                       torch.device("cpu"))
    served = worker.serve(on_step=seen.append)
    return served, seen


def test_an_ffn_rank_serves_until_the_last_attention_rank_stops():
    from afd_compile.runtime import run_local

    served, seen = run_local(_leaving, 3, [2, 4], timeout_s=30)[0]
    assert served == 4
    assert seen == [(4, 5), (4, 5), (0, 5), (0, 5)]  # rank 1 left after 2 steps; rank 2 served on


def test_a_program_returning_the_cache_it_allocates_is_not_graph_captured(llama_cached):
    # a compiled prefill step allocates HF's static cache (zeros + index_copy_) and returns it for
    # the caller to keep: a CUDA graph's outputs are overwritten by its next replay, so that
    # program runs without capture (and cudagraphs=True is refused naming the output)
    from afd_compile.backend import BackendOptionError, PerLayout, returned_state
    from afd_compile.deploy import tp_rank_program
    from afd_compile.passes.roles import POLICIES, annotate_roles
    from afd_compile.scatter import TPLayout
    from afd_compile.split_api import split

    prefill, decode = llama_cached
    attention = split(prefill.module()).attention
    assert len(returned_state(attention)) == 4  # K and V of 2 layers
    gm = prefill.module()
    annotate_roles(gm, POLICIES["default"])
    tp = tp_rank_program(gm, TPLayout(2, 1), 1).program  # the cache is narrowed: written through a view
    assert len(returned_state(tp)) == 4
    assert returned_state(split(decode.module()).attention) == []  # decode updates the caller's cache
    assert PerLayout(attention, "k", True, None, "rank 1 attention").cudagraphs is False
    with pytest.raises(BackendOptionError, match="rank 1 attention: cudagraphs=True, "
                       "but the program returns index_copy"):
        PerLayout(attention, "k", True, True, "rank 1 attention")


# --- the CLI on programs exported with their cache ----------------------------------------------


#: the static batch each family's cache program is exported with: Qwen3-MoE with 3, which neither
#: 2 micro-batches (rows 2 + 1) nor the tokens an expert-parallel rank receives need divide
CACHE_BATCH = {"qwen3_moe": 3}


@pytest.fixture(scope="module")
def cached_pt2(tmp_path_factory):
    """family -> a .pt2 exported with transformers' own exporter for caches (batch CACHE_BATCH or 2,
    32 positions)."""
    from afd_compile.models import build_hf, export_cached_lm

    out = tmp_path_factory.mktemp("cached")
    paths: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in paths:
            path = str(out / f"{family}_cache.pt2")
            model = build_hf(family, num_layers=2)
            torch.export.save(export_cached_lm(model, batch=CACHE_BATCH.get(family, 2)), path)
            paths[family] = path
        return paths[family]

    return get


@pytest.fixture(scope="module")
def static_pt2(tmp_path_factory):
    """family -> a .pt2 of transformers' cache exporter with every shape static (its default: one
    token per sequence; batch CACHE_BATCH or 2)."""
    from afd_compile.models import build_hf, export_cached_lm

    out = tmp_path_factory.mktemp("static")
    paths: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in paths:
            paths[family] = str(out / f"{family}_static.pt2")
            model = build_hf(family, num_layers=2)
            torch.export.save(export_cached_lm(model, batch=CACHE_BATCH.get(family, 2), seq=1, static=True),
                              paths[family])
        return paths[family]

    return get


#: fan-in and FFN groups over a fixed-batch, fixed-length export: the FFN program takes any multiple
#: of the static tokens (passes/ffn_tokens.py)
STATIC_DECODE = [("qwen3_moe", ("-A", "3", "-F", "2", "--stages", "2")),  # 2 peers and 1; micro-batches 2 + 1
                 ("qwen3_moe", ("-A", "2", "-F", "2", "--ffn-tp", "2")),
                 ("llama", ("-A", "2", "-F", "1"))]


@pytest.mark.parametrize(("family", "layout"), STATIC_DECODE, ids=[f"{f}-{' '.join(a)}" for f, a in STATIC_DECODE])
def test_fan_in_of_a_fixed_batch_fixed_length_cache_export(static_pt2, family, layout):
    proc = _cli("verify", static_pt2(family), *layout, "--decode-steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a prefill of 1 positions and 4 decode steps of 1" in proc.stdout
    assert re.search(r"^verify: OK max_rel_err=\S+ tol=\S+$", proc.stdout.strip().splitlines()[-1]), proc.stdout[-1000:]
    batch = CACHE_BATCH.get(family, 2)
    found = re.findall(r"attention: batches (\[[^\]]*\])", proc.stdout)
    assert found and all(b == str([batch] * 5) for b in found)


def test_a_static_token_ffn_program_takes_any_multiple_of_its_tokens(static_pt2):
    # the FFN program's views say the step's rows where the export said the batch
    from afd_compile.layout import AFDLayout
    from afd_compile.programs import fresh_module, load_program
    from afd_compile.split_api import split

    ep = load_program(static_pt2("qwen3_moe"))
    alone = split(fresh_module(ep), layout=AFDLayout(1, 1)).ffn
    fan_in = split(fresh_module(ep), layout=AFDLayout(2, 1)).ffn
    views = lambda g: [n.args[1] for n in g.graph.nodes if n.target == torch.ops.aten.view.default]  # noqa: E731
    assert [3, 1, 64] in views(alone)  # as exported: batch 3, one token each
    assert not any(3 in v for v in views(fan_in))
    assert all(isinstance(v[0], torch.fx.Node) for v in views(fan_in) if len(v) == 3)


def _cli(*args: str) -> Ran:
    return run_cli(*args)


DECODE = [("qwen3_moe", ("--tp", "2")),
          # the experts over all-to-all on a static batch of 3: a rank's share (2 or 1 of a decode
          # step's 3 tokens) is not a multiple of the batch the MoE views its tokens by
          ("qwen3_moe", ("--tp", "2", "--moe-a2a")),
          # each micro-batch its own cache rows (batch 3: rows 2 + 1, each padded to 3 tokens on the FFN
          # side), fan-in, and an expert-parallel FFN group running the same stages over a static batch
          ("qwen3_moe", ("-A", "3", "-F", "2", "--ffn-ep", "2", "--stages", "2")),
          # composed: two attention DP groups of TP 2 (each its own sequences and cache, sharded by
          # heads) and an FFN TP group of 2
          ("llama", ("-A", "4", "--attn-tp", "2", "-F", "2", "--ffn-tp", "2"))]
SLOW_DECODE = [("llama", ("--tp", "2")), ("qwen3_moe", ("--tp", "4", "--attn-dp", "2", "--moe-a2a")),
               ("llama", ("--tp", "2", "--dense-dp")), ("qwen3_moe", ("-A", "2", "-F", "2", "--ffn-ep", "2")),
               ("llama", ("-A", "1", "-F", "1")),
               ("llama", ("-A", "3", "-F", "2")), ("qwen3_moe", ("-A", "2", "-F", "1", "--stages", "3")),
               ("llama", ("-A", "3", "-F", "2", "--stages", "2")),
               ("qwen3_moe", ("-A", "3", "-F", "2", "--ffn-tp", "2")),
               # each DP group its own sequences and cache (in the default run: generate() with an idle DP
               # group, and DP groups of attention TP inside AFD above)
               ("llama", ("--tp", "4", "--attn-dp", "2")), ("llama", ("-A", "2", "-F", "1")), ("llama", ("--tp", "4")),
               ("qwen3_moe", ("-A", "1", "-F", "1")), ("qwen3_moe", ("-A", "2", "-F", "1")),
               ("qwen3_moe", ("-A", "3", "-F", "2")), ("qwen3_moe", ("--tp", "4", "--attn-dp", "2"))]


def _check_decode(proc: Ran, batch: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a prefill of 4 positions and 6 decode steps of 1" in proc.stdout
    assert re.search(r"^verify: OK max_rel_err=\S+ tol=\S+$", proc.stdout.strip().splitlines()[-1]), proc.stdout[-1000:]
    for batches in re.findall(r"batches (\[[^\]]*\])", proc.stdout):
        assert batches == str([batch] * 7)  # every rank compared 7 steps of its sequences


@pytest.mark.parametrize(("family", "layout"), DECODE, ids=[f"{f}-{' '.join(a)}" for f, a in DECODE])
def test_verify_decode_steps_on_exported_cache_programs(cached_pt2, family, layout):
    _check_decode(_cli("verify", cached_pt2(family), *layout, "--decode-steps", "6"), CACHE_BATCH.get(family, 2))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), SLOW_DECODE, ids=[f"{f}-{' '.join(a)}" for f, a in SLOW_DECODE])
def test_verify_decode_steps_more_layouts(cached_pt2, family, layout):
    _check_decode(_cli("verify", cached_pt2(family), *layout, "--decode-steps", "6"), CACHE_BATCH.get(family, 2))


def test_groups_over_a_static_batch_of_3_are_planned(cached_pt2, capsys):
    # the group's token count is a multiple of the batch, as its own is (the program views its
    # tokens as [3, T // 3, H]): planning it traced a group count of 8 once
    from afd_compile.cli import main

    assert main(["plan", cached_pt2("qwen3_moe"), "-A", "3", "-F", "2", "--ffn-tp", "2", "-q"]) == 0
    assert "ffn tp: groups [[0, 1]]; FFN TP rank 0 of 2" in capsys.readouterr().out
    # TP with the experts over all-to-all: each rank's share of the batch's tokens (was refused)
    assert main(["plan", cached_pt2("qwen3_moe"), "--tp", "2", "--moe-a2a", "-q"]) == 0


def test_decode_steps_read_the_cache(cached_pt2):
    # what verify compares depends on the cache: a decode step of the same tokens after a
    # different prefill gives other logits (so a split that lost its cache could not pass)
    from afd_compile.programs import flat_inputs, fresh_module, load_program
    from afd_compile.verify import DecodeSpec

    ep = load_program(cached_pt2("llama"))
    spec = DecodeSpec.of(ep)
    assert spec is not None and spec.prefill == 4 and spec.step_tokens == 1 and spec.cache_len == 32
    assert len(spec.state) == 6  # K, V and the write position of 2 layers
    inputs = flat_inputs(ep)
    a, b = fresh_module(ep), fresh_module(ep)
    with torch.no_grad():
        a(*spec.inputs(inputs, 0, salt=0))
        b(*spec.inputs(inputs, 0, salt=5))  # another prefill
        out_a, out_b = a(*spec.inputs(inputs, 1, salt=0)), b(*spec.inputs(inputs, 1, salt=0))
    assert (out_a[0] - out_b[0]).abs().max() > 1e-3


def test_static_cache_stages_cut_the_batch_only(cached_pt2):
    # a static cache fixes the batch (2) and writes it as a constant into every view; the KV
    # head count is 2 as well, and only the batch's 2s may change. One process, no transfers:
    # the model's own program as 2 micro-batches of 1 sequence, each writing its own cache row,
    # against the program itself, over a prefill and two decode steps
    from afd_compile.passes.batch_dims import plan_batch
    from afd_compile.passes.stages import stage_attention_program
    from afd_compile.programs import flat_inputs, fresh_module, load_program
    from afd_compile.verify import DecodeSpec

    ep = load_program(cached_pt2("llama"))
    spec, inputs = DecodeSpec.of(ep), flat_inputs(ep)
    whole, staged = fresh_module(ep), stage_attention_program(fresh_module(ep), 2)
    plan = plan_batch(fresh_module(ep), 2, {"input_ids": 0})
    carried = dict(plan.inputs)  # input_ids and the K and V caches of 2 layers, all along dim 0
    assert carried.pop("input_ids") == 0 and len(carried) == 4 and set(carried.values()) == {0}, plan.describe()
    assert all(written in spec.state for written in carried), (carried, spec.state)  # the write positions are not
    assert plan.sites and all(site.index == 0 and site.value == 2 for site in plan.sites)
    expands = [n.args[1] for n in staged.graph.nodes if n.target == torch.ops.aten.expand.default
               and len(n.args[1]) == 5]
    assert expands and all(list(a) == [1, 2, 2, 32, 16] for a in expands), expands  # [b, kv heads, n_rep, L, d]
    with torch.no_grad():
        for step in range(3):
            x = spec.inputs(inputs, step, salt=0)
            want, got = whole(*x)[0], staged(*x)[0]
            assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--decode-steps", "40"), "need 44 cache positions, the cache holds 32"),
        (("--decode-steps", "2", "--tokens", "1"), "cannot resize the batch of a program whose KV cache fixes it"),
        (("--decode-steps", "-1"), "argument --decode-steps: must be in [0, 100000], got -1"),
    ],
)
def test_decode_step_requests_are_checked(cached_pt2, args, message):
    layout = () if "--tp" in args else ("-A", "1", "-F", "1")
    proc = _cli("verify", cached_pt2("llama"), *layout, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_decode_steps_need_a_program_with_a_cache(exported):
    proc = _cli("verify", exported("llama2")[1], "-A", "1", "-F", "1", "--decode-steps", "2")
    assert proc.returncode == 2 and "holds no KV cache to decode with" in proc.stderr, proc.stderr[-2000:]


def test_golden_of_a_cached_model_split(cached_pt2, update_goldens):
    # the AFD split of a program exported with its KV cache: the attention program keeps every
    # cache write (and the cache buffers), the FFN program has none; recorded per transformers
    # minor release (the exporter's graph is its code)
    import transformers

    from afd_compile.golden import cut_window_lines, graph_lines, graph_text
    from afd_compile.passes.graph_utils import written_attrs
    from afd_compile.programs import fresh_module, load_program
    from afd_compile.split_api import split

    result = split(fresh_module(load_program(cached_pt2("llama"))))
    state = written_attrs(result.attention)
    assert not written_attrs(result.ffn)
    text = "\n".join([
        "# AFD split of HF Llama exported with TorchExportableModuleForDecoderOnlyLM (batch 2, 32 positions)",
        f"# attention program: buffers written in place {sorted(state)}",
        *[line for line in graph_lines(result.attention, shapes=False) if "index_copy_" in line
          or "aten.copy_" in line],
        "## attention program, around each cut",
        *cut_window_lines(result.attention),
        "## ffn program (structure)",
        graph_text(result.ffn, shapes=False).rstrip("\n"),
    ]) + "\n"
    version = ".".join(transformers.__version__.split(".")[:2])
    path = os.path.join(os.path.dirname(__file__), "golden", f"afd_llama2_cached_1A1F.transformers-{version}.txt")
    if update_goldens:
        with open(path, "w") as fh:
            fh.write(text)
    if not os.path.exists(path):
        pytest.skip(f"no golden recorded for this transformers release ({path}); run --update-goldens to add one")
    with open(path) as fh:
        assert text == fh.read(), f"{path} changed; if intended, rerun with --update-goldens and explain it in the " \
            "commit"


def test_plan_shows_the_cache_bytes_per_rank(cached_pt2):
    import json

    afd = _cli("plan", cached_pt2("llama"), "-A", "2", "-F", "1", "--json")
    assert afd.returncode == 0, afd.stderr[-2000:]
    cache = json.loads(afd.stdout)["cache"]
    full = 4 * 2 * 2 * 32 * 16 * 4 + 2 * 8  # K and V of 2 layers [2, 2, 32, 16] fp32, 2 int64 positions
    assert cache["bytes_per_attention_rank"] == full and cache["bytes_per_ffn_rank"] == 0
    tp = _cli("plan", cached_pt2("llama"), "--tp", "2")
    assert tp.returncode == 0, tp.stderr[-2000:]
    assert f"KV cache: 6 buffers updated in place, {(full - 16) // 2 + 16} bytes per rank of {full}" in tp.stdout


def _rewritten_cache_rank(r: int, world: int, folder: str, original: str) -> tuple:
    from afd_compile.compare import max_rel_err
    from afd_compile.deploy import load_rewritten_worker
    from afd_compile.programs import flat_inputs, fresh_module, load_program
    from afd_compile.runtime import AttentionWorker
    from afd_compile.verify import DecodeSpec

    w = load_rewritten_worker(folder, r)
    if not isinstance(w, AttentionWorker):
        return w.serve(), w.comm.stage_transfers
    ep = load_program(original)
    spec, inputs, ref = DecodeSpec.of(ep), flat_inputs(ep), fresh_module(ep)
    errs = []
    try:
        with torch.no_grad():
            for step in range(5):  # a prefill and 4 decode steps
                x = spec.inputs(inputs, step, salt=7 * r)
                errs.append(max_rel_err(w.step(*x), ref(*x)))
    finally:
        w.stop()
    return max(errs), sorted(w.staged)


def test_rewrite_writes_programs_that_carry_their_cache(cached_pt2, tmp_path):
    # rewrite on a cached program: the attention program holds the cache buffers (a TP rank only
    # its KV heads), the FFN program none; the rewritten AFD programs, re-loaded and run as 2
    # micro-batches (each its own cache row of the static batch of 2), decode as the original does
    import json

    from afd_compile.programs import load_program
    from afd_compile.runtime import run_local

    path = cached_pt2("llama")
    afd, tp = tmp_path / "afd", tmp_path / "tp"
    for out, layout in ((afd, ("-A", "2", "-F", "1", "--stages", "2")), (tp, ("--tp", "2"))):
        proc = _cli("rewrite", path, *layout, "-o", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((afd / "plan.json").read_text())
    assert plan["cache"]["bytes_per_ffn_rank"] == 0 and plan["stages"] == 2 and plan["static_batch"] == 2
    shapes = {k: tuple(v.shape) for k, v in load_program(str(tp / "rank1.pt2")).state_dict.items() if "cache" in k}
    assert shapes and set(shapes.values()) == {(2, 1, 32, 16)}  # 1 of 2 KV heads
    assert not [k for k in load_program(str(afd / "ffn.pt2")).state_dict if "cache" in k]
    # (the ranks are processes of their own, forked from a launcher that never saw the rewrite)
    res = run_local(_rewritten_cache_rank, 3, str(afd), path, timeout_s=120)
    (served, transfers), (err1, staged1), (err2, staged2) = res[0], res[1], res[2]
    assert served == 5 and max(err1, err2) <= 1e-5 and staged1 == staged2 == [2]
    assert transfers.get(0, 0) > 0 and transfers.get(1, 0) == transfers[0]  # both micro-batches ran
