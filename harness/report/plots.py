"""The report's plots: matplotlib figures (no pyplot state, SVG backend) turned into compact inline
SVG -- the error-vs-step plot of a case and the heatmap of element-wise error over the ZeRO layout."""
from __future__ import annotations

import io
import itertools
import math
import re
from dataclasses import dataclass

import numpy as np

from harness.report.results import MAX_CELLS, CheckRow, map_cells, maxpool
import xml.etree.ElementTree as ET

HUGE = 1e300  # results store non-finite ratios as +-1e308

_fig_counter = itertools.count()


def _pos(x: float) -> float:
    x = abs(float(x))
    if not math.isfinite(x) or x >= HUGE:
        return float("nan")
    return x if x > 0 else float("nan")


def _finite(x: float) -> float:
    return float("inf") if (not math.isfinite(x) or abs(x) >= HUGE) else float(x)

_SVG_NS = "http://www.w3.org/2000/svg"
_XLINK = "http://www.w3.org/1999/xlink"
_OWN_GIDS = ("boundary-", "heat-axes", "quantity-", "padded-tail", "padding")


def _svg_of(fig) -> str:
    """The figure as inline SVG: no XML prologue, matplotlib's per-artist ``<g id=..>`` wrappers
    dropped (a third of the bytes), coordinates to 0.01 px, and the ids left (references and our
    own gids) made unique within the page, since many figures share one HTML document."""

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    ET.register_namespace("", _SVG_NS)
    ET.register_namespace("xlink", _XLINK)
    root = ET.fromstring(text)
    referenced = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    prefix = f"f{next(_fig_counter)}-"
    g_tag, meta_tag = f"{{{_SVG_NS}}}g", f"{{{_SVG_NS}}}metadata"
    href = f"{{{_XLINK}}}href"

    def clean(el):
        out = []
        for child in list(el):
            if child.tag == meta_tag:
                el.remove(child)
                continue
            clean(child)
            gid = child.get("id")
            if gid is not None and gid not in referenced and not gid.startswith(_OWN_GIDS):
                del child.attrib["id"]
            if child.tag == g_tag and not child.attrib:
                out.append((child, list(child)))
        for child, grandchildren in out:  # splice attribute-less groups into their parent
            i = list(el).index(child)
            el.remove(child)
            for j, gc in enumerate(grandchildren):
                el.insert(i + j, gc)

    clean(root)
    for el in root.iter():
        if el.get("id"):
            el.set("id", prefix + el.get("id"))
        for attr in (href, "href"):
            v = el.get(attr)
            if v and v.startswith("#"):
                el.set(attr, "#" + prefix + v[1:])
        for attr in ("clip-path", "mask", "fill", "style"):
            v = el.get(attr)
            if v and "url(#" in v:
                el.set(attr, v.replace("url(#", "url(#" + prefix))
        d = el.get("d")
        if d:
            el.set("d", re.sub(r"\s+", " ", d).strip())
        if el.text:
            el.text = el.text.strip() if el.tag != f"{{{_SVG_NS}}}text" else el.text
        el.tail = None
    use_tag = f"{{{_SVG_NS}}}use"
    for el in root.iter(use_tag):
        el.attrib.pop("style", None)  # repeats the style of the path it points at
    for el in root.iter(f"{{{_SVG_NS}}}text"):
        st = el.get("style")
        if st:  # the page's CSS gives the font family (see _CSS); keep size, anchor, colour
            el.set("style", re.sub(r"font-family:[^;]*;?\s*", "", st).strip("; "))
        tr = el.get("transform")
        if tr and re.fullmatch(r"rotate\(-?0 [^)]*\)", tr):
            del el.attrib["transform"]
    svg = ET.tostring(root, encoding="unicode")
    svg = re.sub(r"(\d\.\d\d)\d+", r"\1", svg)  # coordinates to 0.01 px (base64 PNG data has no '.')
    svg = re.sub(r"(\d\.\d)0(?=[\s\"])", r"\1", svg)
    return svg


def _rc():
    import matplotlib  # late: only when a plot is drawn

    return matplotlib.rc_context({
        "svg.fonttype": "none", "svg.hashsalt": "divergence-report", "svg.image_inline": True,
        "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
        "legend.fontsize": 7, "font.family": "sans-serif", "axes.linewidth": 0.6, "lines.linewidth": 1.1,
        "figure.dpi": 100, "savefig.dpi": 100, "savefig.transparent": True, "font.sans-serif": ["DejaVu Sans"]})


R0, R1, S0, S1, P0, P1 = 0.0, 0.7, 0.85, 1.85, 2.1, 4.5  # heatmap bands: ranks, strip, profile
TOP = P1 + 0.25
RANK_COLOURS = ("#d6eaf8", "#fdebd0", "#d5f5e3", "#ebdef0", "#fcf3cf", "#d6dbdf", "#fadbd8", "#d1f2eb")


@dataclass
class _Heat:
    """A heatmap's geometry and colour scale: the pooled ratios, their log (clipped to whole decades
    ``vmin..vmax``), the element count, ZeRO-3's padding after it, the rank slices and padded tails."""

    pooled: np.ndarray
    logr: np.ndarray
    n_inf: int
    vmin: int
    vmax: int
    n: int
    pad: int
    ranks: list
    tails: list

    @property
    def xmax(self) -> int:
        return max(self.n + self.pad, 1)

    def y_of(self, lr):
        return P0 + (np.asarray(lr) - self.vmin) / (self.vmax - self.vmin) * (P1 - P0)

    def decades(self) -> list[int]:
        return list(range(self.vmin, self.vmax + 1, max(1, math.ceil((self.vmax - self.vmin) / 4))))


def _heat(ratio, layout: dict | None, stage: int, world_size: int | None, max_cells: int) -> _Heat:
    flat, n, _ = map_cells(ratio)
    layout = layout or {}
    ranks = [tuple(int(v) for v in x) for x in layout.get("ranks", [])]
    tails = [tuple(int(v) for v in x) for x in layout.get("regions", {}).get("padded_tail", [])]
    W = world_size or (max((rk for rk, _, _ in ranks), default=0) + 1)
    pad = 0
    if stage == 3 and W > 1 and n > 0:
        pad = -(-n // W) * W - n
    pooled = maxpool(flat, max_cells)
    ok = np.isfinite(pooled) & (pooled < HUGE)
    finite = pooled[ok]
    hi = float(finite.max()) if finite.size else 1.0
    pos = finite[finite > 0]
    lo = float(pos.min()) if pos.size else 1e-3
    vmax = max(1, math.ceil(math.log10(max(hi, 10.0))))
    vmin = min(-1, math.floor(math.log10(max(lo, 1e-6))))
    logr = np.log10(np.clip(np.where(ok, pooled, 10.0 ** vmax), 10.0 ** vmin, 10.0 ** vmax))
    return _Heat(pooled, logr, int((~ok).sum()), vmin, vmax, n, pad, ranks, tails)


def _draw_strip_and_profile(ax, h: _Heat, norm) -> None:
    """The colour strip and, above it, the same ratios as a log profile against the allowance (ratio 1)."""
    from matplotlib.patches import Rectangle  # optional dependency: only a report draws

    cells = h.pooled.size
    ax.imshow(h.logr[None, :], aspect="auto", cmap="RdYlBu_r", norm=norm, interpolation="none",
              extent=(0, h.n, S0, S1), origin="lower")
    xs = np.arange(cells + 1) * (h.n / max(cells, 1))
    if cells:
        st = ax.stairs(h.y_of(h.logr), xs, color="#333", linewidth=0.8, baseline=None)
        st.set_rasterized(cells > 200)  # a long profile is cheaper as a small PNG than as a path
    y1 = float(h.y_of(0.0))
    ax.add_patch(Rectangle((0, y1), h.xmax, P1 - y1, facecolor="#f5b7b1", alpha=0.35, linewidth=0))
    ax.plot([0, h.xmax], [y1, y1], color="#c0392b", linewidth=0.9, linestyle="--")
    ax.text(0.998 * h.xmax, y1, "allowance (ratio 1) ", ha="right", va="bottom", fontsize=6.5, color="#c0392b")
    ax.plot([0, h.xmax], [P0 - 0.08, P0 - 0.08], color="#bbb", linewidth=0.5)


def _draw_layout(ax, h: _Heat) -> None:
    """The rank slices, ZeRO-3's padding, the padded tails (at least a few px wide, marked on top) and
    the partition boundaries (at the first element of every rank slice but the first)."""
    from matplotlib.patches import Rectangle  # optional dependency: only a report draws

    xmax = h.xmax
    for rk, a, b in h.ranks:
        ax.add_patch(Rectangle((a, R0), b - a, R1 - R0, facecolor=RANK_COLOURS[rk % len(RANK_COLOURS)], linewidth=0))
        if (b - a) / xmax > 0.045:
            ax.text((a + b) / 2, (R0 + R1) / 2, f"rank {rk}", ha="center", va="center", fontsize=7)
    if h.pad:
        ax.add_patch(Rectangle((h.n, R0), h.pad, S1 - R0, facecolor="#eeeeee", edgecolor="#999999", hatch="////",
                               linewidth=0)).set_gid("padding")
        if h.pad / xmax > 0.04:
            ax.text(h.n + h.pad / 2, (R0 + R1) / 2, "pad", ha="center", va="center", fontsize=6, color="#555")
    min_w = xmax * 0.004
    for i, (a, b) in enumerate(h.tails):
        w = max(b - a, min_w)
        cx = (a + b) / 2
        ax.add_patch(Rectangle((cx - w / 2, R0), w, S1 - R0, facecolor="none", edgecolor="#8e44ad",
                               linewidth=1.2, hatch="xx")).set_gid(f"padded-tail-{i}")
        ax.plot([cx], [P1 + 0.12], marker="v", color="#8e44ad", markersize=5)
    if h.tails:
        ax.text(0.005 * xmax, P1 + 0.12, "\u25bc padded tail", ha="left", va="center", fontsize=7, color="#8e44ad")
    for rk, a, _ in h.ranks:
        if a > 0:
            ax.plot([a, a], [R0, P1], color="black", linewidth=1.4)[0].set_gid(f"boundary-r{rk}")


def _draw_axes(ax, h: _Heat, title: str) -> None:
    from matplotlib.ticker import MaxNLocator  # optional dependency: only a report draws

    ax.set_xlim(0, h.xmax)
    ax.set_ylim(R0, TOP)
    xt = [t for t in MaxNLocator(nbins=8, integer=True).tick_values(0, h.xmax) if 0 <= t <= h.xmax]
    decades = h.decades()
    _ticks(ax, xt, [f"{int(t)}" for t in xt],
           [(R0 + R1) / 2, (S0 + S1) / 2] + [float(h.y_of(t)) for t in decades],
           ["ranks", "ratio"] + [_log_label(10.0 ** t) for t in decades])
    ax.text(0.5, -0.14, "flat element index (row-major)", transform=ax.transAxes, ha="center", va="top", fontsize=8)
    ax.text(0, 1.03, title, transform=ax.transAxes, ha="left", va="bottom", fontsize=9)


def _draw_colour_scale(cax, h: _Heat, norm) -> None:
    cax.imshow(np.linspace(h.vmin, h.vmax, 128)[:, None], aspect="auto", cmap="RdYlBu_r", norm=norm,
               interpolation="none", extent=(0, 1, h.vmin, h.vmax), origin="lower")
    _ticks(cax)
    cax.set_ylim(h.vmin, h.vmax)
    tr = cax.get_yaxis_transform()
    for t in h.decades():
        cax.text(1.0, t, " " + _log_label(10.0 ** t), transform=tr, ha="left", va="center", fontsize=6)
    cax.text(0.5, 1.1, "err/allow", transform=cax.transAxes, ha="center", va="bottom", fontsize=6)


def heatmap_svg(ratio, layout: dict | None, *, case: str, param: str, quantity: str, step: int, stage: int = 0,
                world_size: int | None = None, max_cells: int = MAX_CELLS) -> str:
    """Strip heatmap of |err|/allowance over the parameter's flat (row-major) elements, as ZeRO
    partitions them. One axes holds three bands sharing the element axis: the rank slices (bottom),
    the colour strip (middle) and a log profile of the same (max-pooled) ratios against the
    allowance line (top). Drawn over all three: the partition boundaries (``boundary-r<k>``, a
    line at the first element of rank k's slice), the padded-tail elements (``padded-tail-<i>``)
    and, for ZeRO-3, the padding appended after the last element (``padding``). One axes instead
    of four keeps a figure at ~50 ms."""
    from matplotlib.colors import TwoSlopeNorm  # optional dependency: only a report draws
    from matplotlib.figure import Figure  # late: only when a plot is drawn

    h = _heat(ratio, layout, stage, world_size, max_cells)
    title = (f"{case}: {param} {quantity}, step {step}  ({h.n} elements" + (f", {h.pad} padding" if h.pad else "")
             + ")" + (f"; {h.n_inf} non-finite" if h.n_inf else ""))
    with _rc():
        fig = Figure(figsize=(8.6, 2.6))
        ax = fig.add_axes((0.075, 0.2, 0.835, 0.68))
        cax = fig.add_axes((0.925, 0.2 + 0.68 * S0 / TOP, 0.012, 0.68 * (P1 - S0) / TOP))
        ax.patch.set_gid("heat-axes")
        norm = TwoSlopeNorm(vmin=h.vmin, vcenter=0.0, vmax=h.vmax)
        _draw_strip_and_profile(ax, h, norm)
        _draw_layout(ax, h)
        _draw_axes(ax, h, title)
        _draw_colour_scale(cax, h, norm)
        return _svg_of(fig)


def steps_svg(checks: list[CheckRow], *, case: str = "") -> str:
    """One small log-scale panel per quantity with a failing check: worst error (solid) and its
    allowance (dashed) per parameter vs optimizer step; failing points ringed in red."""
    from matplotlib.figure import Figure  # late: only when a plot is drawn

    failing_q = []
    for c in sorted(checks, key=lambda c: (c.step, -c.worst_ratio)):
        if c.n_bad and c.quantity not in failing_q:
            failing_q.append(c.quantity)
    if not failing_q:
        return ""
    params = sorted({c.param for c in checks if c.quantity in failing_q and not math.isnan(_pos(c.error))})
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
    color = {p: palette[i % len(palette)] for i, p in enumerate(params)}
    ncols = min(4, len(failing_q))
    nrows = -(-len(failing_q) // ncols)
    steps_all = sorted({c.step for c in checks if c.quantity in failing_q})
    if len(steps_all) > 8:
        stride = -(-len(steps_all) // 8)
        steps_all = steps_all[::stride]
    W, H = 2.6 * ncols + 0.5, 1.6 * nrows + 0.3
    with _rc():
        fig = Figure(figsize=(W, H))
        left, right, top, bottom = 0.55 / W, 0.15 / W, 0.3 / H, 0.05 / H
        cw, ch = (1 - left - right) / ncols, (1 - top - bottom) / nrows
        for i, q in enumerate(failing_q):
            r, c_ = divmod(i, ncols)
            ax = fig.add_axes((left + c_ * cw + 0.1 / W, 1 - top - (r + 1) * ch + 0.32 / H,
                               cw - 0.55 / W, ch - 0.5 / H))
            ax.set_gid(f"quantity-{q}")
            ys = []
            for p in params:
                pts = sorted((c.step, _pos(c.error), _pos(c.allowance), c.n_bad > 0) for c in checks
                             if c.param == p and c.quantity == q)
                if not pts:
                    continue
                st = [x[0] for x in pts]
                err = np.log10([x[1] for x in pts])
                allow = np.log10([x[2] for x in pts])
                ys += [v for v in list(err) + list(allow) if np.isfinite(v)]
                ax.plot(st, err, "-o", color=color[p], markersize=3)
                ax.plot(st, allow, "--", color=color[p], linewidth=0.9, alpha=0.7)
                bad = [(x[0], math.log10(x[1])) for x in pts if x[3] and not math.isnan(x[1])]
                if bad:
                    ax.plot([b[0] for b in bad], [b[1] for b in bad], "o", markersize=5, markerfacecolor="none",
                            markeredgecolor="#c0392b", markeredgewidth=0.9)
            lo, hi = (math.floor(min(ys)), math.ceil(max(ys))) if ys else (-1, 0)
            if hi == lo:
                hi += 1
            ax.set_ylim(lo - 0.15, hi + 0.15)
            if steps_all:
                ax.set_xlim(min(steps_all) - 0.3, max(steps_all) + 0.3)
            stride = max(1, math.ceil((hi - lo) / 4))
            dec = list(range(lo, hi + 1, stride))
            _ticks(ax, steps_all, [str(v) for v in steps_all], dec, [_log_label(10.0 ** d) for d in dec],
                   grid_y=True)
            ax.text(0.5, 1.03, q, transform=ax.transAxes, ha="center", va="bottom", fontsize=8)
            if r == nrows - 1 or i + ncols >= len(failing_q):
                ax.text(0.5, -0.2, "step", transform=ax.transAxes, ha="center", va="top", fontsize=7)
        x = left + 0.1 / W  # legend as coloured texts (a Legend costs as much as a panel)
        for p in params:
            fig.text(x, 1 - 0.06 / H, "\u2501\u25cf " + p, color=color[p], ha="left", va="top", fontsize=7)
            x += (len(p) + 5) * 0.058 / W
        fig.text(1 - right, 1 - 0.06 / H, "solid: error   dashed: allowance   \u25cb failing", color="#555",
                 ha="right", va="top", fontsize=6.5)
        fig.text(0.1 / W, 0.5, "error (log)", rotation=90, ha="left", va="center", fontsize=7)
        return _svg_of(fig)


def _ticks(ax, x=(), xlabels=(), y=(), ylabels=(), *, size: float = 7, grid_y: bool = False) -> None:
    """Ticks drawn as one marker line plus plain texts. Matplotlib's own Tick objects (two lines
    and two texts each, laid out one by one, plus the title/label placement passes they trigger)
    are most of a small figure's cost; a report draws a hundred figures."""
    from matplotlib.ticker import NullLocator  # late: only when a plot is drawn
    from matplotlib.transforms import offset_copy  # late: only when a plot is drawn

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(NullLocator())
        axis.set_minor_locator(NullLocator())
    fig = ax.figure
    if len(x):
        tr = ax.get_xaxis_transform()
        ax.plot(list(x), [0.0] * len(x), linestyle="none", marker=3, markersize=2.5, markeredgewidth=0.6,
                color="black", transform=tr, clip_on=False)
        lab = offset_copy(tr, fig=fig, y=-4, units="points")
        for v, t in zip(x, xlabels):
            ax.text(v, 0, t, transform=lab, ha="center", va="top", fontsize=size)
    if len(y):
        tr = ax.get_yaxis_transform()
        ax.plot([0.0] * len(y), list(y), linestyle="none", marker=0, markersize=2.5, markeredgewidth=0.6,
                color="black", transform=tr, clip_on=False)
        lab = offset_copy(tr, fig=fig, x=-4, units="points")
        for v, t in zip(y, ylabels):
            ax.text(0, v, t, transform=lab, ha="right", va="center", fontsize=size)
        if grid_y:
            gx, gy = [], []
            for v in y:
                gx += [0, 1, float("nan")]
                gy += [v, v, float("nan")]
            ax.plot(gx, gy, color="#cccccc", linewidth=0.3, transform=tr)


def _log_label(v, _pos=None) -> str:
    """Tick label of a log axis as plain text ("1e-5"): mathtext costs a third of a figure's time."""
    if v <= 0:
        return ""
    e = math.log10(v)
    if abs(e - round(e)) < 1e-9:
        e = int(round(e))
        return "1" if e == 0 else ("10" if e == 1 else f"1e{e}")
    return f"{v:.2g}"


