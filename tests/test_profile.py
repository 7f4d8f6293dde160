"""afd-compile profile and plan --estimate / --search on CPU: a valid profile (timings not asserted),
the estimate's output from a fixed profile as a golden, bad profiles refused in one line."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from afd_compile.cli import main
from afd_compile.estimate import ModelFacts
from afd_compile.passes.loopback import loopback_exchange
from afd_compile.profile import timed_rounds
from afd_compile.profile_read import PROFILE_FORMAT, read_profile
from afd_compile.saved import sha256_of

GOLDEN_PROFILE = os.path.join(os.path.dirname(__file__), "golden", "profile_llama2.json")


@pytest.fixture(scope="module")
def profiled(exported, tmp_path_factory):
    """(model path, profile path) of a quick profile of the 2-layer Llama on the CPU, one layer timed."""
    _, path = exported("llama2")
    out = str(tmp_path_factory.mktemp("profile") / "p.json")
    assert main(["profile", path, "-o", out, "--device", "cpu", "--layers", "1", "--tokens", "1,4",
                 "--contexts", "32,64", "--kv-batches", "1,2", "--iters", "2", "--rounds", "2",
                 "--no-compile", "-q"]) == 0
    return path, out


def test_timed_rounds_keeps_each_rows_quickest_round():
    """A round goes over every (size, key) before the next: a slow spell (here the 3rd to 6th calls)
    lands on one round of each row, and each row keeps its quickest."""
    calls = []

    def measure(key, t):
        calls.append((key, t))
        slow = 3 <= len(calls) <= 6
        return {"median_us": 10.0 * t + (100.0 if slow else len(calls) % 2), "p10_us": 0.0, "p90_us": 0.0}

    rows = timed_rounds(measure, ("attention", "ffn"), (1, 2), 2)
    assert calls == [("attention", 1), ("ffn", 1), ("attention", 2), ("ffn", 2)] * 2
    assert rows == {"attention": [{"tokens": 1, "median_us": 11.0, "p10_us": 0.0, "p90_us": 0.0,
                                   "rounds_us": [11.0, 110.0]},
                                  {"tokens": 2, "median_us": 21.0, "p10_us": 0.0, "p90_us": 0.0,
                                   "rounds_us": [120.0, 21.0]}],
                    "ffn": [{"rows": 1, "median_us": 10.0, "p10_us": 0.0, "p90_us": 0.0, "rounds_us": [10.0, 110.0]},
                            {"rows": 2, "median_us": 20.0, "p10_us": 0.0, "p90_us": 0.0,
                             "rounds_us": [120.0, 20.0]}]}


def test_profile_writes_what_the_estimate_reads(profiled):
    path, out = profiled
    with open(out) as f:
        rec = json.load(f)
    assert rec["format"] == PROFILE_FORMAT and rec["device"]["type"] == "cpu" and rec["compiled"] is False
    assert rec["model"]["sha256"] == sha256_of(path)
    assert (rec["model"]["layers"], rec["model"]["profiled_layers"]) == (2, 1)  # (the model's depth, the layers timed)
    assert [r["tokens"] for r in rec["attention"]] == [1, 4] and [r["rows"] for r in rec["ffn"]] == [1, 4]
    # (one layer timed of two: the second depth is none, the residual stream passed through)
    second = rec["second_depth"]
    assert second["layers"] == 0
    assert [[r["tokens" if k != "ffn" else "rows"] for r in second[k]] for k in ("attention", "ffn", "no_layout")] \
        == [[1, 4]] * 3
    assert {(r["batch"], r["context"]) for r in rec["kv"]} == {(1, 32), (2, 32), (1, 64), (2, 64)}
    assert all(r["median_us"] > 0 and r["p10_us"] <= r["median_us"] <= r["p90_us"]
               for key in ("attention", "ffn", "no_layout", "head", "kv") for r in rec[key])
    # (--rounds 2: each program's row timed twice, its quickest round kept, or lower still where retimed)
    assert rec["rounds"] == 2 and all(len(r["rounds_us"]) == 2 and r["median_us"] <= min(r["rounds_us"])
                                      for key in ("attention", "ffn", "no_layout", "head") for r in rec[key])
    costs, facts, _ = read_profile(out, path)
    # the 2-layer Llama (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 128, fp32); the final
    # norm and the rotary frequencies (8) counted with the layers' attention side
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 2
    assert facts == ModelFacts(layers=2, hidden=64, attention_bytes=4 * (layer + (64 + 8) // 2),
                               ffn_bytes=4 * 3 * 64 * 128, other_bytes=4 * 2 * 128 * 64, kv_bytes=2 * 2 * 16 * 4,
                               kv_heads=2, to_ffn_bytes=64 * 4, to_attention_bytes=64 * 4, heads=4)
    assert read_profile(out, path, layers=80)[1].layers == 80
    assert costs.call_attention is not None and costs.call_model is not None  # (from the second depth)


def test_plan_estimate_reads_a_fresh_profile(profiled, capsys):
    path, out = profiled
    assert main(["plan", path, "--estimate", out, "-A", "1", "-F", "1", "--batch", "2", "--context", "64"]) == 0
    text = capsys.readouterr().out
    assert "a call once a step (at 1 sequence: attention rank " in text and "AFD 1A1F S=1" in text, text


@pytest.mark.parametrize("name,shape", [
    ("llama2", (4, 2, 16, 16)),  # GQA: the key repeated from 2 heads
    ("deepseek_v3", (4, 4, 16, 16)),  # MLA as HF traces it: a per-head key concatenated with a shared rotary part
    ("gemma2", (4, 2, 16, 16)),  # written out: matmul, soft-capped scores, softmax, matmul; GQA by repeat_kv
    ("bloom", (4, 4, 16, 16)),  # written out over batch x heads: baddbmm with ALiBi, softmax, bmm
    ("gpt_oss", (4, 2, 16, 16)),  # written out with a sink logit per head joined to the scores (and sliced off)
])
def test_attention_shape_reads_the_kv_heads_the_cache_holds(exported, name, shape):
    from afd_compile.profile import attention_shape
    from afd_compile.programs import fresh_module

    got = attention_shape(fresh_module(exported(name)[0]))
    assert got[:4] == shape and got[5] == ("sdpa" if name in ("llama2", "deepseek_v3") else "eager")


def test_a_model_writing_its_attention_out_is_profiled(exported, tmp_path, capsys):
    """Gemma-2 as HF writes it (no SDPA): profiled, its KV read timed as the written-out form, and the
    estimate says so."""
    _, path = exported("gemma2")
    out = str(tmp_path / "p.json")
    assert main(["profile", path, "-o", out, "--device", "cpu", "--tokens", "1,4", "--contexts", "32,64",
                 "--kv-batches", "1,2", "--iters", "2", "--rounds", "1", "--no-compile"]) == 0
    assert "the attention is written out (no SDPA" in capsys.readouterr().out
    with open(out) as f:
        assert json.load(f)["model"]["attention_form"] == "eager"
    assert main(["plan", path, "--estimate", out, "-A", "1", "-F", "1", "--batch", "2", "--context", "64"]) == 0
    assert "note: the model writes its attention out (no SDPA)" in capsys.readouterr().out


def test_the_exchange_taken_out_keeps_each_roles_compute(exported):
    from afd_compile.deploy import plan_afd
    from afd_compile.programs import flat_inputs
    from afd_compile.split_api import SplitConfig

    ep, _ = exported("llama2")
    result = plan_afd(ep, None, SplitConfig())
    attention, ffn = copy.deepcopy(result.attention), copy.deepcopy(result.ffn)
    assert loopback_exchange(attention) == [] and loopback_exchange(ffn) == ["afd_loopback_0"]
    for gm in (attention, ffn):
        assert not any(str(n.target).startswith("afd.") for n in gm.graph.nodes)
    # the FFN program without its exchange is each layer's MLP on the rows its first layer received (the
    # attention side's rows: fed its own output, an MoE's routing collapses), every layer's output returned
    x = torch.randn(3, 64)
    got = ffn(torch.empty(3), x)
    assert len(got) == 2
    for i in range(2):
        w = {k: ep.state_dict[f"model.model.layers.{i}.mlp.{k}_proj.weight"] for k in ("gate", "up", "down")}
        want = (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    assert attention(*flat_inputs(ep)) is not None
    # for the profile, the attention program also returns what it sent at layer 0: the FFN program's rows
    fed = copy.deepcopy(result.attention)
    loopback_exchange(fed, return_first_sent=True)
    out = fed(*flat_inputs(ep))
    x = flat_inputs(ep)[0]
    assert out[-1].shape == (x.numel(), 64)
    ref = attention(*flat_inputs(ep))
    torch.testing.assert_close(out[0], ref[0] if isinstance(ref, (tuple, list)) else ref)


# (OLMo-2: export asserts a dtype in layer 1 that layer 0 does not: a check, not a difference in structure)
@pytest.mark.parametrize("family,layers,keep", [("llama", 3, 2), ("qwen3_moe", 2, 1), ("olmo2", 2, 1)])
def test_keep_layers_is_the_models_first_layers(family, layers, keep):
    """profile --layers K: each program keeps its first K layers (and only their weights); the model's
    program then computes what the model cut to K layers computes."""
    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile import inputs_at, role_programs
    from afd_compile.programs import flat_inputs

    model = build_hf(family, num_layers=layers)
    ep = export_lm(model, vocab_size=128)
    whole, _, facts = role_programs(copy.deepcopy(ep), torch.device("cpu"))
    cut, _, cut_facts = role_programs(ep, torch.device("cpu"), layers=keep)
    assert cut_facts.pop("layer_kinds") == facts.pop("layer_kinds") == [0] * layers  # (one kind)
    assert cut_facts == facts and facts["layers"] == layers  # (the facts: of the whole model)
    for kind in whole:
        weights = lambda gm: sum(t.numel() for t in [*gm.parameters(), *gm.buffers()])  # noqa: E731
        assert weights(cut[kind]) < weights(whole[kind])
    ids = inputs_at(cut["model"], flat_inputs(ep), 3, torch.device("cpu"))
    decoder = model.model.model  # (LogitsOnly -> ForCausalLM -> the decoder)
    decoder.layers = decoder.layers[:keep]
    with torch.no_grad():
        want = model(ids[0])
    got = cut["model"](*ids)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_keep_no_layer_passes_the_stream_through(family):
    """keep_layers(gm, 0): what a program costs besides its layers (profile's second depth of a one-layer
    profile); the model's program then computes what the model with no layer computes (the embedding
    through the final norm and the head)."""
    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile import inputs_at, role_programs
    from afd_compile.programs import flat_inputs

    model = build_hf(family, num_layers=2)
    ep = export_lm(model, vocab_size=128)
    none, _, _ = role_programs(ep, torch.device("cpu"), layers=0)
    from afd_compile.passes.graph_utils import layers_of

    assert [layers_of(gm) for gm in none.values()] == [{}, {}, {}]
    assert not any(".layers." in name for gm in none.values() for name, _ in gm.named_parameters())
    ids = inputs_at(none["model"], flat_inputs(ep), 3, torch.device("cpu"))
    model.model.model.layers = model.model.model.layers[:0]
    with torch.no_grad():
        want = model(ids[0])
    got = none["model"](*ids)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, 64)
    got = none["ffn"](torch.empty(3), x)  # (the FFN program with no layer: its rows back)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, x)


def test_a_programs_call_from_two_depths():
    """read_profile splits each program's time into its layers and its call from the two depths, by
    hand: 4 layers at 500 µs, 3 at 400 -> 100 a layer, 100 the call."""
    from afd_compile.profile_read import call_curves

    rec = {"attention": [{"tokens": 1, "median_us": 500.0}, {"tokens": 8, "median_us": 900.0}],
           "ffn": [{"rows": 1, "median_us": 420.0}, {"rows": 8, "median_us": 420.0}],
           "no_layout": [{"tokens": 1, "median_us": 1000.0}, {"tokens": 8, "median_us": 1000.0}],
           "second_depth": {"layers": 3, "attention": [{"tokens": 1, "median_us": 400.0},
                                                       {"tokens": 8, "median_us": 700.0}],
                            "ffn": [{"rows": 8, "median_us": 320.0}],
                            "no_layout": [{"tokens": 1, "median_us": 1010.0}]}}
    calls = call_curves(rec, 4, "p.json")
    assert calls["attention"].points == ((1, 100.0), (8, 100.0))  # (at 8: 200 a layer, 900 - 800)
    assert calls["ffn"].points == ((8, 20.0),)
    assert calls["no_layout"].points == ((1, 1000.0),)  # (a deeper program no slower: all of it the call, clamped)
    assert call_curves({k: v for k, v in rec.items() if k != "second_depth"}, 4, "p.json") == {}


def test_keep_layers_keeps_the_first_k_of_each_kind(exported):
    from afd_compile.passes.graph_utils import layers_of
    from afd_compile.passes.keep_layers import KeepLayersError, keep_layers, layer_kinds
    from afd_compile.passes.roles import annotate_roles
    from afd_compile.programs import fresh_module

    gm = fresh_module(exported("qwen3moe3_mixed")[0])  # (layer 1 a dense MLP, layers 0 and 2 MoE)
    annotate_roles(gm)
    assert layer_kinds(gm) == [0, 1, 0]
    with pytest.raises(KeepLayersError, match="keep -1 layers: give 0 or more"):
        keep_layers(gm, -1)
    with pytest.raises(KeepLayersError, match=r"graph: keep layers \[5\]: it has 3"):
        keep_layers(gm, [0, 5])
    assert keep_layers(copy.deepcopy(gm), 3) == 3  # (all of them: nothing to drop)
    assert keep_layers(gm, 1) == 3 and sorted(layers_of(gm)) == [0, 1]


def test_a_model_with_dense_first_layers_keeps_k_of_each_kind_and_each_kind_alone():
    """DeepSeek-V3-shaped, 2 dense layers then 2 MoE layers: the first layer of each kind (0 and 2) and
    the MoE layers alone compute what the model with just those layers computes."""
    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile import inputs_at, role_programs
    from afd_compile.programs import flat_inputs

    model = build_hf("deepseek_v3", num_layers=4, first_k_dense_replace=2)
    ep = export_lm(model, vocab_size=128)
    decoder, every = model.model.model, list(model.model.model.layers)
    for keep in (1, [2, 3]):
        cut, _, facts = role_programs(copy.deepcopy(ep), torch.device("cpu"), layers=keep)
        assert facts["layer_kinds"] == [0, 0, 1, 1]
        ids = inputs_at(cut["model"], flat_inputs(ep), 3, torch.device("cpu"))
        decoder.layers = torch.nn.ModuleList(every[i] for i in ([0, 2] if keep == 1 else keep))
        with torch.no_grad():
            want = model(ids[0])
        got = cut["model"](*ids)
        torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want, rtol=1e-5, atol=1e-6)
        kept = {name.split(".layers.")[1].split(".")[0] for gm in cut.values() for name, _ in gm.named_parameters()
                if ".layers." in name}
        assert kept == ({"0", "2"} if keep == 1 else {"2", "3"}), kept


def test_profile_of_layers_of_two_kinds_times_each_kind_and_weighs_them(exported, tmp_path, capsys):
    """profile --layers 1 of a model whose layers differ (MoE, dense, MoE): the first of each kind, and
    each kind alone; the estimate's layer is the kinds' layers weighted by their counts (2 MoE, 1 dense)."""
    _, path = exported("qwen3moe3_mixed")
    out = str(tmp_path / "p.json")
    assert main(["profile", path, "-o", out, "--device", "cpu", "--layers", "1", "--tokens", "1,4",
                 "--contexts", "32,64", "--kv-batches", "1,2", "--iters", "2", "--rounds", "1", "--no-compile"]) == 0
    said = capsys.readouterr().out
    assert "its layers are of 2 kinds (2 from layer 0, 1 from layer 1)" in said, said
    assert "2 of 3 layers timed (the first of each of 2 kinds, each kind also alone)" in said, said
    with open(out) as f:
        rec = json.load(f)
    assert rec["model"]["layer_kinds"] == [0, 1, 0] and rec["model"]["profiled_layers"] == 2
    assert [(c["kind"], c["layers"], c["first"], c["profiled_layers"]) for c in rec["kinds"]] == [(0, 2, 0, 1),
                                                                                                  (1, 1, 1, 1)]
    from afd_compile.profile_read import call_curves

    costs, facts, _ = read_profile(out, path)
    call = call_curves(rec, 2, out)["attention"]
    for t in (1, 4):
        moe, dense = ((c["attention"][(1, 4).index(t)]["median_us"] - call.at(t)) for c in rec["kinds"])
        assert costs.attention.at(t) == pytest.approx(max(0.0, moe) * 2 / 3 + max(0.0, dense) / 3)
    assert main(["plan", path, "--estimate", out, "-A", "2", "-F", "1"]) == 0
    assert "note: the model's layers are of 2 kinds" in capsys.readouterr().out


def test_an_export_of_fewer_layers_of_two_kinds_scales_the_last_kind_to_the_real_depth(tmp_path):
    """DeepSeek-V3's form exported with fewer layers (1 dense, then 2 MoE) and profiled whole: each kind
    is timed alone, and plan --layers 10 costs 1 dense and 9 MoE layers: time and weight bytes."""
    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile_read import call_curves

    path = str(tmp_path / "ds.pt2")
    torch.export.save(export_lm(build_hf("deepseek_v3", num_layers=3), vocab_size=128), path)
    out = str(tmp_path / "p.json")
    assert main(["profile", path, "-o", out, "--device", "cpu", "--tokens", "1,4", "--contexts", "32,64",
                 "--kv-batches", "1,2", "--iters", "2", "--rounds", "1", "--no-compile", "-q"]) == 0
    with open(out) as f:
        rec = json.load(f)
    m = rec["model"]
    assert m["layer_kinds"] == [0, 1, 1] and [c["layers"] for c in rec["kinds"]] == [1, 2]
    dense, moe = m["kind_bytes"]
    assert moe["ffn_bytes"] > dense["ffn_bytes"] and moe["attention_bytes"] >= dense["attention_bytes"]
    _, facts, _ = read_profile(out, path, layers=10)
    assert facts.layers == 10 and facts.ffn_bytes == (dense["ffn_bytes"] + 9 * moe["ffn_bytes"]) // 10
    _, given, _ = read_profile(out, path, layers=(3, 7))  # (plan --layers 3,7: the counts a kind, as given)
    assert given.layers == 10 and given.ffn_bytes == (3 * dense["ffn_bytes"] + 7 * moe["ffn_bytes"]) // 10
    costs, _, _ = read_profile(out, path, layers=10)
    once = call_curves(rec, 3, out)["ffn"]
    per = [max(0.0, c["ffn"][0]["median_us"] - once.at(1)) / c["profiled_layers"] for c in rec["kinds"]]
    assert costs.ffn.at(1) == pytest.approx((per[0] + 9 * per[1]) / 10)


@pytest.mark.parametrize("order,counts,layers,want", [
    ([0, 0, 1, 1, 1], [2, 3], 5, [2, 3]),         # as profiled
    ([0, 0, 1, 1, 1], [2, 3], 61, [2, 59]),       # runs (dense first): the last kind takes the layers added
    ([0, 1, 0, 1], [2, 2], 48, [24, 24]),         # interleaved: the shares kept
    ([0, 0, 1], [2, 1], 2, [4 / 3, 2 / 3]),       # fewer than the first runs hold: the shares kept
    ([0, 0, 1], [2, 1], (3, 58), [3, 58]),        # one count a kind, as given
    ([1, 1, 0], [1, 2], (60, 1), [60, 1]),        # a trailing kind differs: the user says which grows
])
def test_kind_counts(order, counts, layers, want):
    from afd_compile.profile_read import kind_counts

    rec = {"model": {"layer_kinds": order}, "kinds": [{"layers": c, "profiled_layers": 1} for c in counts]}
    assert kind_counts(rec, layers) == pytest.approx(want)
    if isinstance(layers, int):
        assert kind_counts({"model": {}}, layers) == []


def test_kind_counts_given_per_kind_must_name_each_kind():
    from afd_compile.profile_read import ProfileError, kind_counts

    rec = {"model": {"layer_kinds": [0, 1, 1]}, "kinds": [{"layers": 1, "profiled_layers": 1, "first": 0},
                                                        {"layers": 2, "profiled_layers": 1, "first": 1}]}
    with pytest.raises(ProfileError, match=r"--layers 3,58,2: 3 counts, but p.json has 2 kind\(s\) of layer "
                       r"\(first at layers \[0, 1\]\): give one count a kind"):
        kind_counts(rec, (3, 58, 2), "p.json")
    assert kind_counts({"model": {}}, (7,)) == []  # (one kind: the depth alone)


def test_profile_refuses_an_export_with_its_kv_cache(tmp_path, capsys):
    from afd_compile.models import build_hf, export_cached_lm

    path, out = tmp_path / "cached.pt2", tmp_path / "p.json"
    torch.export.save(export_cached_lm(build_hf("llama", num_layers=1), batch=2, max_cache_len=16), path)
    assert main(["profile", str(path), "-o", str(out), "--device", "cpu", "--no-compile", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "updates 3 buffers in place (a KV cache: key_cache_0, ...)" in err and \
        "profile the export without the cache" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_profile_refuses_a_fixed_sequence_and_a_hybrid_in_one_line(exported, tmp_path, capsys):
    # decode steps are one token a sequence: an export whose sequence is static at 5 would time 5 (the
    # FFN program failed on a traceback); a hybrid's state-space layer reads no KV cache the estimate knows
    from afd_compile.models import build_hf

    fixed = tmp_path / "fixed_seq.pt2"
    ids = torch.randint(0, 128, (2, 5))
    torch.export.save(torch.export.export(build_hf("llama", num_layers=1), (ids,),
                                          dynamic_shapes={"input_ids": {0: torch.export.Dim("batch")}}), fixed)
    for path, message in [(str(fixed), "input input_ids (s77, 5) fixes its sequence at 5 tokens: profile times decode "
                                       "steps (one token a sequence)"),
                          (exported("jamba")[1], "layers [0] mix tokens by something other than attention")]:
        out = tmp_path / "p.json"
        assert main(["profile", path, "-o", str(out), "--device", "cpu", "--no-compile", "--tokens", "1,2",
                     "--iters", "1", "--rounds", "1", "-q"]) == 2
        err = capsys.readouterr().err.strip()
        assert re.sub(r"s\d+", "s77", message) in re.sub(r"s\d+", "s77", err) and len(err.splitlines()) == 1, err
        assert not out.exists()


def _fixed_profile(model: str, tmp_path) -> str:
    with open(GOLDEN_PROFILE) as f:
        rec = json.load(f)
    rec["model"]["sha256"] = sha256_of(model)  # (the fixed numbers, of this run's export of the same model)
    out = tmp_path / "fixed.json"
    out.write_text(json.dumps(rec))
    return str(out)


def test_estimate_from_a_fixed_profile(exported, tmp_path, capsys, check_golden):
    _, path = exported("llama2")
    prof = _fixed_profile(path, tmp_path)
    assert main(["plan", path, "--estimate", prof, "-A", "3", "-F", "1", "--stages", "2", "--context", "2048",
                 "--layers", "32", "--tpot-ms", "50"]) == 0
    text = capsys.readouterr().out.replace(prof, "PROFILE.json")
    assert main(["plan", path, "--estimate", prof, "-A", "4", "--attn-tp", "2", "-F", "2", "--context", "2048",
                 "--layers", "32", "--tpot-ms", "50", "--json"]) == 0
    attn_tp = json.loads(capsys.readouterr().out)["estimates"][0]
    assert attn_tp["layout"] == "AFD 4A2F S=1 attn_tp=2" and attn_tp["sequences"] == 2 * attn_tp["batch"]
    assert main(["plan", path, "--estimate", prof, "--search", "--gpus", "8", "--tpot-ms", "50", "--context", "2048",
                 "--layers", "32", "--link", "ib"]) == 0
    text += capsys.readouterr().out.replace(prof, "PROFILE.json")
    # past the profile (KV reads of 32 sequences at 4096 positions, FFN at 128 rows): said after the table
    assert main(["plan", path, "--estimate", prof, "-A", "3", "-F", "1", "--batch", "64", "--context", "8192",
                 "--layers", "32"]) == 0
    out = capsys.readouterr().out
    assert "  - AFD 3A1F S=1: KV read at 64 sequences (profiled to 32), context at 8192 positions (profiled to " \
        "4096), FFN at 192 rows (profiled to 128)" in out
    text += out.replace(prof, "PROFILE.json")
    check_golden("estimate_llama2.txt", text)
    assert main(["plan", path, "--estimate", prof, "--tp", "2", "--batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["layout"] for e in data["estimates"]] == ["TP 1 x DP 2", "TP 2"] and data["assumptions"]
    # a given layout's FFN TP group collects inside its node (NVLink) whatever --link the roles cross
    ffn = {}
    for link in ("nvlink", "ib"):
        assert main(["plan", path, "--estimate", prof, "-A", "2", "-F", "2", "--ffn-tp", "2", "--batch", "8",
                     "--link", link, "--json"]) == 0
        e = json.loads(capsys.readouterr().out)["estimates"][0]
        ffn[link] = e["ffn_us"], e["wire_us"]
    assert ffn["ib"][0] == ffn["nvlink"][0] and ffn["ib"][1] > ffn["nvlink"][1], ffn


@pytest.mark.parametrize("edit,flags,message", [
    (lambda r: r.update(format="x"), [], "not an afd-compile profile"),
    (lambda r: r["model"].update(sha256="0" * 64), [], "was measured on 'llama2.pt2' (sha256 000000000000...), not on"),
    (lambda r: r.update(ffn=r["ffn"][:1]), [], "fixed.json: 'ffn' needs at least 2 measured sizes, has 1: profile"),
    (lambda r: r.update(kv=[]), [], "fixed.json: 'kv' has no measured context: profile again\n"),
    (lambda r: r["model"].pop("kv_bytes"), [], "missing or malformed field 'kv_bytes'"),
    (lambda r: None, ["--device-name", "H200"], "was measured on 'NVIDIA H100 80GB HBM3', not on a H200"),
    (lambda r: None, ["--layers", "3,58"], "fixed.json has 1 kind(s) of layer (first at layers [0]): give one count"),
])
def test_a_bad_profile_is_refused_in_one_line(exported, tmp_path, capsys, edit, flags, message):
    _, path = exported("llama2")
    prof = _fixed_profile(path, tmp_path)
    rec = json.loads(open(prof).read())
    edit(rec)
    open(prof, "w").write(json.dumps(rec))
    assert main(["plan", path, "--estimate", prof, "-A", "1", "-F", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and err.count("fixed.json") == 1, err


@pytest.mark.parametrize("argv,message", [
    (["--estimate", "missing.json", "-A", "1", "-F", "1"], "--estimate missing.json: no such file"),
    (["--search", "--gpus", "4"], "apply to plan --estimate PROFILE.json"),
    (["--estimate", "PROF", "--search", "--gpus", "4"], "give both"),
    (["--estimate", "PROF", "--link", "fast", "-A", "1", "-F", "1"], "--link 'fast'"),
    (["--estimate", "PROF", "--mermaid"], "give one of them"),
    (["--estimate", "PROF"], "--estimate needs a layout"),
    (["--estimate", "PROF", "-A", "1", "-F", "1", "--top", "3"], "--top K shows the K best layouts of --search"),
])
def test_estimate_flags_are_checked(exported, tmp_path, capsys, argv, message):
    _, path = exported("llama2")
    prof = _fixed_profile(path, tmp_path)
    assert main(["plan", path, *[prof if a == "PROF" else a for a in argv]]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_profile_compiles_as_the_backend_does(exported, tmp_path):
    # the default path: each program compiled by Inductor (dynamic sizes) before it is timed
    _, path = exported("llama2")
    out = str(tmp_path / "p.json")
    assert main(["profile", path, "-o", out, "--device", "cpu", "--tokens", "1,4", "--contexts", "32,64",
                 "--kv-batches", "1,2", "--iters", "2", "-q"]) == 0
    costs, facts, rec = read_profile(out, path)
    assert rec["compiled"] is True and facts.layers == 2 and costs.ffn.at(2) > 0


def test_a_disturbed_size_is_timed_again():
    from afd_compile.profile import _retime_outliers

    def row(t, median, p10=None, p90=None):
        return {"tokens": t, "median_us": median, "p10_us": p10 or median, "p90_us": p90 or median}

    # 8 slower than 16 by more than 20% (a whole-size spike), 32 spread 4x, 16 and 64 steady
    rows = [row(8, 300.0), row(16, 200.0), row(32, 210.0, 100.0, 400.0), row(64, 250.0)]
    again = {8: 150.0, 32: 220.0}
    said: list[str] = []
    _retime_outliers(rows, lambda t: row(t, again[t]), said.append, "attention")
    assert [r["median_us"] for r in rows] == [150.0, 200.0, 210.0, 250.0]  # the lower median kept
    assert [r.get("retimed", False) for r in rows] == [True, False, True, False]
    assert said[0] == "attention at 8: 300 µs (p10 300, p90 300) looked disturbed; timed again: 150 µs"


def test_the_ffn_program_routes_as_the_model_does():
    """profile's FFN program (exchange taken out) runs every layer on the attention program's rows:
    each MoE layer reaches about as many experts as the model's does. Fed its own output, a random
    MoE collapsed to top-k from its third layer on (4 of 64 experts against 22-28)."""
    import torch.fx as fx

    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile import inputs_at, role_programs
    from afd_compile.programs import flat_inputs

    ep = export_lm(build_hf("qwen3_moe", num_layers=4, num_experts=64, num_experts_per_tok=4))
    programs, _, _ = role_programs(ep, torch.device("cpu"))
    example, t = flat_inputs(ep), 8

    class Reached(fx.Interpreter):
        def __init__(self, gm):
            super().__init__(gm)
            self.per_layer = []

        def call_function(self, target, args, kwargs):
            if "moe_experts" in str(target):
                self.per_layer.append(len(torch.unique(args[1])))
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        rows = programs["attention"](*inputs_at(programs["attention"], example, t, torch.device("cpu")))[-1]
        ffn, model = Reached(programs["ffn"]), Reached(programs["model"])
        ffn.run(torch.empty(t), rows.reshape(t, -1))
        model.run(*inputs_at(programs["model"], example, t, torch.device("cpu")))
    assert len(ffn.per_layer) == len(model.per_layer) == 4
    reached = list(zip(ffn.per_layer, model.per_layer, strict=True))
    assert all(f >= m / 2 for f, m in reached), reached
