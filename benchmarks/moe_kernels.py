"""Where the MoE op's time goes on one GPU (issue 34): each piece of ``afd::moe_experts``' grouped
path alone, in a CUDA graph, against its own HBM floor (the bytes of the experts the tokens chose).

One layer of a Qwen3-30B-A3B-shaped MoE (hidden 2048, 128 experts, top 8, moe_intermediate 768),
bf16, T tokens with random routing: ``torch._grouped_mm`` for the gate/up and the down projection
(the stacked weights as transposed views, ``colmajorB``, and made contiguous the other way,
``rowmajorB``), the sort / gather / offsets, and the whole grouped path; the fused (Triton) path
(``moe_triton.py``): its align step alone, and the whole path with its default tile config and
with others (``fused M.. N.. K.. w.. s..``: the sweep its config table is read from). Prints a
table, writes JSON (``--json``).

    python benchmarks/moe_kernels.py --json $OUT/moe_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable

import torch

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
#: the fused path's tile configs tried besides its default
SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for m, n, k, w, st in (
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 128, 64, 4, 5),
    (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 8, 4), (128, 128, 64, 8, 3))]


def time_us(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def case(t: int, wgu: torch.Tensor, wd: torch.Tensor, bw: float, g: torch.Generator) -> dict:
    from afd_compile.moe import grouped

    dev = wgu.device
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, device=dev, generator=g)[:TOP_K] for _ in range(t)])
    w = torch.rand(t, TOP_K, device=dev, generator=g).bfloat16()
    flat = ids.reshape(-1)
    experts, perm = torch.sort(flat)
    offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0, dtype=torch.int32)
    h = x[perm // TOP_K]
    a = torch.randn(t * TOP_K, INTER, device=dev, dtype=torch.bfloat16, generator=g)
    wgu_rm, wd_rm = wgu.transpose(-2, -1).contiguous(), wd.transpose(-2, -1).contiguous()
    touched = int(torch.unique(ids).numel())
    floors = {"gate_up": touched * 2 * INTER * HIDDEN * 2 / bw * 1e6, "down": touched * INTER * HIDDEN * 2 / bw * 1e6}
    floors["all"] = floors["gate_up"] + floors["down"]

    def sort_gather() -> object:
        e, p = torch.sort(flat)
        counts = torch.zeros(EXPERTS, dtype=torch.int32, device=dev).scatter_add_(
            0, e, torch.ones_like(e, dtype=torch.int32))
        return x[p // TOP_K], torch.cumsum(counts, 0)

    pieces = {
        ("gate_up colmajorB", "gate_up"): lambda: torch._grouped_mm(h, wgu.transpose(-2, -1), offs=offs),
        ("gate_up rowmajorB", "gate_up"): lambda: torch._grouped_mm(h, wgu_rm, offs=offs),
        ("down colmajorB", "down"): lambda: torch._grouped_mm(a, wd.transpose(-2, -1), offs=offs),
        ("down rowmajorB", "down"): lambda: torch._grouped_mm(a, wd_rm, offs=offs),
        ("sort + gather + offsets", "all"): sort_gather,
        ("whole grouped path", "all"): lambda: grouped(x, ids, w, wgu, wd, None, None, "silu", True, False),
    }
    from afd_compile.moe_triton import align, config, fused, token_sum

    scores = torch.randn(t, EXPERTS, device=dev, generator=g).softmax(-1)
    from afd_compile.router_topk import router_topk

    pieces[("router torch.topk", "all")] = lambda: torch.topk(scores, TOP_K, dim=-1)
    pieces[("router afd::router_topk", "all")] = lambda: router_topk(scores, TOP_K)
    y = torch.randn(t * TOP_K, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    pieces[("sum over K, torch (+ cast)", "all")] = lambda: y.view(t, TOP_K, HIDDEN).sum(
        dim=1, dtype=torch.float32).to(torch.bfloat16)
    for bh, nw in ((512, 4), (1024, 4), (2048, 8)):
        pieces[(f"sum over K, Triton H{bh} w{nw}", "all")] = lambda bh=bh, nw=nw: token_sum(y, TOP_K, bh, nw)
    pieces[("fused align", "all")] = lambda: align(ids, EXPERTS, config(t * TOP_K, EXPERTS)["BLOCK_M"])
    default = config(t * TOP_K, EXPERTS)
    pieces[("fused default, TMA weights", "all")] = lambda: fused(x, ids, w, wgu, wd, None, None, "silu", True, False,
                                                                  cfg={**default, "TMA": True})
    for cfg in [None, *SWEEP]:
        name = "fused default" if cfg is None else "fused M{BLOCK_M} N{BLOCK_N} K{BLOCK_K} w{num_warps} s{num_stages}" \
            .format(**cfg)
        pieces[(name, "all")] = lambda cfg=cfg: fused(x, ids, w, wgu, wd, None, None, "silu", True, False, cfg=cfg)
    row = {"tokens": t, "experts_touched": touched, "floors_us": {k: round(v, 1) for k, v in floors.items()}}
    for (name, floor), fn in pieces.items():
        try:
            us = time_us(graphed(fn))
        except Exception as e:  # noqa: BLE001  (a tile config this GPU cannot run: shared memory, registers)
            print(f"moe_kernels: T={t} {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            row[name] = {"us": float("nan"), "x_floor": float("nan"), "floor": floor}
            continue
        row[name] = {"us": round(us, 1), "x_floor": round(us / floors[floor], 2), "floor": floor}
    del experts
    return row


#: per-kernel tile variants of ``--split`` (BLOCK_N, BLOCK_K, num_warps, num_stages), each BLOCK_M
SPLIT_M = (16, 32, 64, 128)
SPLIT_TILES = [(64, 128, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 64, 4, 5),
               (128, 32, 4, 6), (64, 256, 4, 3), (128, 128, 4, 3), (256, 128, 8, 3), (64, 128, 4, 3),
               (128, 64, 4, 3)]


#: ``TILES`` (output tiles per program) tried for the down kernel under ``--split``
SPLIT_DOWN_TILES = (2, 4, 8)


def split_case(t: int, wgu: torch.Tensor, wd: torch.Tensor, bw: float, g: torch.Generator,
               block_m: tuple[int, ...] = SPLIT_M, tma: tuple[bool, ...] = (False,)) -> dict:
    """Each fused kernel alone (``--split``): gate/up and down over the same aligned rows, per tile
    variant, against that projection's floor; and the per-token sum."""
    from afd_compile.moe_triton import align, down, up

    dev = wgu.device
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, device=dev, generator=g)[:TOP_K] for _ in range(t)])
    rw = torch.rand(t * TOP_K, device=dev, generator=g).bfloat16()
    touched = int(torch.unique(ids).numel())
    floors = {"up": touched * 2 * INTER * HIDDEN * 2 / bw * 1e6, "down": touched * INTER * HIDDEN * 2 / bw * 1e6}
    row: dict = {"tokens": t, "experts_touched": touched, "floors_us": {k: round(v, 1) for k, v in floors.items()}}
    h = torch.randn(t * TOP_K, INTER, device=dev, dtype=torch.bfloat16, generator=g)
    y = torch.randn(t * TOP_K, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    row["sum over K"] = {"us": round(time_us(graphed(
        lambda: y.view(t, TOP_K, HIDDEN).sum(dim=1, dtype=torch.float32).to(torch.bfloat16))), 1)}
    for m in block_m:
        rows, block_expert = align(ids, EXPERTS, m)
        for (n, k, w, st), by_tma in itertools.product(SPLIT_TILES, tma):
            cfg = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, TMA=by_tma)
            for kernel, fn in (
                (
                    "up",
                    lambda cfg=cfg, r=rows, b=block_expert: up(
                        x, wgu, None, r, b, rw, TOP_K, "silu", True, False, 1.702, 7.0, cfg
                    ),
                ),
                ("down", lambda cfg=cfg, r=rows, b=block_expert: down(h, wd, None, r, b, rw, False, cfg)),
            ):
                name = f"{kernel} M{m} N{n} K{k} w{w} s{st}" + (" tma" if by_tma else "")
                try:
                    us = time_us(graphed(fn))
                except Exception as e:  # noqa: BLE001  (shared memory / registers this GPU lacks)
                    print(f"moe_kernels: T={t} {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                    continue
                row[name] = {"us": round(us, 1), "x_floor": round(us / floors[kernel], 2)}
        for n, k, w, st in SPLIT_TILES[:4] + SPLIT_TILES[-4:]:  # the down kernel over several tiles per program
            for tiles, by_tma in itertools.product(SPLIT_DOWN_TILES, tma):
                cfg = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, TILES=tiles, TMA=by_tma)
                name = f"down M{m} N{n} K{k} w{w} s{st} t{tiles}" + (" tma" if by_tma else "")
                try:
                    us = time_us(
                        graphed(lambda cfg=cfg, r=rows, b=block_expert: down(h, wd, None, r, b, rw, False, cfg))
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"moe_kernels: T={t} {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                    continue
                row[name] = {"us": round(us, 1), "x_floor": round(us / floors["down"], 2)}
    return row


def print_split(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"T={r['tokens']} ({r['experts_touched']} experts): floors up {r['floors_us']['up']} us, down "
            f"{r['floors_us']['down']} us; sum over K {r['sum over K']['us']} us"
        )
        for kernel in ("up", "down"):
            best = sorted((v["us"], k) for k, v in r.items() if k.startswith(kernel + " "))
            print(
                f"  {kernel}: " + "; ".join(f"{k[len(kernel) + 1 :]} {us} ({r[k]['x_floor']}x)" for us, k in best[:6])
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64,256,1024")
    parser.add_argument("--json", default=None)
    parser.add_argument("--split", action="store_true", help="time each fused kernel alone over tile variants")
    parser.add_argument("--block-m", default=",".join(map(str, SPLIT_M)), help="--split: the BLOCK_M values tried")
    parser.add_argument("--tma", action="store_true", help="--split: each variant also with TMA weight loads")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("moe_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moe_ffn import copy_bandwidth  # (benchmarks/ is the script's directory)

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    g = torch.Generator(dev).manual_seed(0)
    wgu = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g) * 0.02).bfloat16()
    wd = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g) * 0.02).bfloat16()
    if args.split:
        block_m = tuple(int(m) for m in args.block_m.split(","))
        tma = (False, True) if args.tma else (False,)
        rows = [split_case(int(t), wgu, wd, bw, g, block_m, tma) for t in args.tokens.split(",")]
        print(f"each fused kernel alone, bf16, CUDA graphs; HBM copy bandwidth {bw / 1e12:.2f} TB/s; best 6 per kernel")
        print_split(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bandwidth_bytes_per_s": bw, "torch": torch.__version__, "split": rows}, f, indent=2)
        return 0
    rows = [case(int(t), wgu, wd, bw, g) for t in args.tokens.split(",")]
    names = [k for k in rows[0] if isinstance(rows[0][k], dict) and "us" in rows[0][k]]
    print(
        f"one MoE layer, bf16, CUDA graphs; HBM copy bandwidth {bw / 1e12:.2f} TB/s; floor: the chosen experts' "
        "bytes of that piece (gate_up, down) or of both"
    )
    print("| piece | " + " | ".join(f"T={r['tokens']} ({r['experts_touched']} experts)" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{r[n]['us']} us ({r[n]['x_floor']}x)" for r in rows) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_bytes_per_s": bw, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
