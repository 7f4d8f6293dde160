"""How honest plan --estimate is, on one GPU: a profile's interpolation against sizes it measured
but was not given, the no-layout step predicted from the parts against the measured whole, and the
multi-GPU step times BENCHMARKS.md records recomputed from a one-GPU profile of the same model.

A Llama-3-8B-shaped (``--family llama``: hidden 4096, 32 heads, 8 KV heads, intermediate 14336) or
Qwen3-30B-A3B-shaped (``--family qwen3_moe``: hidden 2048, 32 heads, 4 KV heads, 128 experts of 768,
top 8) decoder of ``--layers`` layers, vocab 32000, bf16, random weights, exported on the GPU and
profiled by ``afd_compile.profile.run_profile`` as ``afd-compile profile`` does (Inductor + CUDA
graphs). One profile over a fine grid; the estimate is then made from a coarse subset of it and
compared with the held-out sizes (measured in the same run); profiles timing ``--sliced`` K of the
layers (``profile --layers K``; default 1 and 2) are compared with the whole one, and every depth
timed below the whole (those, and each profile's second depth) gives each program
as a line, its call plus one a layer, checked at the whole depth. The model is also timed as a
user compiles it (``torch.compile(model, backend="afd")``, synchronised each step, as the recorded
two-GPU steps were timed) beside the profile's no-layout program; ``--kernels T,...`` traces the three
programs at each T (``--kernels-only``: that alone) and lists per kernel the whole's GPU time against
the parts'. Prints the tables, writes JSON.

    python benchmarks/estimate_check.py --family llama --json $OUT/estimate_check_llama.json
    python benchmarks/estimate_check.py --from-json benchmarks/results/estimate_check_llama_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FINE = (1, 4, 8, 16, 32, 64, 128, 256)
COARSE = (1, 8, 64, 256)
#: the KV read: the profile's default batches (``PROFILE_KV_BATCHES``: 1, 8, 32, 64, 128) as the coarse
#: subset, 16 held out between them, and context 2048 held out
CONTEXTS, KV_BATCHES = (1024, 2048, 4096), (1, 8, 16, 32, 64, 128)
COARSE_KV = ((1024, 4096), (1, 8, 32, 64, 128))
SHAPES = {"llama": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336),
          "qwen3_moe": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, intermediate_size=6144)}
#: multi-GPU step times BENCHMARKS.md records for the Llama-8B-shaped x 4 layers, vocab 32000, bf16
#: (2 x H200): (section, layout, sequences per rank, context, measured µs)
RECORDED = [
    ("Compiled programs on two GPUs (no KV cache)", "TP 2", 8, 1, 1299.0),
    ("Compiled programs on two GPUs (no KV cache)", "TP 2", 128, 1, 1600.0),
    ("Compiled programs on two GPUs (no KV cache)", "AFD 1A1F S=1", 8, 1, 1572.0),
    ("Compiled programs on two GPUs (no KV cache)", "AFD 1A1F S=1", 128, 1, 2212.0),
    ("The decode step, two GPUs (HF's SDPA)", "TP 2", 8, 1024, 1121.0),
    ("The decode step, two GPUs (HF's SDPA)", "TP 2", 64, 1024, 2436.0),
    ("The decode step, two GPUs (HF's SDPA)", "TP 2", 64, 4096, 5641.0),
    ("The decode step, two GPUs (HF's SDPA)", "AFD 1A1F S=1", 8, 1024, 1545.0),
    ("The decode step, two GPUs (HF's SDPA)", "AFD 1A1F S=1", 64, 1024, 3798.0),
    ("The decode step, two GPUs (HF's SDPA)", "AFD 1A1F S=1", 64, 4096, 10874.0),
]


def _subset(rec: dict, tokens: tuple[int, ...], kv: tuple[tuple[int, ...], tuple[int, ...]]) -> dict:
    out = dict(rec)
    out["attention"] = [r for r in rec["attention"] if r["tokens"] in tokens]
    out["head"] = [r for r in rec["head"] if r["tokens"] in tokens]
    out["ffn"] = [r for r in rec["ffn"] if r["rows"] in tokens]
    out["kv"] = [r for r in rec["kv"] if r["context"] in kv[0] and r["batch"] in kv[1]]
    return out


def _costs(rec: dict, path: str):
    from afd_compile.profile_read import read_profile

    with open(path, "w") as f:
        json.dump(rec, f)
    return read_profile(path)


def _row(what: str, size: str, predicted: float, measured: float) -> dict:
    return {"what": what, "size": size, "predicted_us": round(predicted, 1), "measured_us": round(measured, 1),
            "error": round(predicted / measured - 1, 4)}


def interpolation(rec: dict, coarse: object, k: int, calls: dict) -> list[dict]:
    """Per-layer attention / FFN / KV from the coarse profile at the fine grid's held-out sizes (the
    measured per layer: less the program's call as the coarse profile splits it off, ``calls``, else
    less the head)."""
    rows = []
    head = {r["tokens"]: r["median_us"] for r in rec["head"]}
    for r in rec["attention"]:
        if r["tokens"] not in COARSE:
            t = r["tokens"]
            got = (r["median_us"] - (calls["attention"].at(t) if calls else head[t])) / k
            rows.append(_row("attention layer", f"T={t}", coarse.attention.at(t), got))
    for r in rec["ffn"]:
        if r["rows"] not in COARSE:
            got = (r["median_us"] - (calls["ffn"].at(r["rows"]) if calls else 0.0)) / k
            rows.append(_row("FFN layer", f"R={r['rows']}", coarse.ffn.at(r["rows"]), got))
    for r in rec["kv"]:
        if not (r["context"] in COARSE_KV[0] and r["batch"] in COARSE_KV[1]):
            rows.append(_row("KV read (one layer)", f"B={r['batch']} C={r['context']}",
                             coarse.kv.at(r["batch"], r["context"]), r["median_us"]))
    return rows


def depth_line(rec: dict, parts: list[dict], layers: int) -> list[dict]:
    """Each program's time as its call plus one per layer: a least-squares line through every depth
    timed below the whole (the sliced profiles, each profile's second depth), at the sizes every depth
    timed, predicting the whole program (all ``layers``) against its measured time."""
    timed = [p for q in (rec, *parts) for p in (q, q.get("second_depth") or {}) if p]
    depth = lambda p: p["model"]["profiled_layers"] if "model" in p else p["layers"]  # noqa: E731
    below = [p for p in timed if depth(p) < layers]
    if len({depth(p) for p in below}) < 2:
        return []
    rows = []
    for key, size in (("attention", "tokens"), ("ffn", "rows"), ("no_layout", "tokens")):
        whole = {r[size]: r["median_us"] for r in rec[key]}
        for t in sorted(set.intersection(*({r[size] for r in p[key]} for p in below)) & set(whole)):
            pts = [(depth(p), next(r["median_us"] for r in p[key] if r[size] == t)) for p in below]
            mx, my = (sum(v) / len(pts) for v in zip(*pts, strict=True))
            per = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            call = my - per * mx
            rows.append(_row(f"{key.replace('_', '-')} program, {layers} layers from depths "
                             f"{sorted({d for d, _ in pts})} (call {call:.0f} µs + {per:.0f} µs a layer)",
                             f"{size[0].upper()}={t}", call + layers * per, whole[t]))
    return rows


def entry_rows(rec: dict, entry: list[dict]) -> list[dict]:
    """The profile's no-layout program against the model compiled as a user does (:func:`entry_steps`)."""
    whole = {r["tokens"]: r["median_us"] for r in rec["no_layout"]}
    return [_row("no-layout program (profile) against the user's torch.compile(model, backend='afd'), "
                 "synchronised each step", f"T={e['tokens']}", whole[e["tokens"]], e["median_us"])
            for e in entry if e["tokens"] in whole]


def checks(rec: dict, sdpa: list, parts: list[dict], family: str, layers: int, tmp: str) -> tuple[list, list]:
    """The check rows from a whole profile (``rec``), HF's SDPA KV reads and the sliced profiles."""
    from afd_compile import estimate as est
    from afd_compile.profile_read import call_curves

    subset = _subset(rec, COARSE, COARSE_KV)
    coarse, facts, _ = _costs(subset, os.path.join(tmp, "coarse.json"))
    rows = interpolation(rec, coarse, facts.layers, call_curves(subset, facts.layers, "coarse.json"))
    for r in rec["no_layout"]:  # the whole model from its parts: every layer's attention and FFN + each program's
        t = r["tokens"]  # call (or the head)
        rows.append(_row("no-layout step from the parts", f"T={t}", facts.layers * (coarse.attention.at(t)
                         + coarse.ffn.at(t)) + coarse.once_attention(t) + coarse.once_ffn(t), r["median_us"]))
    for part in parts:  # profile --layers K: K of the layers timed, scaled to all of them, against the whole
        sliced, _, _ = _costs(part, os.path.join(tmp, "sliced.json"))
        k = part["model"]["profiled_layers"]
        for t in COARSE:
            rows.append(_row(f"attention layer, {k} of {facts.layers} layers timed", f"T={t}",
                             sliced.attention.at(t), coarse.attention.at(t)))
            rows.append(_row(f"FFN layer, {k} of {facts.layers} layers timed", f"R={t}", sliced.ffn.at(t),
                             coarse.ffn.at(t)))
        for r in rec["no_layout"]:
            t = r["tokens"]
            rows.append(_row(f"no-layout step from {k} layers timed", f"T={t}", facts.layers * (
                sliced.attention.at(t) + sliced.ffn.at(t)) + sliced.once_attention(t) + sliced.once_ffn(t),
                r["median_us"]))
    rows += depth_line(rec, parts, facts.layers)
    recorded = []
    if family == "llama" and layers == 4 and rec["device"]["type"] == "cuda":
        with_sdpa, _, _ = _costs({**rec, "kv": sdpa}, os.path.join(tmp, "sdpa.json"))
        link = est.LINKS["nvlink"]
        for section, layout, batch, context, measured in RECORDED:
            if layout.startswith("TP"):
                e = est.tp(with_sdpa, facts, est.TPCandidate(2, 2), batch, context, link)
            else:
                e = est.afd(with_sdpa, facts, est.AFDCandidate(1, 1), batch, context, link)
            recorded.append({**_row(layout, f"B={batch} C={context}", e.step_us, measured), "section": section})
    return rows, recorded


ENTRY = (8, 128)  # the batches of RECORDED's steps with no KV cache


def entry_steps(model: torch.nn.Module, dev: torch.device, vocab: int, iters: int) -> list[dict]:
    """The model as a user compiles it (``torch.compile(model, backend="afd", dynamic=True)``, no
    layout) at each ``ENTRY`` batch, a step timed as ``compile_step.py`` timed RECORDED's steps with no
    KV cache: the host's clock around the call, synchronised each step (median). Beside the profile's
    no-layout program at the same T (CUDA events around the compiled program's call) it is what the
    entry point adds: dynamo's guards over the user's module, the backend's runner, input binding."""
    import statistics
    import time

    import afd_compile.backend  # noqa: F401  (registers backend="afd")

    fn = torch.compile(model, backend="afd", dynamic=True)
    out = []
    with torch.no_grad():
        for t in ENTRY:
            ids = torch.randint(0, vocab, (t, 1), device=dev, generator=torch.Generator(dev).manual_seed(t))
            for _ in range(3):
                fn(ids)
            times = []
            for _ in range(iters):
                torch.cuda.synchronize() if dev.type == "cuda" else None
                t0 = time.perf_counter()
                fn(ids)
                torch.cuda.synchronize() if dev.type == "cuda" else None
                times.append((time.perf_counter() - t0) * 1e6)
            out.append({"tokens": t, "median_us": round(statistics.median(times), 2)})
    return out


def kernel_gap(path: str, dev: torch.device, t: int, calls: int = 10) -> list[dict]:
    """Where the whole program's time goes against its parts': the attention, FFN and no-layout
    programs as the profile builds and compiles them, each called ``calls`` times at ``t`` under
    torch.profiler; per kernel (by name), its GPU µs a call in the whole and in the two parts. The
    parts' sum short of the whole is the no-layout check's miss, kernel by kernel."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    from afd_compile.profile import _compiled, ffn_inputs, inputs_at, role_programs, time_us
    from afd_compile.programs import flat_inputs, load_program

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ep = load_program(path)
    example = flat_inputs(ep)
    programs, _, facts = role_programs(ep, dev)
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    with torch.no_grad():
        args = {"attention": inputs_at(programs["attention"], example, t, dev),
                "no_layout": inputs_at(programs["model"], example, t, dev),
                "ffn": ffn_inputs(programs["attention"], example, getattr(torch, facts["dtype"]), t, dev)}
        for key, kind in (("attention", "attention"), ("ffn", "ffn"), ("no_layout", "model")):
            fn = _compiled(programs[kind], dev, True)
            for _ in range(3):  # (compiled, recorded, warm)
                fn(*args[key])
            sync()
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    fn(*args[key])
                sync()
            for e in prof.key_averages():
                us = e.device_time_total if cuda else e.self_cpu_time_total
                if us and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
                    per[e.key][key] += us / calls
                    per["(kernels launched a call)"][key] += e.count / calls
            per["(the call, CUDA events around it: time_us)"][key] = time_us(fn, args[key], calls, dev)["median_us"]
            per["(the host's µs a call: calls back to back, one sync at the end)"][key] = host_us(fn, args[key], calls,
                                                                                                  sync)
            if cuda:  # (no cudagraph trees: Inductor's program captured whole in one CUDA graph and replayed)
                plain = torch.compile(programs[kind], dynamic=True)
                per["(compiled without cudagraph trees, one CUDA graph replayed: time_us)"][key] = time_us(
                    plain, args[key], calls, dev, graph=True)["median_us"]
    from torch._dynamo.utils import counters

    per["(cudagraph skips, all programs)"]["no_layout"] = float(sum(counters["inductor"].get(k, 0) for k in
                                                                    counters["inductor"] if "skip" in k))
    rows = [{"kernel": k[:90], **{key: round(v.get(key, 0.0), 1) for key in ("no_layout", "attention", "ffn")}}
            for k, v in per.items()]
    return sorted(rows, key=lambda r: -abs(r["no_layout"] - r["attention"] - r["ffn"]))


def host_us(fn, args: tuple, calls: int, sync) -> float:  # noqa: ANN001
    """The host's µs a call of ``fn`` issued ``calls`` times back to back (the clock stopped before the
    one sync at the end): above the GPU's time a call, the step is the host's."""
    import time

    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    host = time.perf_counter() - t0
    sync()
    return host / calls * 1e6


def measure(args: argparse.Namespace) -> tuple[dict, list, list[dict], list[dict], dict[str, list[dict]]]:
    """Profile the model on the GPU (``--small``: a tiny one on the CPU): the whole profile, HF's SDPA KV
    reads, and a profile timing each ``--sliced`` K of the layers."""
    from afd_compile.profile import kv_times, run_profile

    dev = torch.device("cpu" if args.small else "cuda")
    model, path, vocab = exported(args, dev)
    entry = entry_steps(model, dev, vocab, args.iters)
    del model
    torch._dynamo.reset()
    say = lambda s: print("profile:", s, flush=True)  # noqa: E731
    rec = run_profile(path, dev, FINE, CONTEXTS, KV_BATCHES, args.iters, not args.small, say)
    sdpa = kv_times(rec["model"], CONTEXTS, (8, 64), args.iters, dev, sdpa=True)  # (HF's own, for RECORDED)
    parts = [run_profile(path, dev, COARSE, CONTEXTS[:1], KV_BATCHES[:2], args.iters, not args.small, say,
                         layers=k) for k in args.sliced]
    return rec, sdpa, parts, entry, traced(path, dev, args.kernels)


def exported(args: argparse.Namespace, dev: torch.device) -> tuple[torch.nn.Module, str, int]:
    """The ``--family`` model of ``--layers`` layers (bf16 on the GPU, fp32 on the CPU), exported and
    saved: the model, the saved program's path, the vocabulary size."""
    from afd_compile.models import build_hf, export_lm

    shape = {} if args.small else {"vocab_size": 32000, **SHAPES[args.family]}
    model = build_hf(args.family, num_layers=args.layers, **shape)
    ep = export_lm(model.to(dev, torch.float32 if args.small else torch.bfloat16), device=dev,
                   vocab_size=shape.get("vocab_size", 128))
    path = os.path.join(tempfile.mkdtemp(), f"{args.family}.pt2")
    torch.export.save(ep, path)
    return model, path, shape.get("vocab_size", 128)


def traced(path: str, dev: torch.device, tokens: list[int]) -> dict[str, list[dict]]:
    """``kernel_gap`` at each of ``tokens`` (a diagnostic: the checks stand without it)."""
    out = {}
    for t in tokens:
        try:
            out[str(t)] = kernel_gap(path, dev, t)
        except Exception as e:
            print(f"--kernels {t}: not traced: {type(e).__name__}: {e}", flush=True)
    return out


def print_kernels(kernels: dict[str, list[dict]]) -> None:
    """Per traced T: the call, then the kernels with the largest gaps between the whole and its parts."""
    for t, rows in kernels.items():
        print(f"\nkernels at T={t}, GPU µs a call (the largest gaps between the whole and its parts' sum; "
              f"{len(rows)} kernels in all)\n\n| kernel | no-layout | attention | FFN | whole - parts |\n"
              "|---|---|---|---|---|")
        calls = [k for k in rows if k["kernel"].startswith("(")]
        for k in calls + [k for k in rows if k not in calls][:15]:
            print(f"| {k['kernel']} | {k['no_layout']} | {k['attention']} | {k['ffn']} | "
                  f"{k['no_layout'] - k['attention'] - k['ffn']:+.1f} |")
        total = {key: sum(k[key] for k in rows if not k["kernel"].startswith("(")) for key in
                 ("no_layout", "attention", "ffn")}
        n = {key: sum(1 for k in rows if not k["kernel"].startswith("(") and k[key]) for key in total}
        print(f"| (all kernels: {n['no_layout']}, {n['attention']}, {n['ffn']} distinct) | {total['no_layout']:.1f} | "
              f"{total['attention']:.1f} | {total['ffn']:.1f} | "
              f"{total['no_layout'] - total['attention'] - total['ffn']:+.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sliced", type=lambda v: [int(k) for k in v.split(",") if k], default=[1, 2],
                        help="K,K2,...: also profile with --layers K each ('': none) and compare its per-layer parts "
                        "with the whole profile's; every depth below the whole gives each program as its call "
                        "plus one a layer, against each whole program (default 1,2)")
    parser.add_argument("--kernels", type=lambda v: [int(t) for t in v.split(",") if t], default=[],
                        metavar="T,T2,...", help="also trace the attention, FFN and no-layout programs at each T and "
                        "list per kernel the whole's GPU time against the parts'")
    parser.add_argument("--kernels-only", action="store_true", help="export and trace --kernels only (no profile, "
                        "no checks): where the no-layout check's miss at those T goes")
    parser.add_argument("--json", default=None)
    parser.add_argument("--small", action="store_true", help="a tiny model on the CPU, uncompiled: checks the script")
    parser.add_argument("--from-json", metavar="FILE", help="recompute the checks from the profiles a run of this "
                        "script wrote (no GPU): the cost model changed, the measurements did not")
    args = parser.parse_args()
    if args.kernels_only:
        dev = torch.device("cpu" if args.small else "cuda")
        kernels = traced(exported(args, dev)[1], dev, args.kernels or [1])
        print_kernels(kernels)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"family": args.family, "layers": args.layers, "device": torch.cuda.get_device_name()
                           if dev.type == "cuda" else "cpu", "kernels": kernels}, f, indent=1)
        return
    if args.from_json:
        with open(args.from_json) as f:
            old = json.load(f)
        rec, sdpa, entry, kernels = old["profile"], old["sdpa_kv"], old.get("entry") or [], old.get("kernels") or {}
        kernels = {"8": kernels} if isinstance(kernels, list) else kernels  # (one T, 8, before --kernels took several)
        parts = old.get("sliced_profiles") or ([old["sliced_profile"]] if old.get("sliced_profile") else [])
        args.family, args.layers = old["family"], old["layers"]
    else:
        rec, sdpa, parts, entry, kernels = measure(args)
    rows, recorded = checks(rec, sdpa, parts, args.family, args.layers, tempfile.mkdtemp())
    rows += entry_rows(rec, entry)
    device = rec["device"]["name"]
    print(f"\n{args.family}, {args.layers} layers, {rec['model']['dtype']}, on {device} (profile: {len(FINE)} sizes; "
          f"estimate from {len(COARSE)})\n")
    print("| what | size | predicted (µs) | measured (µs) | predicted / measured - 1 |\n|---|---|---|---|---|")
    for r in rows + recorded:
        print(f"| {r['what']} | {r['size']} | {r['predicted_us']} | {r['measured_us']} | {r['error']:+.1%} |")
    print_kernels(kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"family": args.family, "layers": args.layers, "device": device, "profile": rec,
                       "sdpa_kv": sdpa, "sliced_profiles": parts, "entry": entry, "kernels": kernels, "checks": rows,
                       "recorded": recorded}, f, indent=1)


if __name__ == "__main__":
    main()
