"""The cost-model fit figure: measured step times against the fitted form per batch size and
draft length (one column per operation), with the residuals below. Headless (see plots.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlsched.analysis.plots import save_figure

MARKERS = "os^Dv<>"
TOKEN_LABEL = {"verify": "q", "draft": "k", "prefill": "", "feed": ""}


def _levels(values: np.ndarray, most: int) -> np.ndarray:
    """The distinct values, or `most` quantiles of them when there are more."""
    u = np.unique(values)
    return u if len(u) <= most else np.unique(np.quantile(values, np.linspace(0, 1, most)).round())


def _nearest(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return np.abs(values[:, None] - levels[None, :]).argmin(axis=1)


def fit_figure(result):
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fits = list(result.ops.values())
    fig = Figure(figsize=(4.6 * len(fits), 6.4), layout="constrained")
    axes = fig.subplots(2, len(fits), squeeze=False, gridspec_kw={"height_ratios": [2.2, 1]}, sharex="col")
    for j, f in enumerate(fits):
        top, bottom = axes[0, j], axes[1, j]
        d = f.data
        B, tok, L, y = (d[c].to_numpy(float) for c in ("batch", "tokens", "per_row", "ms"))
        toks, ctxs = _levels(tok, 8), _levels(L, 4)
        ti, ci = _nearest(tok, toks), _nearest(L, ctxs)
        colors = [f"C{i % 10}" for i in range(len(toks))] if len(toks) > 1 else None
        pred = f.predict_ms(B, tok, L)
        xs = np.geomspace(B.min(), max(B.max(), B.min() * 1.01), 60)
        for c, ctx in enumerate(ctxs):
            for t, tv in enumerate(toks):
                color = colors[t] if colors else f"C{c % 10}"
                m = (ti == t) & (ci == c)
                if m.any():
                    top.scatter(B[m], y[m], s=14, color=color, marker=MARKERS[c % len(MARKERS)], zorder=3)
                    bottom.scatter(B[m], 100 * (pred[m] - y[m]) / y[m], s=12, color=color,
                                   marker=MARKERS[c % len(MARKERS)])
                top.plot(xs, f.predict_ms(xs, np.full_like(xs, tv), np.full_like(xs, ctx)), color=color, lw=1,
                         ls=("-", "--", ":", "-.")[c % 4])
        q = f.quality
        held = "n/a" if q["mape_heldout"] is None else f"{q['mape_heldout']:.1%}"
        top.set(xscale="log", yscale="log", ylabel="ms", title=f"{f.key} ({f.used})\nR² {q['r2']:.3f}, "
                f"MAPE {q['mape']:.1%}, held-out {held}")
        top.set_xscale("log", base=2)
        top.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        for axis in (top.xaxis, top.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        top.yaxis.set_minor_formatter(NullFormatter())
        handles = []
        if colors:
            handles += [Line2D([], [], color=colors[t], marker="o", ls="-", ms=4,
                               label=f"{TOKEN_LABEL[f.op]}={tv:g}") for t, tv in enumerate(toks)]
        handles += [Line2D([], [], color="0.3" if colors else f"C{c % 10}", marker=MARKERS[c % len(MARKERS)],
                           ls=("-", "--", ":", "-.")[c % 4], ms=4, label=f"context {ctx:g}")
                    for c, ctx in enumerate(ctxs)]
        top.legend(handles=handles, fontsize="x-small", ncol=2, loc="upper left")
        bottom.axhline(0, color="0.5", lw=0.8)
        bottom.set(xlabel="batch size (rows)", ylabel="fit - measured (%)")
    fig.suptitle(f"cost-model fit: points measured, lines fitted ({result.source.get('path', '')})", fontsize="small")
    return fig


def plot_fit(result, path: Path) -> None:
    save_figure(fit_figure(result), path)
