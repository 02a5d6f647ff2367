"""The GEMM shapes the benchmark runs, in groups that each stress one thing."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    group: str
    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def bytes(self, element_size: int) -> int:
        """Compulsory traffic: read A and B once, write C once."""
        return element_size * (self.m * self.k + self.k * self.n + self.m * self.n)


def _plain(group: str, m: int, n: int, k: int) -> Shape:
    return Shape(group, f"{m}x{n}x{k}", m, n, k)


def _llama() -> list[Shape]:
    """Transformer projections (hidden h, FFN width f) at T tokens: the up-projection
    (T, f, h) and the down-projection (T, h, f). T = 1 and 16 are decode; 2048 and 8192
    are prefill."""
    shapes = []
    for hidden, ffn in ((4096, 14336), (8192, 28672)):
        for tokens in (1, 16, 128, 2048, 8192):
            shapes.append(Shape("llama", f"h{hidden}_up_T{tokens}", tokens, ffn, hidden))
            shapes.append(Shape("llama", f"h{hidden}_down_T{tokens}", tokens, hidden, ffn))
    return shapes


FULL = [
    *(Shape("square", f"sq{s}", s, s, s) for s in (1024, 2048, 4096, 8192, 16384)),
    *_llama(),
    # Ragged edge tiles in every dimension; 4095x4097x4093 and 2049x1023x777 also have
    # strides that are not 16-byte aligned (pointer loads, no TMA).
    *(_plain("unaligned", *mnk) for mnk in ((3000, 5000, 2000), (1000, 1000, 1000),
                                           (4095, 4097, 4093), (2049, 1023, 777))),
    # Few output tiles, long K loops: fewer tiles than SMs, so the schedule matters.
    *(_plain("k_heavy", *mnk) for mnk in ((1024, 1024, 16384), (256, 512, 32768))),
    *(_plain("skinny", *mnk) for mnk in ((64, 8192, 8192), (128, 8192, 8192), (16, 4096, 4096))),
    # The remaining rows of the probe table in METHOD.md, for comparison.
    *(_plain("design", *mnk) for mnk in ((4864, 8192, 4160), (4096, 14336, 4096))),
]

_QUICK_NAMES = (
    "sq4096", "sq8192", "h4096_up_T16", "h4096_up_T2048", "h4096_down_T2048",
    "4096x14336x4096", "3000x5000x2000", "1000x1000x1000", "4095x4097x4093",
    "1024x1024x16384", "128x8192x8192",
)
QUICK = [s for s in FULL if s.name in _QUICK_NAMES]

# Tiny shapes for the CPU interpreter (--smoke): one ragged in every dimension.
SMOKE = [_plain("smoke", 70, 50, 40), _plain("smoke", 32, 64, 96)]

# The six rows of METHOD.md's probe table: small enough for --inductor.
_DESIGN_NAMES = ("sq8192", "4864x8192x4160", "4096x14336x4096", "3000x5000x2000", "128x8192x8192",
                 "1000x1000x1000")
DESIGN = [s for name in _DESIGN_NAMES for s in FULL if s.name == name]

CORPORA = {"full": FULL, "quick": QUICK, "design": DESIGN}


def parse_shapes(text: str) -> list[Shape]:
    """'8192x8192x8192,128x8192x8192' -> shapes of the group 'custom'."""
    return [_plain("custom", *(int(d) for d in item.split("x"))) for item in text.split(",")]
