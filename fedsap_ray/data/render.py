"""Rendered digit domains: street-number-like (SVHN stand-in) and font digits (SynthDigits stand-in).

Why: the real SVHN and SynthDigits cannot be downloaded on an offline laptop, yet the
Digits benchmark needs their appearance shift (colour, texture, clutter, blur) against
MNIST-like domains. These renderers draw digits from the TrueType fonts that matplotlib
ships, so they work wherever the package dependencies are installed. They are
*stand-ins*, never the real datasets, and callers must say so in their outputs.

Both renderers return ``(x, y)``: ``x`` uint8 ``[n, 3, 32, 32]`` (NCHW), ``y`` int64 labels
0..9. Output is deterministic for ``(n, seed)`` (same Pillow/FreeType versions) and
prefix-stable: the first ``k`` images of ``render_*(n, s)`` equal ``render_*(k, s)``,
because images are drawn in fixed chunks, each from its own
``SeedSequence((seed, purpose, chunk))``.

Glyphs are composed at 2x resolution (64x64) and box-downsampled to 32x32, which
anti-aliases the affine-transformed glyph edges cheaply.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# matplotlib (its fonts, hsv_to_rgb) and scipy (gaussian_filter) are imported where a digit is drawn: every
# process that imports the package (a CLI call, a Ray worker, a trial) loads the data package, and most of them
# read a cached dataset and never draw one; the two libraries were most of the package's import time.

SIZE = 32  # output side
_SS = 2  # supersampling factor for glyph masks
_CANVAS = SIZE * _SS
_FONT_PX = 64  # glyph bank font size (digit height ~46 px, close to the 64-px canvas scale)
_CHUNK = 500  # images per independently seeded chunk (prefix stability); 50 per class
_PURPOSE_STREET = 301
_PURPOSE_SYNTH = 302

# matplotlib's bundled fonts whose ASCII digits are ordinary digit glyphs. The STIX
# size/non-unicode variants, cmsy10/cmex10/cmmi10 (symbols / old-style figures),
# LastResortHE (placeholder boxes) and the *Display faces (few glyphs) are left out.
_FONT_FILES = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf", "cmr10.ttf", "cmb10.ttf", "cmss10.ttf",
    "cmtt10.ttf", "cmti10.ttf",
)
_STROKES = (0, 1, 2, 3)  # extra stroke width in glyph-bank pixels (boldness / outline)


def _luminance(rgb: np.ndarray) -> np.ndarray:
    """Relative luma of RGB in [0, 1], ITU-R BT.601 weights (0.299, 0.587, 0.114)."""
    return rgb @ np.array([0.299, 0.587, 0.114])


def _render_digit_mask(font: ImageFont.FreeTypeFont, digit: int, stroke: int) -> np.ndarray:
    img = Image.new("L", (2 * _FONT_PX, 2 * _FONT_PX), 0)
    ImageDraw.Draw(img).text((_FONT_PX, _FONT_PX), str(digit), font=font, fill=255, anchor="mm",
                             stroke_width=stroke, stroke_fill=255)
    return np.asarray(img)


def _renders_digits(path: Path) -> bool:
    """A font is usable when its ten digit glyphs are non-empty and pairwise distinct."""
    try:
        font = ImageFont.truetype(str(path), _FONT_PX)
    except OSError:
        return False
    masks = [_render_digit_mask(font, d, 0) for d in range(10)]
    if any(m.max() == 0 for m in masks):
        return False
    return len({m.tobytes() for m in masks}) == 10


@functools.lru_cache(maxsize=1)
def digit_fonts() -> tuple[Path, ...]:
    """Paths of matplotlib's bundled TrueType fonts that render the ten digits."""
    import matplotlib

    ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    fonts = tuple(ttf / n for n in _FONT_FILES if (ttf / n).is_file() and _renders_digits(ttf / n))
    if not fonts:
        raise RuntimeError(f"no usable digit fonts found under {ttf}; is matplotlib installed completely?")
    return fonts


@dataclass(frozen=True)
class _Glyph:
    """One digit glyph: RGB image with R = mask incl. stroke, G = fill-only mask; ink-cropped."""

    img: Image.Image
    w: int
    h: int


@functools.lru_cache(maxsize=1)
def _glyph_bank() -> tuple[tuple[tuple[_Glyph, ...], ...], ...]:
    """bank[font][stroke][digit], rendered once per process (~0.3 s)."""
    bank = []
    for path in digit_fonts():
        font = ImageFont.truetype(str(path), _FONT_PX)
        per_stroke = []
        for s in _STROKES:
            glyphs = []
            for d in range(10):
                full = _render_digit_mask(font, d, s)
                fill = _render_digit_mask(font, d, 0)
                ys, xs = np.nonzero(full)
                y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
                rgb = np.zeros((y1 - y0, x1 - x0, 3), np.uint8)
                rgb[..., 0] = full[y0:y1, x0:x1]
                rgb[..., 1] = np.minimum(fill[y0:y1, x0:x1], full[y0:y1, x0:x1])
                glyphs.append(_Glyph(Image.fromarray(rgb, "RGB"), int(x1 - x0), int(y1 - y0)))
            per_stroke.append(tuple(glyphs))
        bank.append(tuple(per_stroke))
    return tuple(bank)


def _place(glyph: _Glyph, cx: float, cy: float, height: float, aspect: float, angle: float,
           shear: float) -> np.ndarray:
    """Draw ``glyph`` on the 64x64 canvas centred at (cx, cy), ``height`` canvas px tall.

    Forward map: out = c + R(angle) @ Shear(shear) @ diag(sx, sy) @ (g - g_centre);
    PIL's AFFINE transform wants the inverse map (output -> glyph coordinates).
    """
    sy = height / glyph.h
    sx = sy * aspect
    c, s = math.cos(angle), math.sin(angle)
    # inverse of R @ [[1, k], [0, 1]] @ diag(sx, sy) = diag(1/sx, 1/sy) @ [[1, -k], [0, 1]] @ R^T
    a, b = (c + shear * s) / sx, (s - shear * c) / sx
    d, e = -s / sy, c / sy
    data = (a, b, glyph.w / 2.0 - a * cx - b * cy, d, e, glyph.h / 2.0 - d * cx - e * cy)
    out = glyph.img.transform((_CANVAS, _CANVAS), Image.Transform.AFFINE, data,
                              resample=Image.Resampling.BILINEAR, fillcolor=(0, 0, 0))
    return np.asarray(out)[..., :2]


def _downsample(masks: np.ndarray) -> np.ndarray:
    """[m, 64, 64, c] uint8 -> [m, 32, 32, c] float32 in [0, 1] by 2x2 box averaging."""
    acc = masks[:, 0::2, 0::2].astype(np.uint16)
    acc += masks[:, 1::2, 0::2]
    acc += masks[:, 0::2, 1::2]
    acc += masks[:, 1::2, 1::2]
    return acc.astype(np.float32) * np.float32(1.0 / (4 * 255))


@functools.lru_cache(maxsize=4)
def _bilinear_matrix(src: int, dst: int) -> np.ndarray:
    """[dst, src] matrix of 1-D linear interpolation, half-pixel centres (as align_corners=False)."""
    pos = np.clip((np.arange(dst) + 0.5) * src / dst - 0.5, 0, src - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, src - 1)
    w = (pos - lo).astype(np.float32)
    mat = np.zeros((dst, src), np.float32)
    np.add.at(mat, (np.arange(dst), lo), 1 - w)
    np.add.at(mat, (np.arange(dst), hi), w)
    return mat


def _smooth_noise(rng: np.random.Generator, m: int, cells: int) -> np.ndarray:
    """[m, 32, 32, 3] low-frequency noise: a cells x cells N(0, 1) grid upsampled bilinearly."""
    u = _bilinear_matrix(cells, SIZE)
    grid = rng.standard_normal((m, cells, cells, 3), dtype=np.float32)
    return np.einsum("ij,mjkc,lk->milc", u, grid, u, optimize=True)


def _grid() -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    return (xx + 0.5) / SIZE - 0.5, (yy + 0.5) / SIZE - 0.5  # centred coords in [-0.5, 0.5]


def _linear_ramp(rng: np.random.Generator, m: int) -> np.ndarray:
    """[m, 32, 32, 1] ramp in [0, 1] along a random direction per image."""
    xx, yy = _grid()
    phi = rng.uniform(0, 2 * np.pi, m).astype(np.float32)
    t = np.cos(phi)[:, None, None] * xx + np.sin(phi)[:, None, None] * yy  # in [-0.71, 0.71]
    return (t / np.sqrt(2.0) + 0.5)[..., None]


def _random_hsv(rng: np.random.Generator, m: int, sat: tuple[float, float], val: tuple[float, float]) -> np.ndarray:
    hsv = np.stack([rng.uniform(0, 1, m), rng.uniform(*sat, m), rng.uniform(*val, m)], axis=1)
    return _hsv_rgb(hsv)


def _hsv_rgb(hsv: np.ndarray) -> np.ndarray:
    from matplotlib.colors import hsv_to_rgb

    return hsv_to_rgb(hsv).astype(np.float32)


def _contrasting_colour(rng: np.random.Generator, bg_mean: np.ndarray, sat: tuple[float, float],
                        min_contrast: float, tries: int = 30) -> np.ndarray:
    """Foreground colours whose BT.601 luma differs from the background's by >= min_contrast.

    Rejection sampling keeps both light-on-dark and dark-on-light cases; images still
    failing after ``tries`` draws get black or white, whichever is farther from the background.
    """
    m = len(bg_mean)
    fg = _random_hsv(rng, m, sat, (0.0, 1.0))
    lbg = _luminance(bg_mean)
    bad = np.abs(_luminance(fg) - lbg) < min_contrast
    for _ in range(tries):
        if not bad.any():
            break
        fg[bad] = _random_hsv(rng, int(bad.sum()), sat, (0.0, 1.0))
        bad = np.abs(_luminance(fg) - lbg) < min_contrast
    fg[bad] = np.where(lbg[bad, None] > 0.5, 0.0, 1.0)
    return fg


def _blur_groups(img: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Gaussian blur each image [m, H, W, 3] with its own sigma; vectorised per distinct sigma."""
    from scipy import ndimage

    out = img.copy()
    for s in np.unique(sigma):
        if s > 0:
            idx = np.nonzero(sigma == s)[0]
            out[idx] = ndimage.gaussian_filter(img[idx], sigma=(0, s, s, 0), mode="nearest")
    return out


def _to_uint8_nchw(img: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray((np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8).transpose(0, 3, 1, 2))


def _chunked(n: int, seed: int, purpose: int, render_chunk) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    xs, ys = [np.zeros((0, 3, SIZE, SIZE), np.uint8)], [np.zeros(0, np.int64)]
    for k, start in enumerate(range(0, n, _CHUNK)):
        m = min(_CHUNK, n - start)
        rng = np.random.default_rng(np.random.SeedSequence((int(seed), purpose, k)))
        labels = rng.permutation(np.arange(_CHUNK) % 10).astype(np.int64)  # 50 per class per chunk
        # a partial last chunk is rendered in full and cut, so its images do not depend on n
        xs.append(render_chunk(rng, labels)[:m])
        ys.append(labels[:m])
    return np.concatenate(xs), np.concatenate(ys)


# --------------------------------------------------------------------------- street
def _street_chunk(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """House-number crops: textured plate, centred digit, clipped neighbours, shading, blur."""
    bank = _glyph_bank()
    m = len(labels)
    # background: gradient between two related colours + low-frequency texture + stripes
    c1 = _random_hsv(rng, m, (0.0, 0.6), (0.12, 0.95))
    hsv2 = np.stack([rng.uniform(0, 1, m), rng.uniform(0, 0.6, m), rng.uniform(0.12, 0.95, m)], 1)
    c2 = 0.6 * c1 + 0.4 * _hsv_rgb(hsv2)
    ramp = _linear_ramp(rng, m)
    bg = c1[:, None, None, :] * (1 - ramp) + c2[:, None, None, :] * ramp
    bg += _smooth_noise(rng, m, 4) * rng.uniform(0.02, 0.10, m).astype(np.float32)[:, None, None, None]
    xx, yy = _grid()
    psi = rng.uniform(0, np.pi, m).astype(np.float32)
    freq = rng.uniform(2.0, 7.0, m).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, m).astype(np.float32)
    amp = rng.uniform(0.03, 0.12, m).astype(np.float32) * (rng.random(m) < 0.35)
    stripes = np.sin(2 * np.pi * freq[:, None, None] * (np.cos(psi)[:, None, None] * xx
                                                          + np.sin(psi)[:, None, None] * yy) + phase[:, None, None])
    bg += (amp[:, None, None] * stripes)[..., None]
    fg = _contrasting_colour(rng, bg.mean(axis=(1, 2)), sat=(0.0, 0.7), min_contrast=0.3)

    # foreground: one plate style per image (font, stroke, size, slant) shared by all its digits
    font = rng.integers(0, len(bank), m)
    stroke = rng.integers(0, len(_STROKES), m)
    height = rng.uniform(0.55, 0.85, m) * _CANVAS
    aspect = rng.uniform(0.85, 1.2, m)
    angle = np.deg2rad(rng.uniform(-8, 8, m))
    shear = rng.uniform(-0.15, 0.15, m)
    cx = _CANVAS / 2 + rng.uniform(-3, 3, m) * _SS
    cy = _CANVAS / 2 + rng.uniform(-2, 2, m) * _SS
    gap = rng.uniform(0.04, 0.25, m) * height
    has_left, has_right = rng.random(m) < 0.6, rng.random(m) < 0.6
    neigh = rng.integers(0, 10, (m, 2))
    masks = np.zeros((m, _CANVAS, _CANVAS, 2), np.uint8)
    for i in range(m):
        glyphs = bank[font[i]][stroke[i]]
        g = glyphs[labels[i]]
        scale = height[i] / g.h * aspect[i]
        mask = _place(g, cx[i], cy[i], height[i], aspect[i], angle[i], shear[i])
        for side, present, d in ((-1, has_left[i], neigh[i, 0]), (1, has_right[i], neigh[i, 1])):
            if present:
                gn = glyphs[d]
                dx = side * ((g.w + gn.w) / 2 * scale + gap[i])
                mask = np.maximum(mask, _place(gn, cx[i] + dx * np.cos(angle[i]), cy[i] + dx * np.sin(angle[i]),
                                               height[i] * gn.h / g.h, aspect[i], angle[i], shear[i]))
        masks[i] = mask
    alpha = _downsample(masks)[..., :1]
    img = bg * (1 - alpha) + fg[:, None, None, :] * alpha
    # illumination: a brightness ramp over plate and digits alike, then camera blur and noise
    light = 1.0 + rng.uniform(0.0, 0.5, m).astype(np.float32)[:, None, None, None] * (_linear_ramp(rng, m) - 0.5)
    img = _blur_groups(img * light, rng.choice(np.array([0.0, 0.5, 0.8, 1.1], np.float32), m))
    img += rng.standard_normal(img.shape, dtype=np.float32) * rng.uniform(0.01, 0.05, m).astype(np.float32)[:, None, None, None]
    return _to_uint8_nchw(img)


def render_street_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` street-number-like 32x32 colour crops (an SVHN stand-in) and their labels.

    Each crop centres one digit on a textured, shaded plate (colour gradient, low-frequency
    noise, sometimes stripes), with parts of neighbouring digits clipped at the left/right
    edges as clutter, slight rotation/shear/scale, blur and sensor noise; foreground and
    background colours differ in BT.601 luma by >= 0.3.
    """
    return _chunked(n, seed, _PURPOSE_STREET, _street_chunk)


# --------------------------------------------------------------------------- synth
def _synth_chunk(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """Font digits in varied style on plain or two-colour backgrounds; mostly crisp, no clutter."""
    bank = _glyph_bank()
    m = len(labels)
    c1 = _random_hsv(rng, m, (0.0, 1.0), (0.0, 1.0))
    c2 = _random_hsv(rng, m, (0.0, 1.0), (0.0, 1.0))
    plain = rng.random(m) < 0.5
    ramp = _linear_ramp(rng, m) * (~plain)[:, None, None, None]
    bg = c1[:, None, None, :] * (1 - ramp) + c2[:, None, None, :] * ramp
    fg = _contrasting_colour(rng, bg.mean(axis=(1, 2)), sat=(0.0, 1.0), min_contrast=0.3)
    outline = rng.random(m) < 0.35
    oc = _random_hsv(rng, m, (0.0, 1.0), (0.0, 1.0))

    font = rng.integers(0, len(bank), m)
    stroke = np.where(outline, rng.integers(2, len(_STROKES), m), rng.integers(0, len(_STROKES), m))
    height = rng.uniform(0.45, 0.9, m) * _CANVAS
    aspect = rng.uniform(0.8, 1.25, m)
    angle = np.deg2rad(rng.uniform(-15, 15, m))
    shear = rng.uniform(-0.2, 0.2, m)
    # keep the digit inside: centre jitter up to half the free margin
    slack = np.maximum(_CANVAS - height, 0) / 2
    cx = _CANVAS / 2 + rng.uniform(-1, 1, m) * slack * 0.6
    cy = _CANVAS / 2 + rng.uniform(-1, 1, m) * slack * 0.6
    masks = np.zeros((m, _CANVAS, _CANVAS, 2), np.uint8)
    for i in range(m):
        masks[i] = _place(bank[font[i]][stroke[i]][labels[i]], cx[i], cy[i], height[i], aspect[i], angle[i], shear[i])
    a = _downsample(masks)
    full, fill = a[..., :1], a[..., 1:]
    # outlined digits: outline colour on the stroke ring, fill colour inside; else one colour
    fill = np.where(outline[:, None, None, None], fill, full)
    img = bg * (1 - full) + oc[:, None, None, :] * (full - fill) + fg[:, None, None, :] * fill
    img = _blur_groups(img, rng.choice(np.array([0.0, 0.0, 0.4, 0.7], np.float32), m))
    img += rng.standard_normal(img.shape, dtype=np.float32) * rng.uniform(0.0, 0.02, m).astype(np.float32)[:, None, None, None]
    return _to_uint8_nchw(img)


def render_synth_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` font-rendered 32x32 digits in random style (a SynthDigits stand-in) and labels.

    Style per image: font (DejaVu/STIX/Computer Modern faces), stroke weight, optional
    outline in a third colour, size, aspect, rotation (+-15 deg), shear, position,
    saturated colours on a plain or two-colour gradient background, light blur.
    """
    return _chunked(n, seed, _PURPOSE_SYNTH, _synth_chunk)
