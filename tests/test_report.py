"""`rlsched plot` and `rlsched report` on a real tiny run made through the CLI: the files they
write, the series the figures hold (checked against the run's traces), the page's numbers and
embedded images, and bad input (one line naming the file, exit 2)."""

import base64
import json
import shutil
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")

from support import ok, rlsched  # noqa: E402
from test_rl_run import TINY  # noqa: E402

from rlsched.analysis.folder import expected_tokens, figures_for, load_folder  # noqa: E402
from rlsched.analysis.plots import batch_k_figure  # noqa: E402
from rlsched.errors import UserError  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

FIGURES = ["fit", "speedup", "acceptance", "batch_k", "stages", "learning_curve"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory, pair):
    """A 2-step GRPO run with the goodput policy (so it profiles its step costs first)."""
    root = tmp_path_factory.mktemp("report")
    (root / "run.yaml").write_text(TINY.format(steps=2))
    ok(
        rlsched(
            "run",
            "--config",
            str(root / "run.yaml"),
            "--policy",
            "goodput",
            "--out",
            str(root / "run"),
            "--json",
            cwd=root,
            timeout=1800,
        )
    )
    return root / "run"


def _line(fig, label, axes=None):
    axes = fig.axes if axes is None else axes
    found = [ln for ax in axes for ln in ax.get_lines() if ln.get_label() == label]
    assert len(found) == 1, (label, [ln.get_label() for ax in axes for ln in ax.get_lines()])
    return found[0]


def test_plot_writes_every_figure_and_they_hold_the_runs_series(run, tmp_path):
    info = json.loads(ok(rlsched("plot", str(run), "--json", cwd=tmp_path)).stdout)
    out = run / "plots"  # the default
    assert info["kind"] == "run" and info["out"] == str(out) and info["figures"] == FIGURES
    assert info["files"] == [str(out / f"{n}.{ext}") for n in FIGURES for ext in ("png", "pdf")]
    for n in FIGURES:
        assert (out / f"{n}.png").read_bytes()[:8] == PNG and (out / f"{n}.png").stat().st_size > 5000
        assert (out / f"{n}.pdf").read_bytes()[:5] == b"%PDF-"

    d = load_folder(run)
    figs, skipped = figures_for(d, acceptance=0.8)
    assert list(figs) == FIGURES and not skipped
    rl = read_trace(run / "traces", "rl_steps").sort_values("rl_step")
    steps = read_trace(run / "traces", "steps")
    # acceptance over RL steps: the rl_steps records themselves
    acc = figs["acceptance"]
    assert list(_line(acc, "acceptance rate").get_ydata()) == pytest.approx(rl.accept_rate.tolist(), nan_ok=True)
    assert list(_line(acc, "tokens per SD step").get_ydata()) == pytest.approx(rl.mean_accept_len.tolist())
    assert list(_line(acc, "acceptance rate").get_xdata()) == rl.rl_step.tolist()
    # stage split: one bar series per stage, its heights the stage's seconds per RL step
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in figs["stages"].axes[0].containers}
    for stage in ("generation", "inference", "training", "drafter_update"):
        assert bars[stage] == pytest.approx(rl[f"{stage}_s"].tolist())
    # batch size and k: the first RL step's decode steps of instance 0, in order
    dec = steps[(steps.kind == "decode") & (steps.rl_step == 0) & (steps.instance == 0)].sort_values("time_s")
    assert list(_line(figs["batch_k"], "batch size").get_ydata()) == dec.batch.tolist()
    assert list(_line(figs["batch_k"], "k (0 = off)").get_ydata()) == dec.k.tolist()
    # speedup: expected tokens x plain verify time / (verify + draft time) from the run's profile
    prof = pd.read_parquet(run / "profile.parquet")
    v = prof[prof.kind == "verify"].set_index(["batch", "k"]).verify_ms
    dr = prof[prof.kind == "draft"].set_index(["batch", "k"]).draft_ms
    k2 = _line(figs["speedup"], "k=2", figs["speedup"].axes[:1])  # the predicted panel (left)
    batches = sorted(prof.batch.unique())
    assert list(k2.get_xdata()) == batches
    want = [expected_tokens(0.8, 2) * v[(b, 0)] / (v[(b, 2)] + dr[(b, 2)]) for b in batches]
    assert list(k2.get_ydata()) == pytest.approx(want)
    # the fit figure: every profiled verify point drawn in the verify column
    verify_top = figs["fit"].axes[0]
    assert "verify" in verify_top.get_title()
    assert sum(len(c.get_offsets()) for c in verify_top.collections) == int((prof.kind == "verify").sum())


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.text = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def test_report_is_one_page_with_the_numbers_and_the_figures(run, tmp_path):
    before = set(p.name for p in run.iterdir())
    info = json.loads(ok(rlsched("report", str(run), "--json", cwd=tmp_path)).stdout)
    page_path = run / "report.html"  # the default, and nothing else written there
    assert info["out"] == str(page_path) and info["figures"] == FIGURES
    assert set(p.name for p in run.iterdir()) - before <= {"report.html"}
    page = _Page()
    page.feed(page_path.read_text())
    assert len(page.images) == len(FIGURES)
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG
    text = " ".join(page.text)
    summary = json.loads((run / "summary.json").read_text())
    rl = read_trace(run / "traces", "rl_steps")
    assert f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}" in text
    assert f"{summary['tokens_per_s']:,.0f}" in text
    assert f"{summary['accept_len_start']:.2f} -> {summary['accept_len_end']:.2f}" in text
    # the policy prices steps with the profile it takes at start: on a busy machine it may draft nothing
    rate = f"{rl.accepted.sum() / rl.drafted.sum():.3f}" if rl.drafted.sum() else "n/a"
    assert "acceptance rate (accepted / drafted): first -> last (all)" in text and f"({rate})" in text
    assert "grpo / goodput / model" in text
    assert (
        f"{summary['seconds']:.1f} ("
        + " / ".join(f"{summary['stage_s'][k]:.1f}" for k in ("generation", "inference", "training", "drafter_update"))
        in text
    )
    assert info["numbers"]["tokens_per_s"] == pytest.approx(summary["tokens_per_s"])


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_input_is_one_line_and_exit_2(run, tmp_path):
    _one_line_error(rlsched("plot", str(tmp_path / "nope"), cwd=tmp_path), "nope' does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "summary.json").write_text("{}")
    _one_line_error(rlsched("report", str(empty), cwd=tmp_path), "nothing to plot", "no traces")
    assert not (empty / "report.html").exists()
    _one_line_error(rlsched("report", str(run), "--out", str(tmp_path / "x.txt"), cwd=tmp_path), ".html")
    with pytest.raises(UserError, match=r"--rl-step 7: the step records hold RL steps 0\.\.1"):
        batch_k_figure(read_trace(run / "traces", "steps"), rl_step=7)

    bad = tmp_path / "bad"
    shutil.copytree(run, bad, ignore=shutil.ignore_patterns("checkpoint.pt", "plots", "report.html"))
    part = sorted((bad / "traces" / "steps").glob("part-*.parquet"))[0]
    part.write_bytes(np.random.default_rng(0).bytes(300))
    for cmd in ("plot", "report"):
        _one_line_error(rlsched(cmd, str(bad), cwd=tmp_path), str(part), "corrupt or truncated")
    assert not (bad / "plots").exists() and not (bad / "report.html").exists()


def test_a_run_priced_as_an_earlier_run_takes_its_profile_and_takes_none_itself(run, tmp_path):
    """`cost_model=<run folder>`: the earlier run's start-up profile prices the steps (a rerun
    then decides alike); a plain goodput run would profile again and save profile.parquet."""
    (tmp_path / "run.yaml").write_text(TINY.format(steps=1))
    again = tmp_path / "again"
    summary = json.loads(
        ok(
            rlsched(
                "run",
                "--config",
                str(tmp_path / "run.yaml"),
                "--policy",
                "goodput",
                "--set",
                f"cost_model={run}",
                "--out",
                str(again),
                "--json",
                cwd=tmp_path,
                timeout=1800,
            )
        ).stdout
    )
    assert summary["steps"] == 1 and summary["policy"] == "goodput"
    assert not (again / "profile.parquet").exists() and (run / "profile.parquet").is_file()
