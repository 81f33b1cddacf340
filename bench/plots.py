"""PNG plots from whatever benchmark JSONs exist in bench/results/ (missing files or keys: that plot is skipped).

* throughput.png: generation tokens/s per system (throughput.json) and rerank pairs/s per system (rerank.json).
* latency.png: TTFT p50/p99 and TPOT p50 vs offered rate, continuous vs static (latency.json).
* steps_throughput.png, steps_mixed.png: batch composition per step over time, stacked decode / prefill / rerank
  tokens (the `steps` series of throughput.json and mixed.json).
* mixed.png: decode TPOT p99 and rerank pairs/s, alone vs mixed per setting, with the targets (mixed.json).
* mixed_objective.png: decode TPOT p99 vs rerank pairs/s for the swept shares and the latency objective (mixed.json).
* rerank_quality.png: nDCG@10 (+- one standard error) per ranker per corpus, one panel per first-stage depth K,
  with BM25's recall@K (the ceiling) as a dotted line (rerank_quality.json).

`python -m bench.plots [results_dir]`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.report import RESULTS


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _generation_systems(data: dict | None) -> dict[str, float]:
    if not data:
        return {}
    systems = data.get("systems")
    if isinstance(systems, dict):
        return {n: float(s["tok_s"]) for n, s in systems.items() if isinstance(s, dict) and "tok_s" in s}
    return {k[:-len("_tok_s")]: float(v) for k, v in data.items() if k.endswith("_tok_s")
            and isinstance(v, (int, float))}


def _rerank_systems(data: dict | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for section, label in (("cross_encoder", "CE"), ("llm_judge", "LLM judge")):
        part = (data or {}).get(section)
        if isinstance(part, dict):
            for k, v in part.items():
                if k.endswith("_pairs_s") and isinstance(v, (int, float)):
                    out[f"{label}: {k[:-len('_pairs_s')]}"] = float(v)
    return out


def plot_throughput(gen: dict[str, float], rerank: dict[str, float], path: Path) -> Path | None:
    panels = [(t, d, y) for t, d, y in (("generation (throughput.json)", gen, "useful tokens / s"),
                                         ("rerank (rerank.json)", rerank, "pairs / s")) if d]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, data, ylabel) in zip(axes[0], panels):
        names = list(data)
        bars = ax.bar(range(len(names)), [data[n] for n in names],
                      color=["tab:blue" if n.split(": ")[-1].startswith("tandem") else "tab:gray" for n in names])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    return _save(fig, path)


def plot_latency(data: dict | None, path: Path) -> Path | None:
    rates = (data or {}).get("rates")
    if not isinstance(rates, list) or not rates:
        return None
    systems = [s for s in data.get("systems", ["continuous", "static"]) if all(s in r for r in rates)]
    if not systems:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["offered_req_s"] for r in rates]
    for name, color in zip(systems, ["tab:blue", "tab:orange", "tab:green"]):
        for key, style in (("ttft_p50_s", "-o"), ("ttft_p99_s", "--^")):
            a1.plot(x, [r[name].get(key) for r in rates], style, color=color, label=f"{name} {key[5:8]}")
        for key, style in (("tpot_p50_s", "-o"), ("tpot_p99_s", "--^")):
            a2.plot(x, [r[name].get(key) for r in rates], style, color=color, label=f"{name} {key[5:8]}")
    cap = data.get("capacity_req_s")
    for ax, title in ((a1, "time to first token"), (a2, "time per output token")):
        if cap:
            ax.axvline(cap, color="gray", lw=0.8, ls=":", label="measured capacity")
        ax.set_xlabel("offered load (requests / s, Poisson)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_steps(steps: dict | None, title: str, path: Path) -> Path | None:
    if not isinstance(steps, dict) or not steps.get("t"):
        return None
    t = steps["t"]
    layers = [(k, c) for k, c in (("decode_tokens", "tab:blue"), ("prefill_tokens", "tab:orange"),
                                  ("rerank_tokens", "tab:green")) if len(steps.get(k) or []) == len(t)]
    if not layers:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(t, *[steps[k] for k, _ in layers], labels=[k.replace("_", " ") for k, _ in layers],
                 colors=[c for _, c in layers], step="post")
    if len(steps.get("num_running") or []) == len(t):
        ax2 = ax.twinx()
        ax2.plot(t, steps["num_running"], color="black", lw=0.8, drawstyle="steps-post", label="running sequences")
        ax2.set_ylabel("running sequences")
        ax2.legend(loc="upper right", fontsize=7)
    every = steps.get("every", 1)
    ax.set_title(title + (f" (every {every}th step)" if every and every > 1 else ""))
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("tokens in the step")
    ax.legend(loc="upper left", fontsize=7)
    return _save(fig, path)


def plot_mixed(data: dict | None, path: Path) -> Path | None:
    if not data or not data.get("settings") or "decode_alone" not in data or "rerank_alone" not in data:
        return None
    plt = _plt()
    settings = data["settings"]
    labels = ["alone"] + [f"mixed\nshare {s.get('rerank_share')}" for s in settings]
    tpot = [data["decode_alone"]["tpot_p99_s"]] + [s["tpot_p99_s"] for s in settings]
    pairs = [data["rerank_alone"]["pairs_s"]] + [s["rerank_pairs_s"] for s in settings]
    targets = data.get("targets", {})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(range(len(labels)), tpot, color=["tab:gray"] + ["tab:blue"] * len(settings))
    a1.axhline(tpot[0] * targets.get("tpot_p99_ratio_max", 1.5), color="red", ls="--", lw=1, label="target")
    a1.set_title("decode TPOT p99 (lower is better)")
    a1.set_ylabel("seconds")
    a2.bar(range(len(labels)), pairs, color=["tab:gray"] + ["tab:green"] * len(settings))
    a2.axhline(pairs[0] * targets.get("rerank_throughput_ratio_min", 0.8), color="red", ls="--", lw=1,
               label="target")
    a2.set_title("rerank throughput (higher is better)")
    a2.set_ylabel("pairs / s")
    for ax in (a1, a2):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_objective(data: dict | None, path: Path) -> Path | None:
    """Decode TPOT p99 against rerank pairs/s during the flood: each fixed share swept, and the latency objective
    (issue #18), with its target and 1.1x it."""
    objective = (data or {}).get("objective")
    settings = (data or {}).get("settings") or []
    if not objective or not settings:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = [s["rerank_pairs_s"] for s in settings], [s["steady_tpot_p99_s"] for s in settings]
    ax.plot(xs, ys, "o-", color="tab:blue", label="fixed rerank_share (sweep)")
    for s, x, y in zip(settings, xs, ys):
        ax.annotate(f"{s['rerank_share']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot([objective["rerank_pairs_s"]], [objective["steady_tpot_p99_s"]], "*", ms=14, color="tab:red",
            label="latency objective")
    target = objective["target_s"]
    ax.axhline(target, color="tab:red", ls="--", lw=1, label="target T")
    ax.axhline(1.1 * target, color="tab:red", ls=":", lw=1, label="1.1 T")
    ax.set_xlabel("rerank pairs / s during the flood")
    ax.set_ylabel("decode TPOT p99, steady (s)")
    ax.set_title("mixed run: decode latency vs rerank throughput")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_rerank_quality(data: dict | None, path: Path) -> Path | None:
    corpora = (data or {}).get("corpora")
    ks = (data or {}).get("ks")
    if not isinstance(corpora, dict) or not corpora or not isinstance(ks, list) or not ks:
        return None

    def metrics(name: str, k: int, ranker: str) -> dict | None:
        """The ranker on the queries it scored (k{K}; the legend gives their number)."""
        for key in (f"k{k}",):
            m = (corpora[name].get(key) or {}).get(ranker)
            if isinstance(m, dict):
                return m
        return None

    if not any(metrics(n, k, r) for n in corpora for k in ks for r in data.get("rankers", [])):
        return None
    plt = _plt()
    names = list(corpora)
    fig, axes = plt.subplots(1, len(ks), figsize=(6.5 * len(ks), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    default = data.get("default_mode")
    for ax, k in zip(axes[0], ks):
        # Rankers scored at this depth (the LLM modes only up to --llm-depth).
        rankers = [r for r in data.get("rankers", []) if all(metrics(n, k, r) for n in names)]
        width = 0.8 / max(1, len(rankers))
        for j, r in enumerate(rankers):
            rows = [metrics(n, k, r) for n in names]
            xs = [i + (j - (len(rankers) - 1) / 2) * width for i in range(len(names))]
            label = r + (" (default)" if r == default else "") + f" [{'/'.join(str(m['queries']) for m in rows)}q]"
            label += " (seeded head: floor)" if r == "cross-encoder" else ""
            bars = ax.bar(xs, [m["ndcg@10"] for m in rows], width, yerr=[m["ndcg@10_stderr"] for m in rows],
                          capsize=2, color=colors[j % len(colors)], label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=2)
        for i, n in enumerate(names):
            ceiling = (metrics(n, k, "bm25_recall") or {}).get("recall")
            if isinstance(ceiling, (int, float)):
                ax.hlines(ceiling, i - 0.45, i + 0.45, colors="black", linestyles=":", lw=1,
                          label="BM25 recall@K (ceiling)" if i == 0 else None)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, 1.45)
        ax.set_ylabel("nDCG@10")
        ax.set_title(f"reranking BM25's top {k} (queries per corpus: legend)", fontsize=10)
        ax.legend(fontsize=6, loc="upper center", ncol=3)  # per panel: the LLM modes may be missing at larger K
    return _save(fig, path)


def plot_all(results_dir: Path = RESULTS) -> list[Path]:
    """Every plot whose inputs exist under `results_dir`; returns the PNG paths written."""
    results_dir = Path(results_dir)
    throughput = _load(results_dir / "throughput.json")
    rerank = _load(results_dir / "rerank.json")
    mixed = _load(results_dir / "mixed.json")
    latency = _load(results_dir / "latency.json")
    written = [
        plot_rerank_quality(_load(results_dir / "rerank_quality.json"), results_dir / "rerank_quality.png"),
        plot_throughput(_generation_systems(throughput), _rerank_systems(rerank), results_dir / "throughput.png"),
        plot_latency(latency, results_dir / "latency.png"),
        plot_steps((throughput or {}).get("steps"), "generation throughput run: batch composition per step",
                   results_dir / "steps_throughput.png"),
        plot_steps((mixed or {}).get("steps"), "mixed run (generation + rerank flood): batch composition per step",
                   results_dir / "steps_mixed.png"),
        plot_mixed(mixed, results_dir / "mixed.png"),
        plot_objective(mixed, results_dir / "mixed_objective.png"),
    ]
    return [p for p in written if p is not None]


if __name__ == "__main__":
    for p in plot_all(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS):
        print(p)
