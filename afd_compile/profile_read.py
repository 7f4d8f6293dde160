"""Reading a profile ``afd-compile profile`` wrote (``profile.py``) into the cost model's parts:
:func:`read_profile` checks the record (its format, model, device, sizes) and turns it into
:class:`~afd_compile.estimate.Costs` per layer (each program less its call, over its layers; without
a second depth, the attention program less the head; of a model with layers of several kinds, each
kind's layer so, weighted by its count) and once a step (each program's call,
:func:`call_curves`). Pure: no device, no model loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import AFDCompileError
from .estimate import Costs, Curve, KVCurves, LayerKind, ModelFacts

PROFILE_FORMAT = "afd-compile-profile/1"


class ProfileError(AFDCompileError):
    """A profile that cannot be made or read: the model, the device or the record says why."""


def _curve(rec: dict, key: str, size: str, per: Callable[[int, float], float], path: str,
           routing: tuple[int, int] = (0, 0)) -> Curve:
    rows = rec.get(key)
    if not isinstance(rows, list) or len(rows) < 2:
        raise ProfileError(f"{path}: '{key}' needs at least 2 measured sizes, has {len(rows or [])}: profile again")
    try:
        return Curve(tuple((int(r[size]), max(0.0, per(int(r[size]), float(r["median_us"])))) for r in rows), routing)
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: '{key}': {e}: not a profile afd-compile wrote") from None


def kind_counts(rec: dict, layers: int | tuple[int, ...], path: str = "the profile") -> list[float]:
    """How many of the model's ``layers`` each kind of a profile with ``kinds`` has ([] without): as
    profiled at its depth; at another depth (``plan --layers N`` for an export of fewer layers), kinds
    in runs (dense first layers, then MoE ones: an export with fewer of the last) give the last kind
    the layers added, interleaved kinds keep their shares. ``layers`` as one count per kind, in the
    order the model first has them (``plan --layers 3,58``), gives them as they are."""
    kinds = rec.get("kinds") or []
    if not isinstance(kinds, list) or any(not isinstance(c, dict) or int(c["profiled_layers"]) < 1 for c in kinds):
        raise ProfileError(f"{path}: 'kinds' is malformed: not a profile afd-compile wrote")
    counts = [float(c["layers"]) for c in kinds]
    if isinstance(layers, tuple):
        if len(layers) != max(len(counts), 1):
            firsts = [int(c.get("first", -1)) for c in kinds] if kinds else [0]
            raise ProfileError(f"--layers {','.join(map(str, layers))}: {len(layers)} counts, but {path} has "
                               f"{max(len(counts), 1)} kind(s) of layer (first at layers {firsts}): give one count a "
                               "kind in that order, or the model's depth")
        return [float(n) for n in layers] if counts else []
    order = (rec.get("model") or {}).get("layer_kinds") or []
    if not counts or layers == sum(counts):
        return counts
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    if len(runs) == len(set(runs)) and layers > sum(counts) - counts[order[-1]]:
        counts[order[-1]] += layers - sum(counts)
        return counts
    return [c * layers / sum(counts) for c in counts]


def _kind_weighted_bytes(m: dict, counts: list[float]) -> dict[str, int]:
    """A layer's weight bytes on each side, the kinds' (``kind_bytes``) weighted by ``counts``; {}
    where the profile has no such (one kind: the facts' bytes are the layers' own)."""
    per = m.get("kind_bytes")
    if not counts or not per:
        return {}
    return {key: int(sum(c * b[key] for c, b in zip(counts, per, strict=True)) / sum(counts))
            for key in ("attention_bytes", "ffn_bytes")}


def _kinds(rec: dict, counts: list[float], once: Callable[[int], float], ffn_once: Callable[[int], float],
           facts: ModelFacts, path: str) -> tuple[LayerKind, ...]:
    """Each kind of layer of a profile with ``kinds`` as the cost model's :class:`LayerKind`: its share
    of ``counts``, its layer's curves (its programs less their call over its layers timed), whether
    its FFN is an MoE and its weight bytes (``kind_bytes``); () without kinds."""
    kinds, per = rec.get("kinds") or [], (rec.get("model") or {}).get("kind_bytes") or []
    if not kinds:
        return ()
    if len(per) != len(kinds):
        raise ProfileError(f"{path}: 'kind_bytes' does not match 'kinds': not a profile afd-compile wrote")
    out = []
    for n, c, b in zip(counts, kinds, per, strict=True):
        k = int(c["profiled_layers"])
        routing = (facts.experts, facts.top_k) if b["moe"] else (0, 0)
        out.append(LayerKind(n / sum(counts), _curve(c, "attention", "tokens", lambda x, us, k=k: (us - once(x)) / k,
                                                     path),
                             _curve(c, "ffn", "rows", lambda x, us, k=k: (us - ffn_once(x)) / k, path, routing),
                             bool(b["moe"]), int(b["attention_bytes"]), int(b["ffn_bytes"])))
    return tuple(out)


def _layer_curve(rec: dict, key: str, size: str, once: Callable[[int], float], k: int, path: str,
                 kinds: tuple[LayerKind, ...], routing: tuple[int, int] = (0, 0)) -> Curve:
    """One layer of program ``key``: its rows less its call (``once``) over the ``k`` layers timed; of a
    model with layers of several kinds (``kinds``: :func:`_kinds`), their layers' mean weighted by
    their shares, at the sizes of the first kind."""
    if not kinds:
        return _curve(rec, key, size, lambda x, us: (us - once(x)) / k, path, routing)
    parts = [(kind.share, getattr(kind, key)) for kind in kinds]
    return Curve(tuple((x, sum(w * part.at(x) for w, part in parts)) for x, _ in parts[0][1].points), routing)


def call_curves(rec: dict, k: int, path: str) -> dict[str, Curve]:
    """Each program's time beyond its layers, from its two depths (``second_depth``): at a size timed
    at both, ``k`` layers taking ``t_k`` and ``d`` taking ``t_d``, a layer is ``(t_k - t_d) / (k - d)`` and
    the rest ``t_k - k x`` that (clamped to [0, t_k]); {} for a profile of one depth."""
    second = rec.get("second_depth")
    if not second:
        return {}
    d = int(second["layers"])
    if d == k:
        raise ProfileError(f"{path}: 'second_depth' times {d} layers, as the profile does: profile again")
    out = {}
    for key, size in (("attention", "tokens"), ("ffn", "rows"), ("no_layout", "tokens")):
        whole = {int(r[size]): float(r["median_us"]) for r in rec[key]}
        points = []
        for r in second[key]:
            t = int(r[size])
            if t in whole:
                per = (whole[t] - float(r["median_us"])) / (k - d)
                points.append((t, min(whole[t], max(0.0, whole[t] - k * per))))
        if not points:
            raise ProfileError(f"{path}: 'second_depth' times {key} at no size the profile timed: profile again")
        out[key] = Curve(tuple(sorted(points)))
    return out


def read_profile(path: str, model: str | None = None, device: str | None = None,
                 layers: int | tuple[int, ...] | None = None) -> tuple[Costs, ModelFacts, dict[str, Any]]:
    """The cost model's parts of the profile at ``path``: refused (ProfileError, one line) when it is
    not one, was made of another model than ``model`` (sha256) or on another device than ``device``
    (a substring of the device's name, e.g. "H200"), or lacks a size. ``layers``: the real model's
    depth (default: the profiled program's), or its layers of each kind (:func:`kind_counts`)."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: cannot read a profile: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{path}: not an afd-compile profile (format {PROFILE_FORMAT!r}); make one with "
                           "afd-compile profile MODEL.pt2 -o PROFILE.json")
    m, dev = rec.get("model") or {}, rec.get("device") or {}
    if model is not None:
        from .saved import sha256_of

        if m.get("sha256") != sha256_of(model):
            raise ProfileError(f"{path} was measured on {m.get('file')!r} (sha256 {str(m.get('sha256'))[:12]}...), "
                               f"not on {model}: profile this model")
    if device is not None and device.lower() not in str(dev.get("name", "")).lower():
        raise ProfileError(f"{path} was measured on {dev.get('name')!r}, not on a {device}: profile on the "
                           "device you estimate for")
    try:
        k = int(m.get("profiled_layers", m["layers"]))  # (the layers timed; the model's depth: "layers")
        facts = ModelFacts(**{f: int(m[f]) for f in ModelFacts.__dataclass_fields__ if f != "heads"},
                           heads=int(m.get("heads", 0)))
        counts = kind_counts(rec, layers or facts.layers, path)
        depth = sum(layers) if isinstance(layers, tuple) else layers or facts.layers
        facts = ModelFacts(**{**facts.__dict__, "layers": depth, **_kind_weighted_bytes(m, counts)})
        head = _curve(rec, "head", "tokens", lambda t, us: us, path)
        calls = call_curves(rec, k, path)
        once = calls.get("attention", head).at
        ffn_once = calls["ffn"].at if "ffn" in calls else lambda r: 0.0
        kinds = _kinds(rec, counts, once, ffn_once, facts, path)
        attention = _layer_curve(rec, "attention", "tokens", once, k, path, kinds)
        ffn = _layer_curve(rec, "ffn", "rows", ffn_once, k, path, kinds, (facts.experts, facts.top_k))
        contexts = sorted({int(r["context"]) for r in rec.get("kv") or []})
        if not contexts:
            raise ProfileError(f"{path}: 'kv' has no measured context: profile again")
        kv = KVCurves(tuple(contexts), tuple(_curve({"kv": [r for r in rec["kv"] if int(r["context"]) == c]},
                                                    "kv", "batch", lambda b, us: us, path) for c in contexts))
        costs = Costs(str(dev["name"]), int(dev["memory_bytes"]), attention, ffn, head, kv,
                      calls.get("attention"), calls.get("ffn"), calls.get("no_layout"), kinds)
    except ProfileError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: missing or malformed field {e}: not a profile afd-compile wrote") from None
    return costs, facts, rec
