"""One layer's decode attention over a static KV cache: HF's masked SDPA vs FlexAttention (the
decode-attention pass's replacement), beside the KV-read floor.

    python benchmarks/decode_attention_kernel.py --out out/gpu/decode_attention_kernel.json

Llama-3-8B-shaped attention (32 query heads, 8 KV heads of 128), bf16, one query token per
sequence, a cache of C positions of which ``filled`` hold tokens (the mask allows those). Both
variants compiled with ``torch.compile`` (Inductor), captured in a CUDA graph, and timed by CUDA
events around a replay (GPU time, no host overhead; the block mask is built inside the graph):

- ``sdpa``: what HF runs: ``repeat_kv`` then SDPA with the boolean mask over all C positions;
- ``flex``: :func:`afd_compile.passes.decode_attention.flex_decode` over the cache (block mask
  from the same mask: blocks past the filled part are never read).

Floors: KV bytes the step must read / measured copy bandwidth: all C positions (what masked SDPA
reads) and only the filled ones (what a length-aware kernel needs). Median GPU us per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from afd_compile.passes.decode_attention import flex_decode
from afd_compile.profile import time_us


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(k.shape[0], -1, k.shape[2], k.shape[3])
    v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(v.shape[0], -1, v.shape[2], v.shape[3])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _time(fn, *args, iters: int = 50) -> float:
    """Median GPU time (us) of one replay of a CUDA graph of ``fn(*args)``, by CUDA events: the
    kernels alone, no host overhead (a decode step replays its layers inside one graph);
    ``afd-compile profile``'s own timer."""
    return time_us(fn, args, iters, torch.device("cuda"), graph=True)["median_us"]


def _bandwidth() -> float:
    """Bytes per second of a device copy (read + write), 1 GiB, eager and timed by CUDA events (a
    copy captured in a graph becomes a copy-engine memcpy node, measured 2.7 TB/s against 4.2)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(13):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    return 2 * a.numel() * 2 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x1024,8x4096,64x1024,64x4096", help="batch x context")
    parser.add_argument("--fill", type=float, default=0.5, help="fraction of the cache holding tokens")
    parser.add_argument("--out", default="out/gpu/decode_attention_kernel.json")
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = _bandwidth()
    sdpa = torch.compile(_sdpa, dynamic=False)
    flex = torch.compile(flex_decode, dynamic=False)
    rows = []
    for shape in args.shapes.split(","):
        b, c = (int(x) for x in shape.split("x"))
        filled = max(1, int(c * args.fill))
        q = torch.randn(b, 32, 1, 128, device=dev, dtype=dt)
        k, v = (torch.randn(b, 8, c, 128, device=dev, dtype=dt) for _ in range(2))
        mask = (torch.arange(c, device=dev) < filled)[None, None, None, :].expand(b, 1, 1, c).contiguous()
        ref = _sdpa(q, k, v, mask, 128 ** -0.5)
        got = flex(q, k, v, mask, 128 ** -0.5).clone()
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        kv_all, kv_filled = 2 * b * 8 * c * 128 * 2, 2 * b * 8 * filled * 128 * 2
        row = {"batch": b, "context": c, "filled": filled, "sdpa_us": _time(sdpa, q, k, v, mask, 128 ** -0.5),
               "flex_us": _time(flex, q, k, v, mask, 128 ** -0.5), "floor_all_us": kv_all / bw * 1e6,
               "floor_filled_us": kv_filled / bw * 1e6, "max_rel_err": err}
        rows.append(row)
        print(f"progress: {row}", flush=True)
    print(f"decode attention, one layer (32 q heads, 8 KV heads x 128, bf16), cache {args.fill:.0%} filled; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}; median GPU us per call (CUDA graph replay)")
    print(
        "| B x C | floor (all C) | SDPA masked | floor (filled) | FlexAttention | flex / floor(filled) | max rel err |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} x {r['context']} | {r['floor_all_us']:.1f} | {r['sdpa_us']:.1f} | "
            f"{r['floor_filled_us']:.1f} | {r['flex_us']:.1f} | {r['flex_us'] / r['floor_filled_us']:.2f}x | "
            f"{r['max_rel_err']:.2g} |"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"fill": args.fill, "copy_bandwidth_bytes_per_s": bw, "torch": torch.__version__, "rows": rows}, f, indent=1
        )


if __name__ == "__main__":
    main()
