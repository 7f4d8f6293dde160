"""Greedy ``generate()`` with a static KV cache, its forward compiled with the afd backend, under torchrun.

    torchrun --nproc-per-node 2 examples/generate.py --attention 1 --ffn 1
    torchrun --nproc-per-node 5 examples/generate.py --attention 3 --ffn 2 --stagger 2
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --family qwen3_moe
    torchrun --nproc-per-node 4 examples/generate.py --tp 4 --attn-dp 2
    torchrun --nproc-per-node 1 examples/generate.py --decode-attention flex   # one GPU, no layout

Every rank builds the same HF causal LM (a small one with seeded random weights, or
``--model PATH`` loaded with ``from_pretrained`` from a local folder), the way HF documents
``torch.compile`` for generation::

    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, backend="afd", options={...}, dynamic=True)
    model.generate(...)

- **AFD** (``--attention A --ffn F``): attention ranks run ``generate()`` on their own prompts
  (each attention rank its own batch: 2 or 3 sequences of different lengths, left-padded) and
  call :func:`afd_compile.runtime.finish` after it; FFN ranks (ranks ``0..F-1``) never run
  ``generate()`` and hold no KV cache: they call :func:`afd_compile.serve`, which serves their
  attention peers step by step until every one has finished, however many steps each takes
  (``--stagger N``: attention rank i generates N*i fewer tokens, so they finish at different steps).
- **TP** (``--tp N [--attn-dp D]``): every rank runs ``generate()``; the ranks of one attention DP
  group share their prompts; with ``--attn-dp`` > 1 the DP groups have different prompts and pass
  ``synced_gpus=True`` (HF keeps a finished group stepping until all are done; every group must
  then ask for the same number of new tokens). ``--idle-dp-group``: the last DP group has no
  sequences; ``generate()`` cannot take an empty batch, so it runs a one-token dummy prompt (as
  vLLM's idle DP ranks run dummy batches) to take part in every step's collectives, and its
  tokens are not compared.
- **No layout** (one process): the backend applies only ``--decode-attention`` (one GPU).

Each rank that generates compares its tokens with single-process ``generate()`` (the same model,
uncompiled) and reports its tokens/s (a second, timed ``generate()`` after the compiling one) and
the KV cache bytes it holds; rank 0 prints every rank's line in rank order, then the last line
``OK tokens_match=<n>/<n>`` or
``FAIL tokens_match=<m>/<n> ...``. gloo on CPU, NCCL when CUDA is available (AFD_BACKEND=gloo
forces gloo).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings

import torch
import torch.distributed as dist

import afd_compile
from afd_compile.backend.options import check_options
from afd_compile.errors import refusal
from afd_compile.models import FAMILIES
from afd_compile.progress import Progress
from afd_compile.runtime import (
    check_launch,
    finish,
    init_distributed,
    report_launch_error,
    shutdown,
)


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    dtype = getattr(torch, args.dtype)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, local_files_only=True)
    else:
        cls, cfg_cls, kwargs = FAMILIES[args.family]
        cfg = getattr(transformers, cfg_cls)(**{**kwargs, "num_hidden_layers": args.layers})
        torch.manual_seed(0)
        model = getattr(transformers, cls)(cfg)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.cache_implementation = "static"
    return model


def prompts(unit: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit ``unit``'s batch (an attention rank under AFD, a DP group under TP): 2 or 3
    sequences, the first two tokens of the first one padding (left-padded, attention mask 0)."""
    g = torch.Generator().manual_seed(1000 + unit)
    batch, length = 2 + unit % 2, 5 + unit % 3
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return ids.to(device), mask.to(device)


def kv_bytes(cache: object) -> tuple[int, int]:
    """(bytes held, bytes of all heads) of the keys and values of a transformers cache (0, 0 for
    none). Held: the storage of its tensors, or for a TP rank under the afd backend the slices
    it holds behind HF's tensors (one-element placeholders of the full shape)."""
    layers = getattr(cache, "layers", None) or []
    tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor)]
    held = afd_compile.held_state_bytes(tensors)  # TP ranks: the slices behind HF's placeholders
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if afd_compile.held_state_bytes([t]) == 0}
    full = sum(int(t.numel() * t.element_size()) for t in tensors)
    return held + sum(storages.values()), full


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", type=int, default=0, help="AFD: attention ranks")
    parser.add_argument("--ffn", type=int, default=0, help="AFD: FFN ranks (ranks 0..F-1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism over all ranks")
    parser.add_argument("--attn-dp", type=int, default=1, help="attention DP groups (TP)")
    parser.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    parser.add_argument("--model", help="a local folder to load with from_pretrained instead of --family")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--idle-dp-group", action="store_true",
                        help="TP with --attn-dp: the last DP group has no sequences (it steps a one-token "
                        "dummy prompt)")
    parser.add_argument("--stagger", type=int, default=0,
                        help="AFD: attention rank i generates stagger*i fewer tokens (they finish at different steps)")
    parser.add_argument("--stages", type=int, default=1,
                        help="AFD: micro-batches per step (each its own rows of the static cache)")
    parser.add_argument("--buckets", default="default",
                        help="AFD: the backend's buckets option ('default', 'off', sizes, or 'fixed:N': N rows a rank "
                             "and stage every step, counts on the device)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-inductor", action="store_true", help="run the FX programs (no Inductor)")
    parser.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa", "flex"],
                        help="the backend's decode_attention option (flex: FlexAttention over the filled cache; "
                             "auto: flex on CUDA under a layout, else sdpa)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the backend does")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    afd = args.attention > 0 or args.ffn > 0
    if afd and args.tp > 1:
        parser.error("give an AFD layout (--attention A --ffn F) or a TP layout (--tp N), one of them")
    if args.idle_dp_group and args.attn_dp < 2:
        parser.error("--idle-dp-group needs --attn-dp 2 or more (another DP group has the sequences)")
    if args.stages != 1 and not afd:
        parser.error("--stages applies to AFD layouts (--attention A --ffn F)")
    if args.buckets != "default" and not afd:
        parser.error("--buckets applies to AFD layouts (--attention A --ffn F)")
    if args.stagger and not afd:
        parser.error("--stagger applies to AFD layouts (TP ranks of one step must take the same steps)")
    # the launch and the options are checked before anything is built (one line, exit 2)
    needed = args.attention + args.ffn if afd else args.tp if args.tp > 1 else None
    what = f"layout attention={args.attention} + ffn={args.ffn}" if afd else f"layout tp={args.tp}"
    check_launch(needed, what, " ".join(["examples/generate.py", *sys.argv[1:]]))
    rank, world = init_distributed(timeout_s=args.timeout)
    progress = Progress("generate", quiet=rank != (args.ffn if afd else 0))  # the first attention / TP rank
    if not afd and args.tp == 1 and world > 1:
        parser.error(f"{world} processes: give an AFD layout (--attention A --ffn F) or a TP layout (--tp N) "
                     "(no layout runs one process: the backend then applies --decode-attention alone)")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    options = {"inductor": not args.no_inductor, "timeout_s": args.timeout, "decode_attention": args.decode_attention}
    if afd:
        options.update(attention=args.attention, ffn=args.ffn, stages=args.stages, buckets=args.buckets)
    else:
        options.update(tp=args.tp, attn_dp=args.attn_dp)
    check_options(options)
    progress.line(f"{world} process(es) up, options checked")
    with progress.phase(f"built {args.model or args.family}"):
        model = build_model(args, device)
    vocab = model.config.vocab_size

    if afd and rank < args.ffn:  # an FFN rank: serve until every attention peer finished
        t0 = time.perf_counter()
        steps = afd_compile.serve(model, options)
        line = (f"rank {rank} ffn: served {steps} steps in {time.perf_counter() - t0:.1f}s; kv_cache_bytes=0 "
                "(no cache: this rank runs no attention)")
        match = (0, 0)
    else:
        unit = rank - args.ffn if afd else rank // (args.tp // args.attn_dp)
        idle = args.idle_dp_group and unit == args.attn_dp - 1
        ids, mask = prompts(unit, vocab, device)
        if idle:  # no sequences: a one-token dummy prompt keeps this group stepping with the others
            ids, mask = ids[:1, -1:], mask[:1, -1:]
        new = args.new_tokens - args.stagger * unit if afd else args.new_tokens
        if new < 1:
            parser.error(f"--stagger {args.stagger} leaves attention rank {rank} {new} tokens to generate")
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0, synced_gpus=args.attn_dp > 1)
        with torch.no_grad():
            # the reference on a model of its own: the compiled model allocates its cache itself
            # (through the backend a TP rank then holds only its KV heads)
            with progress.phase("reference generate() (uncompiled)"):
                ref = build_model(args, device).generate(**kw)
            model.forward = torch.compile(model.forward, backend="afd", options=options, dynamic=True)
            with progress.phase("first compiled generate() (compiles the prefill and decode graphs)"):
                model.generate(**kw)
            t0 = time.perf_counter()
            out = model.generate(**kw, return_dict_in_generate=True)
            seconds = time.perf_counter() - t0
            progress.line(f"timed generate() done ({seconds:.1f}s)")
        tokens = out.sequences
        gen, want = tokens[:, ids.shape[1]:], ref[:, ids.shape[1]:]
        same = int((gen == want).sum()) if gen.shape == want.shape else 0
        match = (0, 0) if idle else (same, want.numel())
        diverge = ""
        if not idle and same != want.numel() and gen.shape == want.shape:  # the first step where a sequence differs
            steps = (gen != want).int().argmax(dim=1)
            first = [int(s) for s, bad in zip(steps, (gen != want).any(dim=1), strict=True) if bad]
            diverge = f", first divergence at new token {min(first)} (of {new})"
        held, full = kv_bytes(out["cache"] if "cache" in out else out.get("past_key_values"))
        share = "" if afd else f" of {full} for all KV heads"
        what = "no sequences (a one-token dummy prompt, not compared)" if idle else f"{ids.shape[0]} sequences"
        compared = "" if idle else f"tokens_match={same}/{want.numel()}, "
        line = (f"rank {rank} {'attention' if afd else 'tp' if world > 1 else 'one process'}: {what} x {new} new "
                f"tokens, {ids.shape[0] * new / seconds:.1f} tokens/s, {compared}kv_cache_bytes={held}{share}{diverge}")
        if afd:
            finish()  # the FFN rank stops serving this rank
    totals: list = [None] * world
    dist.all_gather_object(totals, (match, line))  # rank 0 prints every rank's line, in rank order
    if rank == 0:
        for _, text in totals:
            print(text, flush=True)
        totals = [m for m, _ in totals]
        same, total = sum(m[0] for m in totals), sum(m[1] for m in totals)
        ok = total > 0 and same == total
        print(f"{'OK' if ok else 'FAIL'} tokens_match={same}/{total}", flush=True)
    shutdown()
    return 0 if rank != 0 or ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a launch, option or graph the backend refuses: one line, exit 2
        if refusal(e) is None:
            raise
        sys.exit(report_launch_error("generate.py", refusal(e)))
