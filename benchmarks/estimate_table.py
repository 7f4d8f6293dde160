"""AFD against TP/EP for real model shapes, predicted by plan --estimate's cost model from one-GPU
profiles: the best tokens/s per GPU under a time-per-output-token target, on 8 to 64 GPUs, at two
contexts.

Each model is profiled on this GPU as an export of ``--profile-layers`` of its layers (its real
hidden size, heads, experts and vocabulary; random bf16 weights made on the GPU), as ``afd-compile
profile`` does, then scaled to its depth. With ``--profiles DIR`` the profiles already written there
are used (no GPU needed: the table is recomputed from them).

    python benchmarks/estimate_table.py --models llama3_70b,qwen3_30b_a3b --json $OUT/estimate_table.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: name -> (family, depth, config overrides): the published shapes (random weights)
MODELS = {
    "llama3_70b": ("llama", 80, dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                     intermediate_size=28672, vocab_size=128256)),
    "qwen3_30b_a3b": ("qwen3_moe", 48, dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                           head_dim=128, moe_intermediate_size=768, num_experts=128,
                                           num_experts_per_tok=8, intermediate_size=6144, vocab_size=151936)),
    "qwen3_235b_a22b": ("qwen3_moe", 94, dict(hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                                             head_dim=128, moe_intermediate_size=1536, num_experts=128,
                                             num_experts_per_tok=8, intermediate_size=12288, vocab_size=151936)),
    # 61 layers, the first 3 dense: exported as its 3 dense layers and 1 MoE layer, each kind timed alone, scaled
    # to 3 + 58 (profile_read.kind_counts); K/V cached per head as HF's model traces (128 heads x (192 + 128)
    # values a token), not MLA's latent (576)
    "deepseek_v3": ("deepseek_v3", 61, dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                                            num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                                            first_k_dense_replace=3, n_group=8, topk_group=4,
                                            intermediate_size=18432, vocab_size=129280)),
}
#: layers exported where --profile-layers does not do (DeepSeek-V3: its 3 dense layers and 1 MoE layer, 22.5 GB
#: of experts)
PROFILE_LAYERS = {"deepseek_v3": 4}
GPUS, CONTEXTS, TOKENS = (8, 16, 32, 64), (4096, 32768), (1, 16, 64, 256, 512)
KV_BATCHES = (1, 4, 16)  # (the recorded run's; the KV read is linear in the batch past them)
#: fewer where the cache would not fit beside a layer's weights (DeepSeek-V3 as HF traces it: 80 KB a token a layer)
KV_BATCHES_OF = {"deepseek_v3": (1, 4)}


def profile(name: str, layers: int, iters: int, out: str) -> None:
    from afd_compile.models import build_hf, export_lm
    from afd_compile.profile import run_profile
    from afd_compile.programs import write_json

    family, _, shape = MODELS[name]
    dev = torch.device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):  # (the weights made on the GPU: minutes less than on the CPU)
        model = build_hf(family, num_layers=layers, **shape)
    torch.set_default_dtype(torch.float32)
    ep = export_lm(model, vocab_size=shape["vocab_size"], device=dev)
    path = os.path.join(tempfile.mkdtemp(), f"{name}.pt2")
    torch.export.save(ep, path)
    del model, ep
    torch.cuda.empty_cache()
    rec = run_profile(path, dev, TOKENS, CONTEXTS, KV_BATCHES_OF.get(name, KV_BATCHES), iters, True,
                      lambda s: print(f"{name}: {s}", flush=True))
    write_json(out, rec)


def table(profiles: dict[str, str], tpot_ms: float) -> list[dict]:
    from afd_compile import estimate as est
    from afd_compile.profile_read import read_profile

    rows = []
    for name, path in profiles.items():
        costs, facts, _ = read_profile(path, layers=MODELS[name][1])
        for context in CONTEXTS:
            for gpus in GPUS:
                found = est.search(costs, facts, gpus, context, tpot_ms, est.LINKS["ib"])
                afd = next((e for e in found if e.layout.startswith("AFD")), None)
                base = next((e for e in found if not e.layout.startswith("AFD")), None)
                past = {k: est.past_profile(costs, e) if e else [] for k, e in (("afd", afd), ("tp_ep", base))}
                rows.append({"model": name, "context": context, "gpus": gpus, "device": costs.device,
                             "afd": afd.json() if afd else None, "tp_ep": base.json() if base else None,
                             "past_profile": past})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--profile-layers", type=int, default=2)
    parser.add_argument("--profiles", default=None, help="a folder of <model>.json profiles to use (no GPU)")
    parser.add_argument("--tpot-ms", type=float, default=50.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = args.profiles or os.path.dirname(os.path.abspath(args.json or "out/x"))
    profiles = {}
    for name in args.models.split(","):
        path = os.path.join(folder, f"profile_{name}.json")
        if args.profiles is None:
            profile(name, PROFILE_LAYERS.get(name, args.profile_layers), args.iters, path)
        profiles[name] = path
    rows = table(profiles, args.tpot_ms)
    print(f"\nbest tokens/s per GPU at a {args.tpot_ms:g} ms time per output token (predicted; link between "
          "nodes: ib)\n")
    print("| model | context | GPUs | best AFD | its tokens/s/GPU | best TP/EP | its tokens/s/GPU | AFD / TP-EP |")
    print("|---|---|---|---|---|---|---|---|")
    marks = {"attention": "T", "FFN": "R", "KV read": "B", "context": "C", "head": "H"}
    for r in rows:
        a, b = r["afd"], r["tp_ep"]
        ratio = f"{a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f}" if a and b else "-"
        past = {k: "".join(marks[p.split(" at ")[0]] for p in r["past_profile"][k]) for k in ("afd", "tp_ep")}
        name = [f"{x['layout']} b={x['batch']}" if x else "-" for x in (a, b)]
        rate = [f"{x['tokens_per_s_per_gpu']}{' (' + past[k] + ')' if past[k] else ''}" if x else "-"
                for x, k in ((a, "afd"), (b, "tp_ep"))]
        print(f"| {r['model']} | {r['context']} | {r['gpus']} | {name[0]} | {rate[0]} | {name[1]} | {rate[1]} "
              f"| {ratio} |")
    print("\n(letters: read past the profile, extrapolated: T attention tokens, R FFN rows, B KV batch, C context, "
          "H head tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tpot_ms": args.tpot_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
