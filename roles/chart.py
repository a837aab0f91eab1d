"""PNG charts drawn with the standard library alone (zlib and struct): no plotting dependency.

`rigbook bench compare` draws bars with it (roles/verify.py) and `rigbook bench sweep` draws
lines (`line_chart`, roles/sweep.py): tok/s and tok/s per watt against the power cap.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

RGB = tuple[int, int, int]

#: 3x5 glyphs (rows of 3 bits) for chart labels.
GLYPHS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    "/": (1, 1, 2, 4, 4), " ": (0, 0, 0, 0, 0), "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6),
    "c": (7, 4, 4, 4, 7), "d": (6, 5, 5, 5, 6), "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4),
    "g": (7, 4, 5, 5, 7), "h": (5, 5, 7, 5, 5), "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 7),
    "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7), "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5),
    "o": (7, 5, 5, 5, 7), "p": (7, 5, 7, 4, 4), "q": (7, 5, 5, 7, 1), "r": (6, 5, 6, 5, 5),
    "s": (7, 4, 7, 1, 7), "t": (7, 2, 2, 2, 2), "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2),
    "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5), "y": (5, 5, 2, 2, 2), "z": (7, 1, 2, 4, 7),
}


def png_bytes(width: int, height: int, pixels: list[bytearray]) -> bytes:
    """An RGB PNG (8 bits per channel) of rows of width*3 bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Canvas:
    """White RGB rows to draw rectangles, lines and 3x5-glyph text on."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * width * 3) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: RGB) -> None:
        for y in range(max(y0, 0), min(y1, self.height)):
            row = self.rows[y]
            for x in range(max(x0, 0), min(x1, self.width)):
                row[3 * x: 3 * x + 3] = bytes(rgb)

    def text(self, x: int, y: int, text: str, scale: int = 2) -> None:
        for char in text.lower():
            for dy, bits in enumerate(GLYPHS.get(char, GLYPHS[" "])):
                for dx in range(3):
                    if bits & (4 >> dx):
                        self.rect(x + dx * scale, y + dy * scale, x + (dx + 1) * scale,
                                  y + (dy + 1) * scale, (0, 0, 0))
            x += 4 * scale

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb: RGB, width: int = 2) -> None:
        """A straight line (Bresenham), `width` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + width, y0 + width, rgb)
            if x0 == x1 and y0 == y1:
                return
            double = 2 * err
            if double >= dy:
                err, x0 = err + dy, x0 + sx
            if double <= dx:
                err, y0 = err + dx, y0 + sy


@dataclass(frozen=True)
class Series:
    """One line of a panel: its label, colour and a y value per x (None: no point there)."""

    label: str
    rgb: RGB
    values: tuple[float | None, ...]


@dataclass(frozen=True)
class Panel:
    """One plot: a title and its lines over the chart's shared x values."""

    title: str
    series: tuple[Series, ...]


PALETTE: tuple[RGB, ...] = ((52, 101, 164), (245, 121, 0), (78, 154, 6), (204, 0, 0))
_PLOT_W, _PLOT_H, _LEFT, _TOP = 420, 160, 56, 40


def line_chart(title: str, xs: Sequence[float], panels: Sequence[Panel],
               x_label: str = "cap w") -> bytes:
    """Panels stacked one above the other, each with its lines, x ticks at `xs` and the y range
    from 0 to its largest value; a legend under each panel. Returns the PNG's bytes."""
    if not xs:
        raise ValueError("a line chart needs at least one x value")
    low, high = min(xs), max(xs)
    span = (high - low) or 1.0
    block = _TOP + _PLOT_H + 44
    canvas = Canvas(_LEFT + _PLOT_W + 30, 24 + block * len(panels))
    canvas.text(8, 6, title)

    def x_of(value: float) -> int:
        return _LEFT + int((value - low) / span * _PLOT_W) if high > low else _LEFT + _PLOT_W // 2

    for number, panel in enumerate(panels):
        top = 24 + number * block + _TOP
        peak = max((v for s in panel.series for v in s.values if v is not None), default=0.0)
        peak = peak or 1.0
        canvas.text(_LEFT, top - 16, panel.title)
        canvas.rect(_LEFT, top + _PLOT_H, _LEFT + _PLOT_W + 2, top + _PLOT_H + 1, (0, 0, 0))
        canvas.rect(_LEFT - 1, top, _LEFT, top + _PLOT_H + 1, (0, 0, 0))
        canvas.text(4, top - 2, f"{peak:.3g}", 1)
        canvas.text(4, top + _PLOT_H - 4, "0", 1)
        for x in xs:
            canvas.rect(x_of(x), top + _PLOT_H, x_of(x) + 1, top + _PLOT_H + 4, (0, 0, 0))
            canvas.text(x_of(x) - 6, top + _PLOT_H + 7, f"{x:g}", 1)
        canvas.text(_LEFT + _PLOT_W - 30, top + _PLOT_H + 16, x_label, 1)
        for i, series in enumerate(panel.series):
            points = [(x_of(x), top + _PLOT_H - int(v / peak * _PLOT_H))
                      for x, v in zip(xs, series.values, strict=True) if v is not None]
            for (ax, ay), (bx, by) in zip(points, points[1:], strict=False):
                canvas.line(ax, ay, bx, by, series.rgb)
            for px, py in points:
                canvas.rect(px - 2, py - 2, px + 4, py + 4, series.rgb)
            legend = _LEFT + i * 110
            canvas.rect(legend, top + _PLOT_H + 28, legend + 10, top + _PLOT_H + 36, series.rgb)
            canvas.text(legend + 14, top + _PLOT_H + 28, series.label, 1)
    return png_bytes(canvas.width, canvas.height, canvas.rows)
