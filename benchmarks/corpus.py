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


def _train_8b() -> list[Shape]:
    """A Llama-3-8B training step at 8192 tokens (hidden 4096, fused QKV 6144, fused gate
    and up 28672, down 14336 -> 4096): each projection's forward (T, out, in), its input
    gradient (T, in, out) and its weight gradient (in, out, T), less the two the llama
    group has (the down projection's forward and input gradient are h4096_down_T8192 and
    h4096_up_T8192); the bench's --b-layout sets B's layout for all of them."""
    shapes = []
    for name, inputs, outputs in (("qkv", 4096, 6144), ("gate_up", 4096, 2 * 14336), ("down", 14336, 4096)):
        if name != "down":
            shapes += [Shape("train8b", f"8b_{name}_fwd", 8192, outputs, inputs),
                       Shape("train8b", f"8b_{name}_dgrad", 8192, inputs, outputs)]
        shapes.append(Shape("train8b", f"8b_{name}_wgrad", inputs, outputs, 8192))
    return shapes


def _models() -> list[Shape]:
    """The GEMMs of benchmarks/models.py's blocks that the groups above lack, each forward
    (T, out, in), input gradient (T, in, out) and weight gradient (in, out, T): the GPT-2
    MLP (768 <-> 3072, 8192 tokens), the small Llama block (hidden 1024, FFN 2816, 4096
    tokens), the 8B block's key/value and output projections, and its decode steps' key /
    value projections (1 and 16 tokens). Routing policy "auto" predicts from these."""
    gemms = {(8192, 3072, 768), (8192, 768, 3072), (768, 3072, 8192), (3072, 768, 8192),
             (4096, 1024, 1024), (1024, 1024, 4096), (4096, 2816, 1024), (4096, 1024, 2816),
             (1024, 2816, 4096), (2816, 1024, 4096),
             (8192, 1024, 4096), (8192, 4096, 1024), (4096, 1024, 8192),
             (8192, 4096, 4096), (4096, 4096, 8192),
             (1, 1024, 4096), (16, 1024, 4096)}
    return [_plain("models", *mnk) for mnk in sorted(gemms)]


FULL = [
    *(Shape("square", f"sq{s}", s, s, s) for s in (1024, 2048, 4096, 6144, 8192, 16384)),
    *_llama(),
    *_train_8b(),
    # Ragged edge tiles in every dimension; 4095x4097x4093 and 2049x1023x777 also have
    # strides that are not 16-byte aligned (pointer loads, no TMA). The others have rows
    # that are 16-byte but not 128-byte multiples (a row starts mid-line): tall ones with
    # N or K of 1000-3000 among them.
    *(_plain("unaligned", *mnk) for mnk in ((3000, 5000, 2000), (1000, 1000, 1000),
                                           (4095, 4097, 4093), (2049, 1023, 777),
                                           (8192, 1000, 4096), (8192, 4096, 1000),
                                           (4096, 3000, 2048), (6144, 2000, 3000))),
    # Few output tiles, long K loops (K >= 16x the larger of M and N): fewer tiles than SMs,
    # so the schedule and the K split matter.
    *(_plain("k_heavy", *mnk) for mnk in ((1024, 1024, 16384), (256, 512, 32768), (512, 512, 16384),
                                         (128, 1024, 32768), (2048, 1024, 32768))),
    *(_plain("skinny", *mnk) for mnk in ((64, 8192, 8192), (128, 8192, 8192), (16, 4096, 4096))),
    # The remaining rows of the probe table in METHOD.md, for comparison.
    *(_plain("design", *mnk) for mnk in ((4864, 8192, 4160), (4096, 14336, 4096))),
    *_models(),
]

_QUICK_NAMES = (
    "sq4096", "sq8192", "h4096_up_T16", "h4096_up_T2048", "h4096_down_T2048",
    "4096x14336x4096", "3000x5000x2000", "1000x1000x1000", "4095x4097x4093", "8192x1000x4096",
    "1024x1024x16384", "512x512x16384", "128x8192x8192", "8b_qkv_fwd", "8b_down_wgrad",
    "8192x3072x768", "4096x2816x1024",
)
QUICK = [s for s in FULL if s.name in _QUICK_NAMES]

# Tiny shapes for the CPU interpreter (--smoke): one ragged in every dimension.
SMOKE = [_plain("smoke", 70, 50, 40), _plain("smoke", 32, 64, 96)]

# The six rows of METHOD.md's probe table: small enough for --inductor.
_DESIGN_NAMES = ("sq8192", "4864x8192x4160", "4096x14336x4096", "3000x5000x2000", "128x8192x8192",
                 "1000x1000x1000")
DESIGN = [s for name in _DESIGN_NAMES for s in FULL if s.name == name]

MODELS = [s for s in FULL if s.group == "models"]  # what policy "auto" needs for the model benchmark

CORPORA = {"full": FULL, "quick": QUICK, "design": DESIGN, "models": MODELS}


def parse_shapes(text: str) -> list[Shape]:
    """'8192x8192x8192,128x8192x8192' -> shapes of the group 'custom'."""
    return [_plain("custom", *(int(d) for d in item.split("x"))) for item in text.split(",")]
