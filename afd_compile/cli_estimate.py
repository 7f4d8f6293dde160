"""``afd-compile profile`` and ``plan --estimate`` / ``--search``: the command line of the deployment
estimate (``profile.py`` measures, ``estimate.py`` predicts). The estimate imports no torch."""

from __future__ import annotations

import argparse
import json
import os

from .cli_checks import UsageError
from .limits import MAX_RANKS, count_flag

EXIT_OK = 0
TOP = 20  # the layouts --search shows


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ascending integers >= 1, comma-separated") from None
    if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r}: give ascending integers in [1, 2^20], comma-separated")
    return sizes


def add_profile_parser(sub: argparse._SubParsersAction, quiet: object, imports: object) -> None:
    from .estimate import PROFILE_CONTEXTS as CONTEXTS
    from .estimate import PROFILE_KV_BATCHES as KV_BATCHES
    from .estimate import PROFILE_TOKENS as TOKENS

    p = sub.add_parser("profile", help="time each rank kind's program of MODEL.pt2 on this machine's device (one "
                       "GPU): the attention and FFN programs, the LM head, one layer's KV read, the model whole; "
                       "writes the profile plan --estimate reads")
    p.add_argument("model", metavar="MODEL.pt2", help="an export with a dynamic batch")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="the profile to write")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--tokens", dest="profile_tokens", type=_sizes, default=TOKENS, metavar="T1,T2,...",
                   help=f"sequences of one token (decode) the attention program, LM head and model run at, and "
                   f"the FFN program's rows (default {','.join(map(str, TOKENS))})")
    p.add_argument("--contexts", type=_sizes, default=CONTEXTS, metavar="C1,C2,...",
                   help=f"KV cache lengths one layer's attention reads (default {','.join(map(str, CONTEXTS))})")
    p.add_argument("--kv-batches", type=_sizes, default=KV_BATCHES, metavar="B1,B2,...",
                   help=f"batches of that KV read (default {','.join(map(str, KV_BATCHES))})")
    p.add_argument("--layers", dest="profile_layers", type=count_flag(1, 100000), metavar="K", help="time the "
                   "first K layers of each kind only (a model too big for the device: layers of a kind are "
                   "identical in structure; a model with dense first layers then MoE ones has each kind timed "
                   "alone too; the profile keeps the model's depth and plan --estimate scales to it; default: "
                   "every layer)")
    p.add_argument("--iters", type=count_flag(1, 10000), default=20, help="timed calls per size (default 20)")
    p.add_argument("--rounds", type=count_flag(1, 100), default=3, help="times each size is timed, a round over "
                   "every size before the next; the quickest round is kept (default 3: a slow spell of the device "
                   "falls on one round)")
    p.add_argument("--no-compile", action="store_true", help="time the FX programs as they are (no Inductor, "
                   "no CUDA graphs): quick, not what the backend runs")
    imports(p)  # type: ignore[operator]
    quiet(p)  # type: ignore[operator]


def layers_flag(text: str) -> int | tuple[int, ...]:
    """``plan --layers``: the model's depth, or one count per kind of layer (``3,58``)."""
    one = count_flag(1, 100000)
    if "," not in text:
        return one(text)
    return tuple(one(part) for part in text.split(","))


def add_estimate_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment estimate (plan --estimate; no model is loaded, no GPU needed)")
    g.add_argument("--estimate", metavar="PROFILE.json", help="predict step time, time per output token and "
                   "tokens/s per GPU from a profile of this model: the layout given (-A/-F, --stages, FFN groups; "
                   "or --tp) beside TP of its GPU count, or with --search every layout of --gpus")
    g.add_argument("--search", action="store_true", help="rank every AFD and TP/EP layout of --gpus GPUs that meets "
                   "--tpot-ms, most tokens/s per GPU first")
    g.add_argument("--gpus", type=count_flag(2, MAX_RANKS), metavar="N", help="GPUs of the deployment (--search)")
    g.add_argument("--top", type=count_flag(1, 100000), metavar="K", help=f"--search: the K best layouts in the "
                   f"table (default {TOP}; --json holds every one)")
    g.add_argument("--tpot-ms", type=float, metavar="MS", help="time per output token target: each layout at the "
                   "largest batch that meets it (default: the largest that fits in memory)")
    g.add_argument("--context", type=count_flag(1, 1 << 24), default=4096, metavar="C",
                   help="KV cache positions a sequence reads (default 4096)")
    g.add_argument("--batch", type=count_flag(1, 1 << 20), metavar="B",
                   help="sequences per attention rank (AFD) / TP replica instead of the best batch")
    g.add_argument("--layers", type=layers_flag, metavar="N|N1,N2,...", help="the real model's layers (default: "
                   "the profiled model's: an export of a few layers of a deep model needs it; of layers of several "
                   "kinds in runs, dense first then MoE, the last kind takes the layers added; N1,N2,...: the "
                   "layers of each kind, in the order the model first has them)")
    g.add_argument("--link", default="nvlink", metavar="nvlink|ib|GBPS,LATENCY_US", help="the link between the "
                   "AFD roles and of EP's all-to-all past one node (default nvlink; groups stay inside a node)")
    g.add_argument("--device-name", metavar="NAME", help="refuse a profile measured on another device (a part "
                   "of its name, e.g. H200)")


def check_estimate_flags(args: argparse.Namespace) -> None:
    """What the estimate's flags decide alone (before anything is read)."""
    from .estimate import EstimateError, Link

    if args.command == "profile":
        folder = os.path.dirname(os.path.abspath(args.output))
        if os.path.isdir(args.output) or not os.path.isdir(folder):
            raise UsageError(f"-o {args.output}: {'is a folder' if os.path.isdir(args.output) else 'no such folder'}"
                             ": give the profile's file name")
        return
    if args.estimate is None:
        given = [f for f, v in (("--search", args.search), ("--gpus", args.gpus), ("--tpot-ms", args.tpot_ms),
                                ("--batch", args.batch), ("--layers", args.layers), ("--top", args.top)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to plan --estimate "
                             "PROFILE.json: add it")
        return
    if not os.path.isfile(args.estimate):
        raise UsageError(f"--estimate {args.estimate}: no such file (afd-compile profile MODEL.pt2 -o PROFILE.json "
                         "writes one)")
    if args.mermaid is not None or args.passes is not None:
        raise UsageError("--estimate prints the estimate, --mermaid / --passes the plan: give one of them")
    if args.search and (args.gpus is None or args.tpot_ms is None):
        raise UsageError("--search ranks the layouts of --gpus N GPUs that meet --tpot-ms MS: give both")
    if args.tpot_ms is not None and not 0 < args.tpot_ms < 1e6:
        raise UsageError(f"--tpot-ms {args.tpot_ms}: give milliseconds > 0")
    if args.top is not None and not args.search:
        raise UsageError("--top K shows the K best layouts of --search: add --search --gpus N --tpot-ms MS")
    if args.search and args.batch is not None:
        raise UsageError("--search picks each layout's batch under --tpot-ms: drop --batch")
    try:
        Link.parse(args.link)
    except EstimateError as e:
        raise UsageError(str(e)) from None


def print_estimate(args: argparse.Namespace, layout: object) -> int:
    """``plan --estimate``: the layout's estimate beside TP of its GPU count, or ``--search``'s ranking."""
    from . import estimate as est
    from .profile_read import read_profile

    costs, facts, rec = read_profile(args.estimate, args.model, args.device_name, args.layers)
    link = est.Link.parse(args.link)
    if args.search:
        rows = est.search(costs, facts, args.gpus, args.context, args.tpot_ms, link)
        what = f"every layout of {args.gpus} GPUs meeting {args.tpot_ms} ms per output token"
    else:
        rows, what = _layout_rows(costs, facts, layout, args, link), "the layout, and TP of its GPU count"
    head = (f"estimate from {args.estimate} ({costs.device}, torch {rec.get('torch')}, compiled {rec.get('compiled')}):"
            f" {facts.layers} layers, context {args.context}, link {link.name} ({link.gbps:g} GB/s, "
            f"{link.latency_us:g} µs); {what}")
    if costs.call_attention is not None:
        head += (f"; a call once a step (at 1 sequence: attention rank {costs.once_attention(1):.0f} µs, "
                 f"TP rank {costs.once_model(1):.0f} µs)")
    unrecognised = (rec.get("model") or {}).get("moe_unrecognised") or []
    if unrecognised:
        head += (f"\nnote: {len(unrecognised)} MoE block(s) of the profiled model were not recognised "
                 f"({unrecognised[0]}): its FFN was timed as the model's own experts, and no EP layout is weighed")
    form = (rec.get("model") or {}).get("attention_form", "sdpa")
    if form == "eager":
        head += ("\nnote: the model writes its attention out (no SDPA): a step reads the KV cache as that form does "
                 "(the scores' matmul, softmax, the values' matmul), not through afd::decode_attention")
    kinds = [round(kind.share * facts.layers, 1) for kind in costs.kinds]
    if kinds:
        shown = " + ".join(f"{n:g}" for n in kinds)
        head += (f"\nnote: the model's layers are of {len(kinds)} kinds ({shown} layers), each timed alone and "
                 "costed apart (under FFN EP a dense layer runs whole on each FFN rank's rows); the table's attention "
                 "and FFN columns are their means weighted by their counts")
    if args.json:
        print(json.dumps({"profile": args.estimate, "device": costs.device, "layers": facts.layers,
                          "moe_unrecognised": unrecognised, "attention_form": form, "layer_kinds": kinds,
                          "context": args.context, "link": link.__dict__,
                          "estimates": [{**e.json(), "past_profile": est.past_profile(costs, e)} for e in rows],
                          "assumptions": list(est.ASSUMPTIONS)}, indent=2))
        return EXIT_OK
    print(head)
    shown = rows[:args.top or TOP] if args.search else rows
    print(est.table(shown) if rows else "no layout meets the target (or fits in memory)")
    if len(shown) < len(rows):
        print(f"... and {len(rows) - len(shown)} more layouts meeting the target (--top K shows K; --json holds all)")
    past = [(e.layout, est.past_profile(costs, e)) for e in shown]
    if any(p for _, p in past):
        print("read past the profile (extrapolated; profile these sizes to measure them):")
        for layout, p in past:
            if p:
                print(f"  - {layout}: {', '.join(p)}")
    print("assumptions:")
    for a in est.ASSUMPTIONS:
        print(f"  - {a}")
    return EXIT_OK


def _layout_rows(costs: object, facts: object, layout: object, args: argparse.Namespace, link: object) -> list:
    from . import estimate as est
    from .layout import AFDLayout

    def at_best(fn):  # the given batch, or the best under the target
        return fn(args.batch) if args.batch else est.best(fn, args.tpot_ms)

    if isinstance(layout, AFDLayout):
        cand = est.AFDCandidate(layout.attention_ranks, layout.ffn_ranks, args.stages, layout.ffn_tp, layout.ffn_ep,
                                layout.attn_tp)
        gpus = layout.attention_ranks + layout.ffn_ranks
        rows = [at_best(lambda b: est.afd(costs, facts, cand, b, args.context, link, est.LINKS["nvlink"]))]
    elif layout is not None:  # TPLayout
        gpus = layout.tp  # type: ignore[attr-defined]
        rows = []
    else:
        raise UsageError("--estimate needs a layout (-A/-F [--stages S] [--ffn-tp P | --ffn-ep P], or --tp T), "
                         "or --search --gpus N --tpot-ms MS")
    tps = [c for c in est.candidates(gpus, facts) if isinstance(c, est.TPCandidate)]
    rows += [at_best(lambda b, c=c: est.tp(costs, facts, c, b, args.context, est.LINKS["nvlink"], link)) for c in tps]
    return [r for r in rows if r is not None]


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from .profile import run_profile
    from .programs import write_json

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    say = (lambda s: None) if args.quiet else (lambda s: print(f"profile: {s}", flush=True))
    say(f"{args.model} on {device}{'' if args.no_compile else ' (compiling each program first)'}")
    rec = run_profile(args.model, device, args.profile_tokens, args.contexts, args.kv_batches, args.iters,
                      not args.no_compile, say, args.profile_layers, args.rounds)
    write_json(args.output, rec)
    m = rec["model"]
    kinds = (f" ({'the first of each of' if m['profiled_layers'] < m['layers'] else 'of'} {len(rec['kinds'])} "
             "kinds, each kind also alone)") if rec.get("kinds") else ""
    print(f"profile: wrote {args.output} ({rec['device']['name']}, {len(rec['attention'])} sizes, "
          f"{len(rec['kv'])} KV reads, {m['profiled_layers']} of {m['layers']} layers timed{kinds})")
    return EXIT_OK
