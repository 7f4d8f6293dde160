"""The FFN side of an MoE decoder on one GPU, per expert form, against its HBM floor (issue 34).

A Qwen3-30B-A3B-shaped FFN side (hidden 2048, 128 experts, top 8, moe_intermediate 768; per layer
the post-attention RMSNorm, transformers' MoE block, the residual add; 4 layers, bf16, random
weights) under ``torch.compile(mode="reduce-overhead")`` (one CUDA graph), at T tokens:

- ``grouped_mm`` / ``batched_mm``: transformers' own experts implementations (the model as written);
- ``afd_op``: the same weights with the experts as one ``afd::moe_experts`` op, called directly
  (its default implementation on this GPU: the fused Triton kernels, ``moe_triton.py``);
  ``afd_op_grouped_mm``: the same, forced to its ``torch._grouped_mm`` path (``AFD_MOE_IMPL``);
- ``rec_grouped_mm`` / ``rec_batched_mm`` / ``rec_loop``: what afd-compile runs: the FFN side
  exported (``torch.export``, at T) in that form (``rec_loop``: a hand-written loop over 128
  per-expert ``nn.Linear`` triples, tokens picked by ``where``, written back by ``index_add_``),
  its experts recognised (``passes/moe``: one ``afd::moe_experts`` per layer) and its routers'
  top-k given to ``afd::router_topk`` (as the backend does on CUDA), then compiled (the op's
  default implementation);
- ``afd_op_inline``: the op's grouped path written inline (aten ops Inductor can fuse: what a
  lowering of the op before Inductor would hand it);
- ``floor``: the bytes the step must read (the experts its tokens chose, counted on the measured
  input, the router and norm weights), once, at this GPU's measured copy bandwidth.

Every column is measured in the same run; each output is checked against ``grouped_mm``'s (bf16,
max relative error printed). Prints a table and writes JSON (``--json``).

    python benchmarks/moe_ffn.py --json $OUT/moe_ffn.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HIDDEN, EXPERTS, TOP_K, INTER, LAYERS = 2048, 128, 8, 768, 4


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy (read + write)."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)


class FFNSide(torch.nn.Module):
    """Per layer: h + moe(norm(h)), the MoE block transformers builds for Qwen3-MoE."""

    def __init__(self, impl: str, seed: int = 0) -> None:
        super().__init__()
        import transformers
        from transformers.models.qwen3_moe import modeling_qwen3_moe as q

        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                             moe_intermediate_size=INTER, norm_topk_prob=True,
                                             experts_implementation=impl)
        torch.manual_seed(seed)
        self.norms = torch.nn.ModuleList(q.Qwen3MoeRMSNorm(HIDDEN) for _ in range(LAYERS))
        self.moes = torch.nn.ModuleList(q.Qwen3MoeSparseMoeBlock(config) for _ in range(LAYERS))
        for p in self.moes.parameters():
            torch.nn.init.normal_(p, std=0.02)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return h


class OpSide(torch.nn.Module):
    """The same layers with the experts as one afd::moe_experts op."""

    def __init__(self, ref: FFNSide, inline: bool = False) -> None:
        super().__init__()
        self.ref, self.inline = ref, inline

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from afd_compile.moe import grouped, moe_experts

        b, s, d = h.shape
        for norm, moe in zip(self.ref.norms, self.ref.moes, strict=True):
            x = norm(h).view(-1, d)
            _, weights, ids = moe.gate(x)
            w_gu, w_d = moe.experts.gate_up_proj, moe.experts.down_proj
            if self.inline:  # the op's grouped path as aten ops: what Inductor fuses after a lowering
                y = grouped(x, ids, weights, w_gu, w_d, None, None, "silu", True, False)
            else:
                y = moe_experts(x, ids, weights, w_gu, w_d)
            h = h + y.view(b, s, d)
        return h


class LoopSide(torch.nn.Module):
    """The same weights as a hand-written loop over per-expert linears (Mixtral's older form)."""

    def __init__(self, ref: FFNSide) -> None:
        super().__init__()
        self.norms, self.gates = ref.norms, torch.nn.ModuleList(m.gate for m in ref.moes)
        self.experts = torch.nn.ModuleList()
        for m in ref.moes:
            per = torch.nn.ModuleList()
            for e in range(EXPERTS):
                gate, up = m.experts.gate_up_proj[e].chunk(2, 0)
                lin = [torch.nn.Linear(1, 1, bias=False) for _ in range(3)]
                for layer, w in zip(lin, (gate, up, m.experts.down_proj[e]), strict=True):
                    layer.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
                per.append(torch.nn.ModuleList(lin))
            self.experts.append(per)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        for norm, gate, experts in zip(self.norms, self.gates, self.experts, strict=True):
            x = norm(h).view(-1, d)
            _, weights, ids = gate(x)
            out = torch.zeros_like(x)
            for e, (g, u, dn) in enumerate(experts):
                tok, slot = torch.where(ids == e)
                xe = x[tok]
                out.index_add_(0, tok, dn(torch.nn.functional.silu(g(xe)) * u(xe)) * weights[tok, slot, None])
            h = h + out.view(b, s, d)
        return h


def recognised(model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """``model`` exported at ``x`` with its experts recognised and, as the backend does on CUDA,
    its routers' top-k given to ``afd::router_topk``: what afd-compile compiles."""
    from afd_compile.passes.moe import recognise_moe
    from afd_compile.passes.moe.topk import use_router_topk

    with torch.no_grad():  # (tokens dynamic, as a served FFN program's: the recognition probes a few rows)
        gm = torch.export.export(model, (x,), dynamic_shapes={"h": {0: torch.export.Dim("tokens", max=4096)}}).module()
    records = recognise_moe(gm)
    if len(records) != LAYERS or not all(r.op for r in records):
        raise SystemExit(f"moe_ffn: recognition found {[str(r) for r in records]}")
    print(f"moe_ffn: {records[0]}; router top-k as afd::router_topk: {len(use_router_topk(gm))}", file=sys.stderr)
    return gm


def touched(model: FFNSide, h: torch.Tensor) -> list[int]:
    """Experts each layer's tokens chose, on this input."""
    out = []
    with torch.no_grad():
        for norm, moe in zip(model.norms, model.moes, strict=True):
            x = norm(h).view(-1, HIDDEN)
            _, _, ids = moe.gate(x)
            out.append(int(torch.unique(ids).numel()))
            h = h + moe(norm(h))
    return out


def time_us(fn, x: torch.Tensor, iters: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn(x)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(times)


def wall_us_per_step(step, steps: int, runs: int = 5) -> float:
    """Median wall µs per call of ``step()`` over ``runs`` loops of ``steps`` calls, the device
    synchronised around each loop: what a serve loop sees, host work included."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / steps)
    return statistics.median(times)


def graph_launches(step, steps: int = 3) -> float:
    """CUDA graph launches per call of ``step()`` (a program's captured pieces)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch") / steps


def profile(fn, x: torch.Tensor, steps: int = 10) -> dict[str, float]:
    """CUDA µs per step of each kernel of ``fn(x)`` (the largest first), printed and returned."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(x)
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda r: -r[1])
    total = sum(us for _, us in rows)
    print(f"moe_ffn: T={x.shape[0]} kernels, {total:.1f} us CUDA time per step:", file=sys.stderr)
    for key, us in rows[:14]:
        print(f"  {us:8.1f} us  {key[:110]}", file=sys.stderr)
    return {key: round(us, 1) for key, us in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64,256,1024")
    parser.add_argument("--forms", default="grouped_mm,batched_mm,afd_op,afd_op_grouped_mm,rec_grouped_mm,"
                        "rec_batched_mm,rec_loop")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print where the afd_op column's step goes (CUDA time per kernel, torch.profiler)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("moe_ffn: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    bw = copy_bandwidth(dev)
    forms = args.forms.split(",")
    base = FFNSide("grouped_mm").to(dev, torch.bfloat16).eval()
    models = {"grouped_mm": base}
    if "batched_mm" in forms:
        other = FFNSide("batched_mm").to(dev, torch.bfloat16).eval()
        other.load_state_dict(base.state_dict())
        models["batched_mm"] = other
    if "afd_op" in forms or "afd_op_grouped_mm" in forms:
        models["afd_op"] = models["afd_op_grouped_mm"] = OpSide(base)
    if "afd_op_inline" in forms:
        models["afd_op_inline"] = OpSide(base, inline=True)
    sources = {"rec_grouped_mm": base, "rec_batched_mm": models.get("batched_mm")}
    if "rec_batched_mm" in forms and sources["rec_batched_mm"] is None:
        sources["rec_batched_mm"] = FFNSide("batched_mm").to(dev, torch.bfloat16).eval()
        sources["rec_batched_mm"].load_state_dict(base.state_dict())
    if "rec_loop" in forms:
        sources["rec_loop"] = LoopSide(base).to(dev).eval()
    expert_bytes = 3 * INTER * HIDDEN * 2
    fixed = LAYERS * (EXPERTS * HIDDEN + HIDDEN) * 2  # routers and norms
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(t, 1, HIDDEN, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(t))
        used = touched(base, x)
        floor = (sum(used) * expert_bytes + fixed) / bw * 1e6
        with torch.no_grad():
            ref = base(x).float()
        row = {"tokens": t, "experts_touched": used, "floor_us": round(floor, 1)}
        for name in forms:
            model = recognised(sources[name], x) if name.startswith("rec_") else models[name]
            os.environ["AFD_MOE_IMPL"] = "grouped_mm" if name == "afd_op_grouped_mm" else "auto"
            torch._dynamo.reset()  # (a fresh capture per column: the implementation is picked when it runs)
            fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
            with torch.no_grad():
                out = fn(x).float()
            err = float((out - ref).abs().max() / ref.abs().max())
            us = time_us(fn, x, args.iters)
            os.environ["AFD_MOE_IMPL"] = "auto"
            if args.profile and name in ("afd_op", "grouped_mm"):
                row[f"{name} kernels"] = profile(fn, x)
            row[name] = {"us": round(us, 1), "x_floor": round(us / floor, 2), "max_rel_err": round(err, 5)}
            print(f"moe_ffn: T={t} {name}: {us:.1f} us ({us / floor:.2f}x floor), rel err {err:.2e}", file=sys.stderr)
        rows.append(row)
    head = ["T", "experts/layer", "floor us", *[f"{f} us (x floor)" for f in forms]]
    print(f"HBM copy bandwidth {bw / 1e12:.2f} TB/s; {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts top "
          f"{TOP_K}, moe_intermediate {INTER}, bf16, torch.compile(mode='reduce-overhead')")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [str(r["tokens"]), str(round(sum(r["experts_touched"]) / LAYERS)), str(r["floor_us"]),
                 *[f"{r[f]['us']} ({r[f]['x_floor']}x)" for f in forms]]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_bytes_per_s": bw, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
