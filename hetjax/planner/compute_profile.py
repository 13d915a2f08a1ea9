"""Compute profiles: measured seconds and bytes of a model's pieces, and reading them at any size.

A profile (a JSON file: `hetjax calibrate` writes one, a user with PyTorch or Megatron timings
can write one by hand; the format is in docs/planner.md) holds rows, one per accelerator kind,
piece ("layer": one decoder layer, "embedding", "head": final norm + output projection + loss),
TP degree, micro-batch tokens per device, sequence length and recompute policy: the forward
and backward seconds of the piece on one device (TP collectives included: the piece as it
ran), its peak bytes beyond its parameters, and optionally the bytes its forward keeps for the
backward and the spread of the repeated samples.

`ComputeProfile.lookup` reads it at the size a plan asks for: log-log interpolation in tokens
between measured sizes, then log-log in the TP degree between measured degrees; beyond the
measured range it extends the nearest segment (its slope held between 0 and 1: a piece never
gets cheaper with more tokens, nor dearer than in proportion) and a TP degree beyond the
measured ones scales by the degree's ratio (ideal TP). Every answer says whether and how far it
extrapolated (`Estimate.extrapolated`, `Estimate.distance`), which the prediction's band
widens with. No JAX: the planner reads profiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from hetjax.errors import PlanError

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

PROFILE_FORMAT = "hetjax compute profile"
PROFILE_VERSION = 1
PIECES = ("layer", "embedding", "head")
RECOMPUTE = ("none", "dots", "full")
# The shape fields a profile's model must share with the priced model for its "layer" rows
# (and the vocabulary for "embedding" / "head"): a profile of another shape prices nothing.
SHAPE_FIELDS = ("d_model", "n_heads", "n_kv_heads", "d_ff")


@dataclass(frozen=True)
class ProfileRow:
    """One measurement: `piece` on one device of `accelerator`, its TP group `tp` devices,
    `tokens` tokens per micro-batch (sequences x seq_len, the same on each TP member),
    recompute policy `recompute` (the backward's seconds include its recompute); `pipelined`:
    measured as the pipeline executors run it (forward and backward separate programs).
    peak_bytes: the piece's peak memory beyond its parameters for one micro-batch;
    kept_bytes: what its forward keeps for its backward (0: not measured); spread: the
    repeated samples' (max - min) / mean."""

    accelerator: str
    piece: str
    tp: int
    tokens: int
    seq_len: int
    fwd_s: float
    bwd_s: float
    recompute: str = "none"
    peak_bytes: float = 0.0
    kept_bytes: float = 0.0
    spread: float = 0.0
    pipelined: bool = False

    def __post_init__(self):
        where = f"profile row {self.accelerator}/{self.piece}/tp={self.tp}/tokens={self.tokens}"
        if self.piece not in PIECES:
            raise PlanError(f"{where}: piece {self.piece!r}; choose one of {', '.join(PIECES)}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"{where}: recompute {self.recompute!r}; choose one of "
                            f"{', '.join(RECOMPUTE)}")
        if self.tp < 1 or self.tokens < 1 or self.seq_len < 1:
            raise PlanError(f"{where}: tp, tokens and seq_len must be >= 1")
        if not (self.fwd_s > 0 and self.bwd_s > 0):
            raise PlanError(f"{where}: fwd_s and bwd_s must be > 0 seconds, got {self.fwd_s} "
                            f"and {self.bwd_s}")
        if min(self.peak_bytes, self.kept_bytes, self.spread) < 0:
            raise PlanError(f"{where}: peak_bytes, kept_bytes and spread must be >= 0")


@dataclass(frozen=True)
class Estimate:
    """A profile read at one size: seconds of forward and backward on one device, peak and
    kept bytes (0: not measured), the measurements' spread, and how far it extrapolated:
    `distance` is the largest factor between the asked size and the nearest measured one
    (tokens, TP degree or sequence length; 1.0 inside the measured range)."""

    fwd_s: float
    bwd_s: float
    peak_bytes: float
    kept_bytes: float
    spread: float
    distance: float = 1.0
    notes: tuple[str, ...] = ()

    @property
    def extrapolated(self) -> bool:
        return self.distance > 1.0 + 1e-9


def _loglog(points: list[tuple[float, tuple[float, ...]]], x: float
            ) -> tuple[tuple[float, ...], float]:
    """Values at `x` from (x_i, values_i) sorted by x_i: linear in (log x, log value) between
    the two measured points around x; beyond them the nearest segment's slope clamped to
    [0, 1] (one point: slope 1). Returns the values and the extrapolation factor."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        x0, v0 = points[0]
        return tuple(v * x / x0 for v in v0), max(x / x0, x0 / x)
    if x <= xs[0]:
        i, dist = 0, xs[0] / x
    elif x >= xs[-1]:
        i, dist = len(xs) - 2, x / xs[-1]
    else:
        i = max(j for j in range(len(xs) - 1) if xs[j] <= x)
        dist = 1.0
    (xa, va), (xb, vb) = points[i], points[i + 1]
    t = math.log(x / xa) / math.log(xb / xa)
    out = []
    for a, b in zip(va, vb):
        if a <= 0 or b <= 0:  # a quantity not measured at both ends: proportional to x
            base, xbase = (a, xa) if x <= xa else (b, xb)
            out.append(base * x / xbase)
            continue
        slope = math.log(b / a) / math.log(xb / xa)
        if dist > 1.0:
            slope = min(max(slope, 0.0), 1.0)
            base, xbase = (a, xa) if x <= xa else (b, xb)
            out.append(base * (x / xbase) ** slope)
        else:
            out.append(a * (b / a) ** t)
    return tuple(out), dist


@dataclass(frozen=True)
class ComputeProfile:
    """Measured rows for one model shape (`model`: its d_model, n_heads, n_kv_heads, d_ff,
    vocab_size), from `source` (who measured, how)."""

    rows: tuple[ProfileRow, ...]
    model: dict
    source: str = ""

    def __post_init__(self):
        missing = [k for k in (*SHAPE_FIELDS, "vocab_size") if k not in self.model]
        if missing:
            raise PlanError(f"a compute profile's model needs {', '.join(missing)} (the shape "
                            "it was measured on)")

    # --- what it covers ---------------------------------------------------------------------
    def accelerators(self) -> tuple[str, ...]:
        return tuple(sorted({r.accelerator for r in self.rows}))

    def mismatch(self, model: "ModelConfig") -> str | None:
        """Why this profile cannot price `model`'s layers (another shape), else None."""
        diff = [f"{k} {self.model[k]} (the model has {getattr(model, k)})"
                for k in (*SHAPE_FIELDS, "vocab_size") if self.model[k] != getattr(model, k)]
        return None if not diff else "measured on " + ", ".join(diff)

    def covers(self, accelerator: str, piece: str) -> bool:
        return any(r.accelerator == accelerator and r.piece == piece for r in self.rows)

    def mean_spread(self) -> float:
        return sum(r.spread for r in self.rows) / len(self.rows) if self.rows else 0.0

    # --- reading it --------------------------------------------------------------------------
    def lookup(self, accelerator: str, piece: str, tp: int, tokens: float, seq_len: int,
               recompute: str = "none", pipelined: bool = False) -> Estimate | None:
        """The piece at this size, or None when the profile has no row of this accelerator
        and piece. Rows of the asked recompute policy measured as asked (`pipelined`) are used;
        without them the policy is derived from 'none' rows (the backward plus the recomputed
        forward: all of it under 'full', its attention part under 'dots') and said so."""
        rows = [r for r in self.rows if r.accelerator == accelerator and r.piece == piece]
        if not rows:
            return None
        notes = []
        policy = recompute if piece == "layer" else "none"
        # what the backward recomputes: the whole forward ('full'), the attention's part of
        # its FLOPs ('dots' keeps the matmul outputs; the model's FLOPs formula splits them)
        factor = {"full": 1.0, "dots": 1.0 - self._layer_flops(0) / self._layer_flops(seq_len)
                  }.get(policy, 0.0)
        # the asked policy measured as asked; else derived from 'none' rows measured as asked
        # (a recompute in one program is not the one of separate programs); else either kind
        chosen, derived = [], 0.0
        for want_policy, same_run in ((policy, True), ("none", True), (policy, False),
                                      ("none", False)):
            chosen = [r for r in rows if (piece != "layer" or r.recompute == want_policy)
                      and (not same_run or r.pipelined == pipelined)]
            if chosen:
                derived = factor if want_policy != policy else 0.0
                break
        if not chosen:
            return None
        if derived:
            notes.append(f"{policy} derived from the 'none' rows")
        # the sequence length: the nearest measured, per-token time scaled by its FLOPs share
        seqs = sorted({r.seq_len for r in chosen}, key=lambda s: (abs(math.log(s / seq_len)), s))
        seq = seqs[0]
        chosen = [r for r in chosen if r.seq_len == seq]
        seq_dist = max(seq / seq_len, seq_len / seq)
        if seq != seq_len:
            notes.append(f"sequence {seq_len} read from rows of sequence {seq}")
        by_tp: dict[int, list[ProfileRow]] = {}
        for r in chosen:
            by_tp.setdefault(r.tp, []).append(r)
        at_tp: dict[float, tuple[tuple[float, ...], float]] = {}  # degree -> (values, distance)
        for degree, rs in sorted(by_tp.items()):
            merged: dict[float, list] = {}
            for r in rs:  # repeated sizes: their mean
                merged.setdefault(float(r.tokens), []).append(
                    (r.fwd_s, r.bwd_s, r.peak_bytes, r.kept_bytes))
            pts = sorted((x, tuple(sum(c) / len(vs) for c in zip(*vs)))
                         for x, vs in merged.items())
            at_tp[float(degree)] = _loglog(pts, float(tokens))
        degrees = sorted(at_tp)
        if tp in by_tp:
            used = [float(tp)]
            vals, tp_dist = at_tp[float(tp)][0], 1.0
        elif len(degrees) == 1 or not degrees[0] < tp < degrees[-1]:
            # beyond the measured degrees: the nearest one, its work split ideally
            near = min(degrees, key=lambda g: abs(math.log(g / tp)))
            used = [near]
            vals = tuple(x * near / tp for x in at_tp[near][0])
            tp_dist = max(near / tp, tp / near)
            notes.append(f"tp {tp} scaled from tp {near:g}")
        else:
            lo = max(g for g in degrees if g < tp)
            hi = min(g for g in degrees if g > tp)
            used = [lo, hi]
            vals, tp_dist = _loglog([(lo, at_tp[lo][0]), (hi, at_tp[hi][0])], float(tp))
        tok_dist = max(at_tp[g][1] for g in used)
        fwd, bwd, peak, kept = vals
        scale = 1.0
        if seq != seq_len and piece == "layer" and self._layer_flops(seq):
            scale = self._layer_flops(seq_len) / self._layer_flops(seq)
        fwd, bwd = fwd * scale, bwd * scale
        if derived:
            bwd += derived * fwd
        spread = max(r.spread for r in chosen)
        if tok_dist > 1 + 1e-9:
            notes.append(f"tokens {tokens:g} beyond the measured sizes (x{tok_dist:.3g})")
        return Estimate(fwd, bwd, peak, kept, spread, max(tok_dist, tp_dist, seq_dist),
                        tuple(notes))

    def _layer_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of the profile's layer (the model's formula on its shape)."""
        from hetjax.core.model_config import ModelConfig

        m = self.model
        shape = ModelConfig(vocab_size=int(m["vocab_size"]), d_model=int(m["d_model"]),
                            n_layers=1, n_heads=int(m["n_heads"]),
                            n_kv_heads=int(m["n_kv_heads"]), d_ff=int(m["d_ff"]),
                            max_seq_len=max(seq_len, 8))
        return shape.layer_flops(seq_len)

    # --- the file ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "source": self.source,
                "model": dict(self.model), "rows": [dataclasses.asdict(r) for r in self.rows]}

    @staticmethod
    def from_dict(d: dict, where: str = "compute profile") -> "ComputeProfile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise PlanError(f"{where}: not a hetjax compute profile (it needs \"format\": "
                            f"\"{PROFILE_FORMAT}\"); see docs/planner.md, or write one with "
                            "'hetjax calibrate'")
        if d.get("version") != PROFILE_VERSION:
            raise PlanError(f"{where}: version {d.get('version')!r}; this hetjax reads version "
                            f"{PROFILE_VERSION}")
        fields = {f.name for f in dataclasses.fields(ProfileRow)}
        rows = []
        for i, r in enumerate(d.get("rows", [])):
            extra = sorted(set(r) - fields)
            if extra:
                raise PlanError(f"{where}: row {i} has unknown field(s) {', '.join(extra)}; "
                                f"the fields are {', '.join(sorted(fields))}")
            try:
                rows.append(ProfileRow(**r))
            except TypeError as e:
                raise PlanError(f"{where}: row {i}: {e}") from None
        if not rows:
            raise PlanError(f"{where}: no rows")
        return ComputeProfile(tuple(rows), dict(d.get("model", {})), str(d.get("source", "")))

    @staticmethod
    def of_model(model: "ModelConfig") -> dict:
        """The shape fields a profile of `model` records."""
        return {k: getattr(model, k) for k in (*SHAPE_FIELDS, "vocab_size")}

    def merged(self, rows: Iterable[ProfileRow]) -> "ComputeProfile":
        return dataclasses.replace(self, rows=self.rows + tuple(rows))


def load_profile(path: str) -> ComputeProfile:
    """A compute profile file (planner.profile)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"planner.profile: cannot read {path!r} ({e}); write one with "
                        "'hetjax calibrate' or by hand (docs/planner.md)") from None
    return ComputeProfile.from_dict(d, f"planner.profile {path!r}")


def save_profile(profile: ComputeProfile, path: str) -> str:
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
    return path


__all__ = ["ComputeProfile", "ProfileRow", "Estimate", "PIECES", "RECOMPUTE", "PROFILE_FORMAT",
           "PROFILE_VERSION", "load_profile", "save_profile"]
