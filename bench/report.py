"""Turn a pytest-benchmark JSON from `pytest bench/` into docs/benchmarks.md and docs/bench-*.png.

Usage: python -m bench.report RESULTS.json [--out-dir docs]
       python -m bench.report --peers-table RESULTS.json [MORE.json ...]   (prints the peers table)

The hand-written reading of the numbers lives between the READING markers in the existing
benchmarks.md and is carried over when the file is regenerated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

READING_START = "<!-- reading:start -->"
READING_END = "<!-- reading:end -->"
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "docs"
SYSTEM_LABELS = {"ours": "compiled-engine", "hf": "HF transformers", "vllm": "vLLM", "llamacpp": "llama.cpp"}
PEER_LABELS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


@dataclass(frozen=True)
class Spread:
    """A median with its interquartile range, in the unit of the table it goes into."""

    median: float
    iqr: float

    def show(self, digits: int = 1) -> str:
        return f"{self.median:,.{digits}f} (±{self.iqr:,.{digits}f})"


def spread(values: list[float], scale: float = 1.0) -> Spread:
    if not values:
        raise ValueError("no values to summarise")
    scaled = [v * scale for v in values]
    if len(scaled) < 2:
        return Spread(scaled[0], 0.0)
    q1, _, q3 = statistics.quantiles(scaled, n=4, method="inclusive")
    return Spread(statistics.median(scaled), q3 - q1)


def load(path: Path) -> tuple[dict, dict[tuple[str, str, int, str], dict]]:
    """The run's context block and every benchmark keyed by (workload, model, param, system)."""
    data = json.loads(path.read_text())
    context = data.get("compiled_engine_bench")
    if context is None:
        raise ValueError(f"{path} has no 'compiled_engine_bench' block: was it written by `pytest bench/`?")
    results = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if not {"workload", "model", "param", "system"} <= info.keys():
            continue
        if bench.get("stats") is None:
            raise ValueError(
                f"{path}: benchmark {bench['name']} has no timings (run without --benchmark-disable)"
            )
        results[(info["workload"], info["model"], info["param"], info["system"])] = bench
    if not results:
        raise ValueError(f"{path} holds no bench results")
    return context, results


def _models(results, workload: str) -> list[str]:
    return sorted({m for (w, m, _, _) in results if w == workload})


def _params(results, workload: str, model: str) -> list[int]:
    return sorted({p for (w, m, p, _) in results if w == workload and m == model})


def _round_seconds(bench: dict) -> list[float]:
    """Seconds per measured round: a peer's own round times (it timed them in its process, after its
    warm-up), else pytest-benchmark's."""
    if bench["extra_info"].get("timed_in") == "peer":
        return bench["extra_info"]["round_elapsed_s"]
    return bench["stats"]["data"]


def _latency(bench: dict, scale: float) -> Spread:
    return spread(_round_seconds(bench), scale)


def _ratio(ours: float | None, hf: float | None) -> str:
    if ours is None or hf is None or hf == 0:
        return "—"
    return f"{ours / hf:.2f}×"


def _pair(results, workload, model, param):
    return results.get((workload, model, param, "ours")), results.get((workload, model, param, "hf"))


def ttft_section(results) -> list[str]:
    lines = ["## Time to first token (1 request, max_tokens=1)", ""]
    for model in _models(results, "ttft"):
        lines += [
            f"**{model}** — ms, median (± IQR); ratio = ours / HF time (below 1: ours faster)",
            "",
            "| prompt tokens | ours | HF | ratio |",
            "|---:|---:|---:|---:|",
        ]
        for p in _params(results, "ttft", model):
            ours, hf = _pair(results, "ttft", model, p)
            o = _latency(ours, 1e3) if ours else None
            h = _latency(hf, 1e3) if hf else None
            lines.append(
                f"| {p} | {o.show() if o else '—'} | {h.show() if h else '—'} | "
                f"{_ratio(o and o.median, h and h.median)} |"
            )
        lines.append("")
    return lines


def prefix_cache_section(results) -> list[str]:
    """TTFT of a request whose prompt starts like one that ran just before: prefix-cache hit vs miss."""
    models = _models(results, "prefix-ttft")
    if not models:
        return []
    lines = [
        "## Time to first token with a prefix-cache hit (ours only)",
        "",
        "One request, max_tokens=1, whose prompt shares its first tokens with a request that ran just "
        "before; hit = prefix caching on (the shared full blocks come from the cache), miss = "
        "`enable_prefix_caching=False`. ms, median (± IQR). HF `generate` has no prefix cache, so "
        "there is no HF column.",
        "",
        "| model | prompt tokens | shared tokens | miss | hit | hit / miss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        for p in _params(results, "prefix-ttft", model):
            miss = results.get(("prefix-ttft", model, p, "ours-miss"))
            hit = results.get(("prefix-ttft", model, p, "ours-hit"))
            shared = (hit or miss)["extra_info"]["shared_prefix_len"]
            m = _latency(miss, 1e3) if miss else None
            h = _latency(hit, 1e3) if hit else None
            lines.append(
                f"| {model} | {p} | {shared} | {m.show() if m else '—'} | {h.show() if h else '—'} | "
                f"{_ratio(h and h.median, m and m.median)} |"
            )
    lines.append("")
    return lines


def _tpot(bench: dict) -> Spread:
    return spread(bench["extra_info"]["round_tpot_s"], 1e3)


def _decode_rate(bench: dict) -> float:
    """Aggregate decode tokens/s: every request gains one token per decode step."""
    return bench["extra_info"]["param"] / bench["extra_info"]["tpot_median_s"]


def _rate_cell(bench: dict | None) -> str:
    return f"{_decode_rate(bench):,.0f}" if bench else "—"


def _peer_missing(peers: dict, peer: str) -> str:
    """What a peer's cell says when it has no result: why it did not run."""
    status = peers.get(peer, {}).get("status", "")
    if status.startswith("not installed"):
        return "not installed"
    return "—"


def _peer_headers(peers: dict, *columns: str) -> tuple[str, str]:
    """Column headers per peer; "{peer}" in a column stands for its name."""
    names = [f" {c.format(peer=PEER_LABELS[p])} |" for p in peers for c in columns]
    return "".join(names), "---:|" * len(names)


def decode_section(results, plot_name: str | None, peers: dict | None = None) -> list[str]:
    peers = peers or {}
    lines = ["## Decode: time per output token by concurrency", ""]
    for model in _models(results, "decode"):
        head, rule = _peer_headers(peers, "{peer} TPOT", "{peer} decode tok/s")
        lines += [
            f"**{model}** — TPOT in ms, median (± IQR) over rounds; ratio = ours / HF; "
            "decode tok/s = concurrency / TPOT",
            "",
            f"| concurrency | ours TPOT | HF TPOT | ratio | ours decode tok/s | HF decode tok/s |{head}",
            f"|---:|---:|---:|---:|---:|---:|{rule}",
        ]
        for p in _params(results, "decode", model):
            ours, hf = _pair(results, "decode", model, p)
            o = _tpot(ours) if ours else None
            h = _tpot(hf) if hf else None
            cells = ""
            for peer in peers:
                bench = results.get(("decode", model, p, peer))
                missing = _peer_missing(peers, peer)
                tpot = _tpot(bench).show(2) if bench else missing
                cells += f" {tpot} | {_rate_cell(bench) if bench else missing} |"
            lines.append(
                f"| {p} | {o.show(2) if o else '—'} | {h.show(2) if h else '—'} | "
                f"{_ratio(o and o.median, h and h.median)} | "
                f"{_rate_cell(ours)} | {_rate_cell(hf)} |{cells}"
            )
        lines.append("")
    if plot_name:
        lines += [f"![TPOT vs concurrency]({plot_name})", ""]
    return lines


def _throughput(bench: dict) -> float:
    """Generated tokens / the median round's seconds."""
    return bench["extra_info"]["tokens_generated"] / statistics.median(_round_seconds(bench))


def throughput_section(results, plot_name: str | None, peers: dict | None = None) -> list[str]:
    peers = peers or {}
    lines = ["## Offline throughput (random prompt and output lengths)", ""]
    for model in _models(results, "throughput"):
        head, rule = _peer_headers(peers, "{peer} tok/s", "ours / {peer}")
        lines += [
            f"**{model}** — generated tokens/s (wanted tokens only) and wall time; "
            "ratio = ours / HF tokens/s (above 1: ours faster)",
            "",
            "| requests | prompt tokens | output tokens | ours tok/s | HF tok/s | ratio | ours s | HF s |"
            + head,
            f"|---:|---:|---:|---:|---:|---:|---:|---:|{rule}",
        ]
        for p in _params(results, "throughput", model):
            ours, hf = _pair(results, "throughput", model, p)
            any_bench = (
                ours
                or hf
                or next(b for (w, m, q, _), b in results.items() if (w, m, q) == ("throughput", model, p))
            )
            info = any_bench["extra_info"]
            o = _throughput(ours) if ours else None
            h = _throughput(hf) if hf else None
            cells = ""
            for peer in peers:
                bench = results.get(("throughput", model, p, peer))
                r = _throughput(bench) if bench else None
                missing = _peer_missing(peers, peer)
                cells += f" {f'{r:,.0f}' if r else missing} | {_ratio(o, r) if r else missing} |"
            lines.append(
                f"| {p} | {info.get('prompt_tokens', 0):,} | {info['tokens_generated']:,} | "
                f"{f'{o:,.0f}' if o else '—'} | {f'{h:,.0f}' if h else '—'} | {_ratio(o, h)} | "
                f"{_latency(ours, 1).show(1) if ours else '—'} | {_latency(hf, 1).show(1) if hf else '—'} |"
                + cells
            )
        lines.append("")
    if plot_name:
        lines += [f"![throughput vs requests]({plot_name})", ""]
    return lines


def _e2e_cell(bench: dict | None, missing: str) -> str:
    """End-to-end generated tok/s of a decode round, decode-only tok/s in brackets."""
    if bench is None:
        return missing
    return f"{_throughput(bench):,.0f} ({_decode_rate(bench):,.0f})"


def peers_section(runs: list[tuple[dict, dict]], labels: list[str] | None = None) -> list[str]:
    """The decode workload's rounds, ours beside the peers and HF, from one or more sessions (one
    per dtype): end-to-end tok/s = requests x output tokens / round seconds (prefill included).
    With `labels`, each row starts with its session's label."""
    peers = [p for p in PEER_LABELS if any(p in c.get("peers", {}) for c, _ in runs)]
    if not peers:
        return []
    head = "".join(f" {PEER_LABELS[p]} |" for p in peers)
    ratios = "".join(f" ours / {PEER_LABELS[p]} |" for p in peers)
    lines = [
        "## Beside the peers (decode workload, end to end)",
        "",
        "Generated tok/s, end to end (requests × output tokens / median round time, prefill "
        "included), decode-only in brackets (requests / TPOT); ratios on the end-to-end figures "
        "(above 1: ours faster). Each row's systems ran in one session.",
        "",
        f"|{' session |' if labels else ''} model, dtype, requests | ours |{head} HF |{ratios} ours / HF |",
        f"|{'---|' if labels else ''}---|---:|" + "---:|" * (2 * len(peers) + 2),
    ]
    for index, (context, results) in enumerate(runs):
        session = f" {labels[index]} |" if labels else ""
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(
            context.get("dtype", "float32"), context.get("dtype")
        )
        if context.get("quantization"):  # --bench-quantization: our weights (and llama.cpp's) quantized
            dtype = f"{dtype} {context['quantization']}"
        status = context.get("peers", {})
        for model in _models(results, "decode"):
            for p in _params(results, "decode", model):
                ours, hf = _pair(results, "decode", model, p)
                o = _throughput(ours) if ours else None
                cells = "".join(
                    f" {_e2e_cell(results.get(key), _peer_missing(status, peer))} |"
                    for peer in peers
                    for key in [("decode", model, p, peer)]
                )
                ratio_cells = ""
                for peer in peers:
                    bench = results.get(("decode", model, p, peer))
                    ratio_cells += f" {_ratio(o, _throughput(bench)) if bench else '—'} |"
                lines.append(
                    f"|{session} {model} {dtype}, {p} | {_e2e_cell(ours, '—')} |{cells} "
                    f"{_e2e_cell(hf, '—')} |{ratio_cells} {_ratio(o, _throughput(hf) if hf else None)} |"
                )
    lines.append("")
    return lines


def startup_section(results) -> list[str]:
    lines = [
        "## Start-up (fresh process to first token)",
        "",
        "cold: an empty compile cache (Inductor's included); warm: the cache a previous process "
        "filled (no trace, no compile). HF has no compile cache: its warm row is its cold path again.",
        "",
        "| model | start | ours s | HF s | ratio | ours import / build / first token (s) "
        "| HF import / build / first token (s) |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for model in _models(results, "startup"):
        for param, start in ((0, "cold"), (1, "warm")):
            ours, hf = _pair(results, "startup", model, param)
            if ours is None and hf is None:
                continue

            def phases(bench):
                if bench is None:
                    return "—"
                ps = bench["extra_info"]["phases"]
                return " / ".join(
                    f"{statistics.median(p[k] for p in ps):.1f}"
                    for k in ("import_s", "build_s", "first_token_s")
                )

            o = _latency(ours, 1) if ours else None
            h = _latency(hf, 1) if hf else None
            lines.append(
                f"| {model} | {start} | {o.show() if o else '—'} | {h.show() if h else '—'} | "
                f"{_ratio(o and o.median, h and h.median)} | {phases(ours)} | {phases(hf)} |"
            )
        cold, warm = (_pair(results, "startup", model, p)[0] for p in (0, 1))
        if cold and warm:
            c, w = _latency(cold, 1).median, _latency(warm, 1).median
            lines.append(f"| {model} | warm / cold (ours) | {w / c:.2f} | | | | |")
    lines.append("")
    return lines


def step_timeline_section(results) -> list[str]:
    """Sync vs async engine loop: per-step host, execute and wall times (medians over rounds)."""
    lines = []
    for model in _models(results, "step-timeline"):
        lines += [
            f"## Step timeline, sync vs async loop ({model})",
            "",
            "Per step, median over rounds: host = schedule + prepare + update; execute = the step's "
            "work on the execution stream; wait = host blocked on tokens; idle = 1 - execute / wall.",
            "",
            "| concurrency | loop | steps | host ms | execute ms | wait ms | wall ms | device idle | "
            "tok/s | discarded |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for param in _params(results, "step-timeline", model):
            for loop in ("sync", "async"):
                bench = results.get(("step-timeline", model, param, f"ours-{loop}"))
                if bench is None:
                    continue
                ts = bench["extra_info"]["timelines"]

                def med(key, ts=ts):
                    return statistics.median(t[key] for t in ts)

                host = statistics.median(t["schedule_s"] + t["prepare_s"] + t["update_s"] for t in ts)
                rate = statistics.median(bench["extra_info"]["round_tokens_per_s"])
                ms = {key: med(key) * 1e3 for key in ("execute_s", "wait_s", "step_wall_s")}
                lines.append(
                    f"| {param} | {loop} | {med('steps'):.0f} | {host * 1e3:.2f} | {ms['execute_s']:.2f} | "
                    f"{ms['wait_s']:.2f} | {ms['step_wall_s']:.2f} | {med('device_idle'):.0%} | "
                    f"{rate:,.0f} | {med('discarded_tokens'):.0f} |"
                )
        lines.append("")
    return lines


def floors_section(context: dict) -> list[str]:
    rates = context.get("rates", {})
    lines = [
        "## Hardware floors (measured in the same session)",
        "",
        f"Streaming read {rates.get('memory_read_gb_s', 0):.1f} GB/s (sum over a 512 MiB fp32 buffer), "
        f"fp32 GEMM {rates.get('gemm_fp32_gflop_s', 0):.0f} GFLOP/s (2048² matmul), "
        f"{rates.get('threads', '?')} torch threads; best of 5 runs each.",
        "",
        "| model | weights read / step | batch-1 floor ms/token (tok/s) | batch | context | "
        "memory floor ms/step | compute floor ms/step | batch ceiling tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, f in sorted(context.get("floors", {}).items()):
        lines.append(
            f"| {model} | {f['weight_bytes_read_per_step'] / 1e6:.1f} MB | "
            f"{f['batch1_decode_floor_ms_per_token']:.2f} ({f['batch1_decode_ceiling_tokens_per_s']:,.0f}) | "
            f"{f['batch']} | {f['context']} | {f['batch_memory_floor_ms_per_step']:.2f} | "
            f"{f['batch_compute_floor_ms_per_step']:.2f} | {f['batch_decode_ceiling_tokens_per_s']:,.0f} |"
        )
    lines += [
        "",
        "Batch-1 floor = (weights read per token + one sequence's KV) / bandwidth. Batch floor = the "
        "larger of (weights + every sequence's KV) / bandwidth and (2 FLOPs per matmul weight + "
        "attention FLOPs) × batch / GEMM rate, at the decode suite's largest concurrency and its mean "
        "context (prompt + half the output).",
        "",
    ]
    return lines


def header(context: dict) -> list[str]:
    m = context["machine"]
    s = context["sizes"]
    minutes = context.get("session_wall_s", 0) / 60
    profile_note = {
        "full": "full sizes (as specified in the issue)",
        "quick": "**reduced sizes** (`--bench-quick`): see the sizes below",
        "smoke": "**smoke sizes** (CI check, not meaningful numbers)",
    }.get(context["profile"], context["profile"])
    return [
        "# Benchmarks: compiled-engine vs Hugging Face transformers",
        "",
        "Generated by `python -m bench.report RESULTS.json` — do not edit by hand, except the reading "
        "between the markers, which is kept on regeneration.",
        "",
        "Command:",
        "",
        "```",
        context["command"],
        "```",
        "",
        f"Profile: {profile_note}. The whole session took {minutes:.1f} minutes.",
        "",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable CPUs ({m['logical_cpus']} logical), "
        f"{m['torch_threads']} torch threads; {m['platform']}",
        f"- Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
        f"- Models: {', '.join(s['models'])}; {context.get('dtype', 'float32')}, greedy, same weights "
        "on both sides",
        f"- TTFT prompts {s['ttft_prompt_lens']}, {s['ttft_rounds']} rounds + 1 warm-up",
        f"- Decode: concurrency {s['decode_concurrency']}, prompt {s['decode_prompt_len']} → "
        f"{s['decode_output_len']} tokens, {s['decode_rounds']} rounds + 1 warm-up",
        f"- Throughput: {s['throughput_requests']} requests, prompt lengths {s['throughput_prompt_range']}, "
        f"output lengths {s['throughput_output_range']} (uniform, seeded), "
        f"{s['throughput_rounds']} round(s), no warm-up round; HF in static batches of {s['hf_batch_size']}",
        f"- Start-up: {s['startup_rounds']} fresh process(es) per system, cold and warm",
        "",
    ]


METHOD = """## Method

- Both systems run in the same pytest session, one after the other, on the same cores, with the same
  weights, greedy, the same dtype (fp32 unless `--bench-dtype bfloat16`), and always the requested
  number of tokens (ours: `ignore_eos=True`; HF: `min_new_tokens = max_new_tokens`). Each pair
  shares one pytest-benchmark group.
- Ours: `LLM.generate` (TTFT, throughput) or `engine.add_request` + `engine.step()` by hand (decode).
  HF: `model.generate` on left-padded batches with an attention mask, eager, default attention.
- TTFT: one request, `max_tokens=1`: prefill plus the first sample.
- Decode TPOT: all N requests enter together and prefill in one step; TPOT = time from the moment the
  last request got its first token to the end / the decode steps in that window (ours: counted
  `engine.step()` calls; HF: a logits processor notes the time of every generated token).
- Throughput: ours gets every request at once (continuous batching). HF `generate` cannot batch
  continuously, so requests run in submission order in static batches, each batch generating its
  longest request's length; only each request's own output length counts as generated tokens (the
  padding work of static batching is HF's real cost in this setting).
- Cold start: a fresh `python -c` process per round, timed from launch to the first token, so it
  includes importing torch; the OS file cache is warm.
- Peers (`--peer`, bench/peers/): the same requests, in the same session, each peer timing its own
  rounds in its own process (decode: after one warm-up round, as ours). vLLM (CPU build, its own
  venv, tcmalloc + Intel OpenMP preloaded, its default thread binding, prefix caching off, the
  engine limits ours gets): `generate` for throughput, `add_request` + `step()` by hand for decode,
  as ours. llama.cpp: the model converted to GGUF in the same dtype, `llama-batched-bench -npp P
  -ntg (O-1) -npl N` with as many threads as ours; it feeds random ids and does not sample, so it
  times the forward passes (the prefill, whose logits give the first token, and O-1 decode steps).
  Its throughput column comes from llama-bench-mixed (bench/peers/llamacpp_mixed.cpp), a
  continuous-batching driver of libllama given ours' limits (sequences, token budget per step),
  greedy; no warm-up round, as ours.
"""


def _plot(results, path: Path, workload: str, ylabel: str, value, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model in _models(results, workload):
        for system, style in (("ours", "-o"), ("hf", "--s"), ("vllm", ":^"), ("llamacpp", "-.d")):
            points = [
                (p, value(results[(workload, model, p, system)]))
                for p in _params(results, workload, model)
                if (workload, model, p, system) in results
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label=f"{SYSTEM_LABELS[system]} · {model}")
    ax.set_xscale("log", base=2)
    ticks = sorted({p for (w, _, p, _) in results if w == workload})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel({"decode": "concurrent requests", "throughput": "requests"}[workload])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kept_reading(existing: Path) -> str:
    if existing.exists():
        text = existing.read_text()
        if READING_START in text and READING_END in text:
            return text.split(READING_START, 1)[1].split(READING_END, 1)[0].strip()
    return "(No reading written yet for this run.)"


def write_report(results_path: Path, out_dir: Path, plots: bool = True) -> Path:
    context, results = load(results_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    decode_png = throughput_png = None
    if plots and any(k[0] == "decode" for k in results):
        decode_png = "bench-decode-tpot.png"
        _plot(
            results,
            out_dir / decode_png,
            "decode",
            "TPOT (ms, median)",
            lambda b: _tpot(b).median,
            "Decode time per output token",
        )
    if plots and any(k[0] == "throughput" for k in results):
        throughput_png = "bench-throughput.png"
        _plot(
            results,
            out_dir / throughput_png,
            "throughput",
            "generated tokens/s",
            _throughput,
            "Offline throughput",
        )
    target = out_dir / "benchmarks.md"
    reading = _kept_reading(target)
    lines = header(context)
    lines += ["## Reading", "", READING_START, reading, READING_END, ""]
    lines += ttft_section(results)
    lines += prefix_cache_section(results)
    peers = context.get("peers", {})
    lines += decode_section(results, decode_png, peers)
    lines += peers_section([(context, results)])
    lines += throughput_section(results, throughput_png, peers)
    lines += startup_section(results)
    lines += step_timeline_section(results)
    lines += floors_section(context)
    lines += METHOD.splitlines()
    target.write_text("\n".join(lines).rstrip() + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", type=Path, nargs="+", help="pytest-benchmark JSON from `pytest bench/ --benchmark-json`"
    )
    parser.add_argument(
        "--peers-table",
        action="store_true",
        help="print only the beside-the-peers table, from every JSON given (e.g. one per dtype)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where benchmarks.md goes")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    args = parser.parse_args(argv)
    try:
        if args.peers_table:
            labels = [path.stem for path in args.results] if len(args.results) > 1 else None
            print("\n".join(peers_section([load(path) for path in args.results], labels)))
            return 0
        if len(args.results) != 1:
            raise ValueError("one RESULTS.json makes the report (several only with --peers-table)")
        target = write_report(args.results[0], args.out_dir, plots=not args.no_plots)
    except (OSError, ValueError) as exc:
        print(f"bench.report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
