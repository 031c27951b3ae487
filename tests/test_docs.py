"""The documentation describes the tool as it is, and its figures are the recorded ones.

- README.md stays short.
- Every figure of the README's results table equals the figure in the bench/results file the
  row names, and docs/benchmarks.md names that file too.
- README, docs/, the bench scripts and the Makefile hold no development-history narration
  (numbered work sessions, issue numbers, commit hashes, remarks on which machine was lent).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n < 250, f"README.md has {n} lines; move details into docs/"


# --- the results table ------------------------------------------------------------------------


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _policy_agg(report: str, policy: str, field: str) -> float:
    rows = _load("policies.json")["reports"][report]["aggregate"]
    (row,) = [r for r in rows if r["policy"] == policy and r["realloc"] == "none"]
    return row[field]["mean"]


def _row(rows: list, key: str, value) -> dict:
    (row,) = [r for r in rows if r[key] == value]
    return row


def _sim_speed(scenario: str, policy: str) -> float:
    rows = _load("sim_speed.json")["results"]
    (row,) = [r for r in rows if r["scenario"] == scenario and r["policy"] == policy]
    return row["wall_s"]


def _rl(run: str, column: str) -> float:
    return float(_row(_load("rl_e2e.json")["rows"], "run", run)[column].split()[0])


def _fidelity_mape() -> float:
    rows = _load("fidelity.json")["rows"]
    mapes = [m for r in rows for m in (r["mape_sd"], r["mape_off"])]
    return sum(mapes) / len(mapes)


TREE_16 = "7 steps, topk 4, 16 tokens"  # paper_tables' fixed tree of 16 tokens

# README row (its first cell, as written) -> (results file, the figure as the file holds it;
# a percentage as a fraction or in percent as noted by `scale`)
CHECKS = {
    "Simulated, H100, Qwen2.5-7B + EAGLE-3: a fixed 16-token tree over plain decoding at batch 1": (
        "paper_tables.json",
        lambda: _load("paper_tables.json")["gap1"][TREE_16]["speedup"]["1"],
        1,
    ),
    "Simulated, same: the fixed 16-token tree over plain decoding at batch 64": (
        "paper_tables.json",
        lambda: _load("paper_tables.json")["gap1"][TREE_16]["speedup"]["64"],
        1,
    ),
    "Simulated, ReSpec-shaped GRPO on 16 H100s, Qwen2.5-7B: `goodput` RL step over no SD (ReSpec: 1.69x)": (
        "paper_tables.json",
        lambda: _load("paper_tables.json")["end_to_end"]["7b"]["goodput"]["e2e"],
        1,
    ),
    "Cost model against Vidur's measured H100 kernel times, held-out models, decode at 32-512 tokens: MAPE": (
        "gpu_costs.json",
        lambda: _load("gpu_costs.json")["gpus"]["h100"]["mape"]["per-op"]["decode large"],
        1,
    ),
    "Simulated, long-tail GRPO, Qwen2.5-7B + 0.5B drafter: `goodput` over the best static k": (
        "sim_effects.json",
        lambda: (
            sum(d["goodput_vs_best_static"] for d in _load("sim_effects.json")["long_tail"].values())
            / len(_load("sim_effects.json")["long_tail"])
        ),
        1,
    ),
    "Simulated, EAGLE on H200, Qwen2.5-14B: `goodput` over plain decoding": (
        "policies.json",
        lambda: _policy_agg("eagle-h200-14b", "goodput", "speedup_vs_off"),
        1,
    ),
    "Simulated, ReSpec-shaped GRPO, Qwen2.5-7B + EAGLE-3 with trees: `goodput` over the best static setting": (
        "policies.json",
        lambda: _policy_agg("respec-qwen2.5-7b", "goodput", "ratio_vs_best_static"),
        1,
    ),
    "Simulator speed: 64 instances, 8,192 samples, `goodput`, one core": (
        "sim_speed.json",
        lambda: _sim_speed("cluster-64x8192-16k", "goodput"),
        1,
    ),
    "`rlsched plan`, ReSpec-shaped GRPO on 16 H100s: 561 setups searched on 2 cores (its winner: the best of "
    "simulating all 468 feasible)": ("plan_speed.json", lambda: _load("plan_speed.json")["summary"]["plan_s"], 1),
    "Measured: plain decoding over `transformers` generate at 64 rows": (
        "engine_plain_memory_sd_b1.json",
        lambda: _row(_load("engine_plain_memory_sd_b1.json")["plain"]["rows"], "batch", 64)["ratio_vs_hf_median"],
        1,
    ),
    "Measured: SD (static:6) over plain decoding at batch 1": (
        "engine_plain_memory_sd_b1.json",
        lambda: _row(_load("engine_plain_memory_sd_b1.json")["sd_b1"]["rows"], "policy", "static:6")["speedup_median"],
        1,
    ),
    "Measured: drain 64 -> 1 rows, `goodput` over the best static k (held out)": (
        "engine_drain.json",
        lambda: _row(_load("engine_drain.json")["drain"]["rows"], "policy", "goodput")["vs_best_static_held_out"],
        1,
    ),
    "Measured: GRPO run, adaptive SD over SD off, generation stage": (
        "rl_e2e.json",
        lambda: _rl("goodput+builtin", "speedup gen"),
        1,
    ),
    "Measured: GRPO run, adaptive SD over SD off, end to end": (
        "rl_e2e.json",
        lambda: _rl("goodput+builtin", "speedup total"),
        1,
    ),
    "Measured: GRPO on vLLM, reward over the last 20% of 40 steps, from 0.235 (rlsched's engine: 0.497)": (
        "vllm_rl.json",
        lambda: _load("vllm_rl.json")["backends"]["vllm"]["reward_end"],
        1,
    ),
    "Measured: two Ray instances, `rebalance` cut of the generation stage": (
        "realloc.json",
        lambda: _load("realloc.json")["cuts"]["local"]["cut_paired_mean"],
        100,
    ),
    "Measured: two vLLM instances on Ray, `rebalance` cut of the generation stage": (
        "realloc.json",
        lambda: _load("realloc.json")["cuts"]["vllm"]["cut_paired_mean"],
        100,
    ),
    "Measured: real runs replayed in the simulator, per-step MAPE": ("fidelity.json", _fidelity_mape, 1),
}


def _results_table() -> list[tuple[str, str, str]]:
    """(result, figure, file) of every row of the README's table headed `| result | figure | file |`."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*result\s*\|\s*figure\s*\|\s*file\s*\|", line))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1], cells[2].strip("`")))
    return rows


def test_results_table_has_checked_rows():
    rows = _results_table()
    assert len(rows) >= 4
    unchecked = [r[0] for r in rows if r[0] not in CHECKS]
    assert not unchecked, f"README results rows without a check in tests/test_docs.py: {unchecked}"


@pytest.mark.parametrize("result,figure,file", _results_table())
def test_results_figure_matches_its_file(result, figure, file):
    expected_file, value, scale = CHECKS[result]
    assert file == expected_file, f"{result!r}: the README names {file}, the check reads {expected_file}"
    assert (RESULTS / file).exists(), f"bench/results/{file} is missing"
    assert f"`{file}`" in BENCHMARKS.read_text(), f"docs/benchmarks.md does not name {file}"
    m = re.match(r"([0-9][0-9,]*(?:\.([0-9]+))?)", figure)
    assert m, f"{result!r}: no number in {figure!r}"
    shown = float(m.group(1).replace(",", ""))
    decimals = len(m.group(2) or "")
    actual = value() * scale
    assert round(actual, decimals) == pytest.approx(shown), (
        f"{result!r}: README says {figure}, bench/results/{file} holds {actual:.{decimals + 2}f}"
    )


# --- no development history --------------------------------------------------------------------

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
HISTORY = {
    "a work session": re.compile(r"\bsessions?\b", re.I),
    "a numbered work period": re.compile(
        rf"\b(?:(?:twenty|thirty|forty)-(?:{ORDINALS})|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
        rf"sixteenth|seventeenth|eighteenth|nineteenth|twentieth)\b"
        rf"|\b(?:work|development) periods?\b|\bperiod \d+\b",
        re.I,
    ),
    "an issue number": re.compile(r"\b(?:issues?|PR|pull request|bug)\s*#?\d+|\(#\d+\)", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a remark on the machine lent": re.compile(
        r"\blent\b|\bno GPU (?:was|is|has been)\b|\bnever (?:been )?run on a GPU\b"
        r"|\bnot (?:yet )?(?:been )?run on a GPU\b|\b(?:the|this|a) (?:faster|slower|fresh|new|same) VM\b",
        re.I,
    ),
}
# measured figures belong in docs/benchmarks.md and bench/results/, not in the package's text
FIGURES = {
    "a measured time": re.compile(r"\b\d+(?:\.\d+)?(?:\s*(?:-|to|vs\.?|against)\s*\d+(?:\.\d+)?)?\s*(?:us|µs|ms)\b"),
    "a measured ratio": re.compile(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)?-\d+(?:\.\d+)?x\b"),
    "a measured difference": re.compile(
        r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?%\s+(?:faster|slower|dearer|cheaper|lower|higher|low|high|under|over"
        r"|better|worse|less|more)\b",
        re.I,
    ),
    "a measurement": re.compile(r"\bwe (?:measured|timed|saw|found)\b|\bmeasured (?:at |as )?~?\d", re.I),
}
URL = re.compile(r"https?://\S+")


def _history_hits(paths: list[Path], patterns: dict = HISTORY) -> list[str]:
    hits = []
    for path in paths:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            text = URL.sub("", line)
            for what, pattern in patterns.items():
                m = pattern.search(text)
                if m:
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return hits


def _doc_paths() -> list[Path]:
    bench = [
        p
        for p in (ROOT / "bench").rglob("*")
        if p.is_file() and "results" not in p.relative_to(ROOT).parts and p.suffix in (".py", ".sh", ".md", "")
    ]
    return [README, ROOT / "Makefile", *sorted((ROOT / "docs").rglob("*.md")), *sorted(bench)]


def test_history_patterns_catch_narration():
    samples = [
        "in the twenty-first session",
        "the fifteenth's run",
        "issue 4's drain point",
        "see issue #12",
        "(#12)",
        "recorded at 2458f2a",
        "no GPU was lent so far",
        "never run on a GPU yet",
        "on the faster VM",
    ]
    for s in samples:
        assert any(p.search(s) for p in HISTORY.values()), s
    clean = [
        "see https://github.com/vllm-project/vllm/issues/55005",
        "batch 1024 at 0.9",
        "a silent failure",
        "static:4 by the median of rounds",
        "Qwen2.5-7B + 0.5B",
        "sd_b1 and drain_wide",
        "color: #222;",
    ]
    for s in clean:
        assert not any(p.search(URL.sub("", s)) for p in HISTORY.values()), s


def test_figure_patterns_catch_measurements():
    samples = [
        "we measured 1.8x here",
        "which ran 2-5% faster a token",
        "took 340 us on this machine",
        "5.4 ms of ~550 a round",
        "12 vs 40 us",
        "1.3-1.4x what it cost",
        "17-26% low",
        "measured 0.93",
    ]
    for s in samples:
        assert any(p.search(s) for p in FIGURES.values()), s
    clean = [
        "within 5%: the same band",
        "a random 25% of the records",
        "queues 3x the batch",
        'f"{speedup:.3f}x "',
        'f"{t:.1f} ms"',
        "the first 20% of the RL steps",
        "measured step times",
        "max-width: 100%;",
        "an overhead of `ms` a step",
    ]
    for s in clean:
        assert not any(p.search(s) for p in FIGURES.values()), s


def test_docs_and_bench_scripts_hold_no_history():
    hits = _history_hits(_doc_paths())
    assert not hits, "development history in the docs or bench scripts:\n" + "\n".join(hits)


def test_package_holds_no_history():
    paths = sorted(p for p in (ROOT / "rlsched").rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".md"))
    hits = _history_hits(paths, {**HISTORY, **FIGURES})
    assert not hits, "development history or measured figures in rlsched/:\n" + "\n".join(hits)
