"""Render a ring_bench JSON file as markdown tables and a plot of efficiency per variant x backend.

    python benchmarks/report.py benchmarks/results/ring_bench_<device>_<date>.json   # writes .md and .png
    python benchmarks/report.py --resummarize <file>.json   # the summary recomputed from the results first

The markdown needs nothing but the standard library; the plot needs matplotlib (``pip install matplotlib``),
which the GPU machine may lack: run this script wherever matplotlib is, on the JSON that came back.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Iterable, List, Optional

__all__ = ["markdown", "compact", "plot", "try_plot", "targets", "merge"]

TARGET_TOKENS = 8192   # issue 8's targets are stated at 8k tokens per GPU, forward+backward, 2 GPUs


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.3f}"


def _num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _causal(c: bool) -> str:
    return "causal" if c else "non-causal"


def _table(header: List[str], rows: Iterable[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _ring_rows(summary: List[dict]) -> List[List[str]]:
    rows = []
    for s in sorted((s for s in summary if s["kind"] == "ring"),
                    key=lambda s: (s["tokens_per_rank"], s["config"], s["mode"], not s["causal"], s["layout"],
                                   s["variant"], s["backend"])):
        rows.append([str(s["tokens_per_rank"]), s["config"], s["mode"], _causal(s["causal"]), s["layout"],
                     s["variant"], s["backend"], _ms(s["t_ms"]), _ms(s["t_ideal_ms"]), _pct(s["efficiency"]),
                     _pct(s["efficiency_vs_best"]), _ms(s.get("t_ring_nocomm_ms")),
                     _num(s.get("tflops_per_gpu"), "{:.3g}"), _num(s.get("mem_ratio")),
                     _num(s.get("speedup_vs_native"))])
    return rows


def _native_rows(summary: List[dict]) -> List[List[str]]:
    return [[str(s["tokens_per_rank"]), s["config"], s["mode"], _causal(s["causal"]), s["backend"],
             str(s.get("rotate")), _ms(s["t_ms"]), _ms(s["t_single_ms"]), _pct(s["efficiency"])]
            for s in sorted((s for s in summary if s["kind"] == "native_cp"),
                            key=lambda s: (s["tokens_per_rank"], s["config"], s["mode"], not s["causal"],
                                           s["backend"]))]


def _single_rows(results: List[dict]) -> List[List[str]]:
    rows = []
    for r in results:
        if r["kind"] in ("single", "sdpa_single") and r["status"] == "ok":
            rows.append([str(r["tokens_per_rank"]), r["config"], r["mode"], _causal(r["causal"]), r["layout"],
                         ("sdpa " if r["kind"] == "sdpa_single" else "") + r["backend"],
                         _ms(r["time_ms"]["median_ms"]), _num(r.get("tflops_per_gpu"), "{:.3g}"),
                         _num(None if r.get("peak_mem_bytes") is None else r["peak_mem_bytes"] / 2**30)])
    return sorted(rows)


def _not_measured(results: List[dict]) -> List[List[str]]:
    seen = defaultdict(set)
    for r in results:
        if r["status"] != "ok":
            what = f"{r['kind']} {r['variant']}/{r['backend']}"
            seen[(what, r["status"], r.get("reason", "")[:300])].add(
                f"{r['config']} {r['layout']} {_causal(r['causal'])} {r['tokens_per_rank']}")
    return [[what, status, reason.replace("|", "/").replace("\n", " "), str(len(where))]
            for (what, status, reason), where in sorted(seen.items())]


def targets(doc: dict) -> List[List[str]]:
    """Issue 8's targets (2 GPUs, fwd+bwd, 8k tokens per GPU), per config: what this run reached."""
    summary = [s for s in doc["summary"] if s["mode"] == "fwd_bwd" and s["tokens_per_rank"] == TARGET_TOKENS]
    rows = []
    for cfg in sorted({s["config"] for s in summary}):
        ring = [s for s in summary if s["config"] == cfg and s["kind"] == "ring" and s["efficiency"] is not None]

        def best(pred):
            cands = [s for s in ring if pred(s)]
            return max(cands, key=lambda s: s["efficiency_vs_best"] or 0.0, default=None)

        z = best(lambda s: s["variant"] == "zigzag" and s["causal"])
        nc = best(lambda s: s["variant"] == "ring" and not s["causal"])
        vl = best(lambda s: s["variant"] in ("llama3", "zigzag_varlen"))
        mem = [s["mem_ratio"] for s in ring if s.get("mem_ratio") is not None]
        rows.append([cfg, "causal zigzag, best backend: efficiency >= 95%", _who(z), _pct(z and z["efficiency"])])
        rows.append([cfg, "causal zigzag vs fastest native CP: >= 1.3x", _who(z),
                     _num(z and z.get("speedup_vs_native")) + "x"])
        rows.append([cfg, "non-causal ring: efficiency >= 95%", _who(nc), _pct(nc and nc["efficiency"])])
        rows.append([cfg, "varlen (llama3 / zigzag varlen): efficiency >= 85%", _who(vl),
                     _pct(vl and vl["efficiency"])])
        rows.append([cfg, "peak memory <= 1.10x (single + K/V double buffer)", "worst ring run",
                     _num(max(mem) if mem else None) + "x"])
    return rows


def _who(s: Optional[dict]) -> str:
    return "not measured" if s is None else f"{s['variant']}/{s['backend']} ({_causal(s['causal'])})"


def markdown(doc: dict) -> str:
    st = doc["stamp"]
    out = [f"# Ring attention benchmark: {st['world_size']} x {st['device_name']}\n",
           f"{st['date']} · torch {st['torch']} · CUDA {st.get('cuda')} · cuDNN {st.get('cudnn')} · "
           f"triton {st.get('triton')} · flash-attn {st.get('flash_attn')} · transformers {st.get('transformers')} · "
           f"commit {st.get('git_commit')}{' (dirty)' if st.get('git_dirty') else ''} · dtype "
           f"{doc['settings']['dtype']}{'' if doc.get('complete', True) else ' · INCOMPLETE RUN'}"
           f"{' · env ' + ' '.join(f'{k}={v}' for k, v in st['env'].items()) if st.get('env') else ''}"
           f"{' (' + doc['aborted'] + ')' if doc.get('aborted') else ''}\n",
           f"Backends: {', '.join(doc['settings'].get('backends', []))}"
           + "".join(f"; left out: {b} ({why})" for b, why in doc["settings"].get("backends_left_out", {}).items())
           + "\n",
           "Times are medians per call, slowest rank. Efficiency = T_ideal / T_ring, T_ideal = N x T_single(local "
           "shard, same backend) for batch rows and T_single(local document mix) for packed rows (the global row "
           "is N copies of that mix); 'vs best' uses the fastest single-GPU baseline of any backend. See "
           "benchmarks/README.md.\n"]
    if any(s["tokens_per_rank"] == TARGET_TOKENS for s in doc["summary"]):
        out += ["## Targets (issue 8)\n", _table(["config", "target", "best run", "reached"], targets(doc))]
    out += ["## Ring attention\n", _table(
        ["tokens/GPU", "config", "mode", "mask", "layout", "variant", "backend", "T ring ms", "T ideal ms",
         "efficiency", "vs best", "T no-comm ms", "TFLOP/s/GPU", "mem ratio", "x native"], _ring_rows(doc["summary"]))]
    native = _native_rows(doc["summary"])
    if native:
        out += ["## PyTorch native context_parallel\n", _table(
            ["tokens/GPU", "config", "mode", "mask", "SDPA backend", "rotate", "T ms", "T single ms", "efficiency"],
            native)]
    out += ["## Single-GPU baselines (local shard)\n", _table(
        ["tokens/GPU", "config", "mode", "mask", "layout", "backend", "T ms", "TFLOP/s", "peak GiB"],
        _single_rows(doc["results"]))]
    missing = _not_measured(doc["results"])
    if missing:
        out += ["## Not measured\n", _table(["what", "status", "reason", "cases"], missing)]
    return "\n".join(out)


def compact(doc: dict) -> str:
    """A short plain-text digest for a terminal whose output is cut (the device tool keeps ~12k characters):
    issue 8's targets, then per (tokens, config, mask, variant) the best backend's fwd+bwd numbers."""
    lines = []
    if any(s["tokens_per_rank"] == TARGET_TOKENS for s in doc["summary"]):
        lines += [f"TARGET {cfg}: {what} -> {reached} [{who}]" for cfg, what, who, reached in targets(doc)]
    best = {}
    for s in doc["summary"]:
        if s["mode"] != "fwd_bwd":
            continue
        key = (s["tokens_per_rank"], s["config"], s["causal"], s["variant"] if s["kind"] == "ring" else "native_cp")
        if key not in best or s["t_ms"] < best[key]["t_ms"]:
            best[key] = s
    for (tokens, cfg, causal, variant), s in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], not kv[0][2],
                                                                                 kv[0][3])):
        lines.append(f"{tokens} {cfg} {'causal' if causal else 'full'} {variant}/{s['backend']}: "
                     f"{_ms(s['t_ms'])} ms, eff {_pct(s['efficiency'])}, vs best {_pct(s['efficiency_vs_best'])}, "
                     f"no-comm {_ms(s.get('t_ring_nocomm_ms'))} ms, mem {_num(s.get('mem_ratio'))}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> str:
    """Bar chart of efficiency per variant x backend, one panel per (tokens, config, mode). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ring = [s for s in doc["summary"] if s["kind"] == "ring" and s["efficiency"] is not None]
    native = [s for s in doc["summary"] if s["kind"] == "native_cp" and s["efficiency"] is not None]
    panels = sorted({(s["tokens_per_rank"], s["config"], s["mode"]) for s in ring + native})
    if not panels:
        raise ValueError(f"plot: {path}: no efficiency to plot (no ring run with its single-GPU baseline)")
    backends = sorted({s["backend"] for s in ring + native})
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    for ax, (tokens, cfg, mode) in zip(axes[:, 0], panels):
        rows = [s for s in ring + native if (s["tokens_per_rank"], s["config"], s["mode"]) == (tokens, cfg, mode)]
        groups = sorted({(s["variant"] if s["kind"] == "ring" else "native_cp", s["causal"]) for s in rows},
                        key=lambda g: (not g[1], g[0]))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            xs, ys = [], []
            for j, (variant, causal) in enumerate(groups):
                hit = [s for s in rows if s["backend"] == b and s["causal"] == causal
                       and (s["variant"] if s["kind"] == "ring" else "native_cp") == variant]
                if hit:
                    xs.append(j + i * width)
                    ys.append(100 * max(s["efficiency"] for s in hit))
            ax.bar(xs, ys, width, label=b)
        ax.axhline(95, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{v}\n{'causal' if c else 'full'}" for v, c in groups], fontsize=8)
        ax.set_ylabel("efficiency %")
        ax.set_title(f"{cfg}, {tokens} tokens/GPU, {mode}, {doc['stamp']['world_size']} x {doc['stamp']['device_name']}",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=len(backends))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def try_plot(json_path: str) -> str:
    """Write ``<stem>.png`` next to the JSON if matplotlib is importable; return a line saying what happened."""
    png = json_path[:-5] + ".png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed: no plot; run `python benchmarks/report.py {json_path}` where it is"
    with open(json_path) as f:
        doc = json.load(f)
    try:
        return f"wrote {plot(doc, png)}"
    except ValueError as exc:
        return str(exc)


def merge(docs: List[dict]) -> dict:
    """One document from several runs on the same machine kind (e.g. the 8k and the 32k device calls).

    Results are concatenated and the summary recomputed; runs on different devices or world sizes are
    refused, because their ratios must not be mixed.
    """
    from _summary import summarize

    first = docs[0]
    for d in docs[1:]:
        for key in ("device_name", "world_size", "torch"):
            if d["stamp"].get(key) != first["stamp"].get(key):
                raise ValueError(f"merge: runs differ in {key}: {first['stamp'].get(key)!r} vs "
                                 f"{d['stamp'].get(key)!r}; merge only runs made on the same machine kind")
    results = [r for d in docs for r in d["results"]]
    merged = dict(first, results=results, summary=summarize(results, first["stamp"]["world_size"]))
    merged["complete"] = all(d.get("complete", True) for d in docs)
    merged["merged_from"] = [d["stamp"]["date"] for d in docs]
    return merged


def _load(path: str) -> dict:
    if not path.endswith(".json"):
        raise SystemExit(f"report.py: {path!r} is not a .json file written by ring_bench.py")
    with open(path) as f:
        return json.load(f)


def _render(doc: dict, json_path: str, with_plot: bool) -> None:
    md = json_path[:-5] + ".md"
    with open(md, "w") as f:
        f.write(markdown(doc))
    print(f"wrote {md}")
    if with_plot:
        print(try_plot(json_path))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ring_bench JSON -> markdown table (+ plot with matplotlib)")
    p.add_argument("json", nargs="+")
    p.add_argument("--merge", metavar="OUT.json", help="merge the runs into one JSON (then one .md and .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--resummarize", action="store_true",
                   help="recompute each file's summary from its measured results (benchmarks/_summary.py) and "
                        "write it back to the JSON before rendering; the results themselves are not touched")
    args = p.parse_args(argv)
    if args.merge:
        if not args.merge.endswith(".json"):
            raise SystemExit(f"--merge {args.merge!r}: the output name must end in .json")
        doc = merge([_load(path) for path in args.json])
        with open(args.merge, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.merge}")
        _render(doc, args.merge, not args.no_plot)
        return 0
    for path in args.json:
        doc = _load(path)
        if args.resummarize:
            from _summary import summarize

            doc["summary"] = summarize(doc["results"], doc["stamp"]["world_size"])
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {path} (summary recomputed)")
        _render(doc, path, not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
