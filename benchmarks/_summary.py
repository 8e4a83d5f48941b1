"""Derived numbers of a run: efficiency, overlap, memory ratio and the speed-up over PyTorch's native CP.

Definitions (N = ranks, same config / causality / mode / tokens per rank):

- ``t_ideal_ms``          = a ring that wastes nothing: each GPU does 1/N of the whole step's attention work at
                            the single-GPU rate. Batch: the whole row of N x T tokens holds N^2 times the work of
                            the local shard, so N x T_single(local shard, same backend). Packed: the global row is
                            N copies of the local document mix (``_cases.global_document_mix``), N times its work,
                            so 1 x T_single(local mix).
- ``efficiency``          = t_ideal_ms / T_ring(whole sequence)
- ``efficiency_vs_best``  = the same with the fastest single-GPU baseline (all backends, SDPA included)
- ``t_ring_nocomm_ms``    = the ring with its P2P exchange replaced by local copies (``_nocomm``)
- ``mem_ratio``           = peak(ring) / (peak(single, same backend) + K/V double buffer), target <= 1.10
- native CP ``efficiency``= N x T_sdpa_single(same SDPA backend) / T_native_cp
- ``speedup_vs_native``   = T of the fastest native-CP backend / T_ring (> 1: the ring is faster)
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

__all__ = ["summarize", "ideal_shares"]

Key = Tuple[str, str, bool, str, int]


def _key(r: dict) -> Key:
    return (r["config"], r["layout"], r["causal"], r["mode"], r["tokens_per_rank"])


def _ok(r: dict) -> bool:
    return r["status"] == "ok" and r.get("time_ms") is not None


def _median(r: dict) -> float:
    return r["time_ms"]["median_ms"]


def summarize(results: List[dict], world_size: int) -> List[dict]:
    """One row per measured ring run and per native-CP run, with the derived numbers (None when missing)."""
    singles: Dict[Key, Dict[str, dict]] = {}
    nocomm: Dict[Tuple, dict] = {}
    natives: Dict[Key, List[dict]] = {}
    for r in results:
        if not _ok(r):
            continue
        if r["kind"] in ("single", "sdpa_single"):
            singles.setdefault(_key(r), {})[f"{r['kind']}:{r['backend']}"] = r
        elif r["kind"] == "ring_nocomm":
            nocomm[_key(r) + (r["variant"], r["backend"])] = r
        elif r["kind"] == "native_cp":
            natives.setdefault(_key(r), []).append(r)

    rows = []
    for r in results:
        if not _ok(r) or r["kind"] not in ("ring", "native_cp"):
            continue
        key = _key(r)
        base = singles.get(key, {})
        best_name, best = _best(base)
        row = {k: r[k] for k in ("kind", "config", "layout", "variant", "backend", "causal", "mode",
                                 "tokens_per_rank")}
        row["t_ms"] = _median(r)
        row["tflops_per_gpu"] = r.get("tflops_per_gpu")
        same = base.get(("sdpa_single:" if r["kind"] == "native_cp" else "single:") + r["backend"])
        row["t_single_ms"] = _median(same) if same else None
        shares = ideal_shares(r["layout"], world_size)
        row["t_ideal_ms"] = shares * row["t_single_ms"] if same else None
        row["efficiency"] = row["t_ideal_ms"] / row["t_ms"] if same else None
        row["best_single"] = best_name
        row["efficiency_vs_best"] = shares * _median(best) / row["t_ms"] if best else None
        if r["kind"] == "ring":
            nc = nocomm.get(key + (r["variant"], r["backend"]))
            row["t_ring_nocomm_ms"] = _median(nc) if nc else None
            row["mem_ratio"] = _mem_ratio(r, same)
            fastest_native = min((_median(n) for n in natives.get(key, []) if n["layout"] == "batch"), default=None)
            row["speedup_vs_native"] = fastest_native / row["t_ms"] if fastest_native else None
        else:
            row["rotate"] = r.get("rotate")
        rows.append(row)
    return rows


def ideal_shares(layout: str, world_size: int) -> int:
    """How many single-GPU baselines a wasteless ring takes per GPU (module docstring): N for a batch row, 1 for
    a packed row."""
    return world_size if layout == "batch" else 1


def _best(base: Dict[str, dict]) -> Tuple[Optional[str], Optional[dict]]:
    if not base:
        return None, None
    name = min(base, key=lambda n: _median(base[n]))
    return name, base[name]


def _mem_ratio(ring: dict, single: Optional[dict]) -> Optional[float]:
    if not single or ring.get("peak_mem_bytes") is None or single.get("peak_mem_bytes") is None:
        return None
    return ring["peak_mem_bytes"] / (single["peak_mem_bytes"] + ring["kv_double_buffer_bytes"])
