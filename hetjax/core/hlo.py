"""Reading a compiled XLA program: its collectives, and what its loops carry.

`collectives(compiled.as_text(), mesh.shape)` lists the all-gathers, reduce-scatters,
all-reduces, all-to-alls and collective-permutes of the optimized HLO. Each replica group is
mapped back to the mesh axes along which its devices differ (partition i is
`mesh.devices.flat[i]`, the order jit assigns devices in), and each op is multiplied by the trip
counts of the while loops around it, so a reduction inside the micro-batch loop shows up with
`count == microbatches` and `loop_depth >= 1`; one inside a branch of a conditional (the
pipeline's B branch of its tick loop) is marked `conditional`, its count an upper bound. This
is what the ZeRO audit compares with the cost model (parallel/zero_sharding.py `expected_collectives`),
and what `scripts/bench/zero.py` sums.

Bytes are the collective's full buffer V as cost models count it: the all-gather's result, the
reduce-scatter's operand, the all-reduce's buffer. `traffic` converts V to bytes each device
sends under the ring model: (p - 1) / p * V for all-gather and reduce-scatter, twice that for
all-reduce. `ring_steps` / `ring_bytes` are those formulas, the one definition the planner's
collective times (hetjax/planner/collectives.py) and DiLoCo's pricing use too.

`loop_carry(hlo, trip_count)` lists the per-device arrays a while loop carries and whether each
iteration updates them (a gradient accumulator) or passes them through (loop invariants).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

# Steps of a ring collective over p members; each moves V / p per member.
_RING_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "reduce_scatter": lambda p: p - 1,
               "all_gather": lambda p: p - 1}


def ring_steps(op: str, p: int) -> int:
    """Steps of the ring algorithm: 2(p-1) for an all-reduce, p-1 for a reduce-scatter or an
    all-gather (`op` in either spelling: all_reduce or HLO's all-reduce)."""
    return _RING_STEPS[op.replace("-", "_")](p)


def ring_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes each of p members sends in a ring collective of buffer V = nbytes."""
    return ring_steps(op, p) / p * nbytes


_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) +
                 r"|while)(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PREDICATED = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes along which the devices of a group differ
    group_size: int
    nbytes: int  # V: all-gather result, reduce-scatter operand, all-reduce buffer
    count: int  # executions per call of the program
    loop_depth: int  # enclosing while loops (0: straight-line code)
    scalar: bool = False  # only rank-0 arrays (a loss, a norm): latency, not bandwidth
    # Inside a branch of a conditional: `count` is the most it can run (the pipeline's tick
    # loop runs its B branch on M of its ticks).
    conditional: bool = False

    @property
    def traffic(self) -> float:
        """Bytes one device sends per execution under the ring model."""
        if self.kind in ("all-gather", "reduce-scatter", "all-reduce"):
            return ring_bytes(self.kind, self.nbytes, self.group_size)
        return float(self.nbytes)

    def describe(self) -> str:
        loop = f" x{self.count} (in a loop)" if self.loop_depth else ""
        return (f"{self.kind} over {'+'.join(self.axes) or '-'} ({self.group_size} devices): "
                f"{self.nbytes:,} B{loop}")


def array_bytes(type_text: str) -> list[int]:
    """Byte sizes of the arrays in an HLO type such as `(f32[8,16]{1,0}, s32[])`."""
    return [DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
            for d, dims in _ARRAY.findall(type_text)]


def _tensor_bytes(type_text: str) -> tuple[list[int], bool]:
    """Byte sizes of the non-scalar arrays of a type, or of its scalars when it has only
    those (then True): rank-0 values XLA combines into a bigger collective (a loss summed
    together with gradients) cost latency, not bandwidth, and are not counted in V."""
    arrays = _ARRAY.findall(type_text)
    tensors = [f"{d}[{dims}]" for d, dims in arrays if dims]
    if tensors:
        return array_bytes(",".join(tensors)), False
    return array_bytes(type_text), True


def _iota(n: int, dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(n).reshape([int(x) for x in dims.split(",")])
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _groups(line: str, n_devices: int) -> list[list[int]]:
    """Replica groups of a collective: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[2,2,2]T(0,2,1)`,
    mesh form `mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}`, empty (all
    devices), or a collective-permute's source-target pairs."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if m:
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in names]
        ids = (_iota(n_devices, m.group(2), m.group(3)) if m.group(2)
               else np.arange(n_devices)).reshape(sizes)
        over = [i for i, (a, _) in enumerate(names) if f"'{a}'" in m.group(4)]
        keep = [i for i in range(len(sizes)) if i not in over]
        return ids.transpose(keep + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                           m.group(1))]
        return groups or [list(range(n_devices))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        groups = int(m.group(1).split(",")[0])
        return _iota(n_devices, m.group(2), m.group(3)).reshape(groups, -1).tolist()
    return [list(range(n_devices))]


def _axes_of(groups: list[list[int]], axis_sizes: dict[str, int]) -> tuple[str, ...]:
    names, sizes = list(axis_sizes), list(axis_sizes.values())
    coords = np.array(np.unravel_index(np.asarray(groups[0]), sizes)).T  # [members, axes]
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry = ""
    current = None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith(" "):
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO text, by name. Ops in one
    computation are what XLA's scheduler may reorder and overlap with each other (ops in a
    loop body or a branch are scheduled with that body)."""
    return _computations(hlo)[0]


def _executions(comps: dict[str, list[str]],
                entry: str) -> dict[str, tuple[int, int, bool]]:
    """(executions per call, loop depth, inside a conditional's branch) of every computation
    reachable from the entry."""
    seen = {entry: (1, 0, False)}
    stack = [entry]
    while stack:
        name = stack.pop()
        count, depth, branch = seen[name]
        for line in comps.get(name, ()):
            trip = _TRIP.search(line)
            callees = [(k, c) for k, c in _CALLEE.findall(line)]
            for b in _BRANCHES.findall(line):
                callees += [("branch", c.strip().lstrip("%")) for c in b.split(",")]
            callees += [("branch", c) for c in _PREDICATED.findall(line)]
            for key, callee in callees:
                if callee in seen or callee not in comps:
                    continue
                if key == "body":
                    seen[callee] = (count * (int(trip.group(1)) if trip else 1), depth + 1,
                                    branch)
                else:
                    seen[callee] = (count, depth, branch or key == "branch")
                stack.append(callee)
    return seen


def collectives(hlo: str, axis_sizes) -> list[Collective]:
    """The collectives in optimized HLO text, with the mesh axes each group spans.

    `axis_sizes` is the mesh's ordered {axis: size} (`mesh.shape`)."""
    axis_sizes = dict(axis_sizes)
    n = math.prod(axis_sizes.values())
    comps, entry = _computations(hlo)
    runs = _executions(comps, entry)
    out = []
    for name, (count, depth, branch) in runs.items():
        for line in comps[name]:
            m = _OP.match(line)
            if not m or m.group(2) == "while":
                continue
            kind, (sizes, scalar) = m.group(2), _tensor_bytes(m.group(1))
            groups = _groups(line, n)
            size = len(groups[0]) if kind != "collective-permute" else 2
            if size == 1:  # a reduction over a size-1 axis moves nothing
                continue
            if m.group(3):  # async start: the tuple holds operand and result
                sizes = [max(sizes)]
            nbytes = sum(sizes) * (size if kind == "reduce-scatter" else 1)
            out.append(Collective(kind, _axes_of(groups, axis_sizes), size, nbytes, count,
                                  depth, scalar, branch))
    return out


def with_branch_runs(ops: list[Collective], trips: int, runs: int,
                     axes) -> list[Collective]:
    """`ops` with each collective over `axes` that sits in a conditional's branch inside a loop
    of `trips` iterations counted as running `runs` times per loop instead, for a caller that
    knows how often the branch is taken (the pipeline's B branch: once per micro-batch of its
    tick loop on every stage)."""
    return [replace(c, count=c.count // trips * runs)
            if c.conditional and c.loop_depth and set(c.axes) <= set(axes) else c for c in ops]


def _tuple_types(type_text: str) -> list[str]:
    return [f"{d}[{dims}]" for d, dims in _ARRAY.findall(type_text)]


def loop_carry(hlo: str, trip_count: int) -> list[tuple[str, int, bool]]:
    """(type, bytes per device, updated by each iteration) for every value carried by the
    while loops that run `trip_count` times; a value the body returns untouched (a loop
    invariant such as the parameters) has updated = False."""
    comps, _ = _computations(hlo)
    out = []
    for lines in comps.values():
        for line in lines:
            m = _OP.match(line)
            trip = _TRIP.search(line)
            if not (m and m.group(2) == "while" and trip and int(trip.group(1)) == trip_count):
                continue
            types = _tuple_types(m.group(1))
            body = comps[dict(_CALLEE.findall(line))["body"]]
            passed = {}  # instruction name -> tuple index it reads unchanged from the parameter
            root = []
            for b in body:
                gte = re.match(r"\s*%?([\w.\-]+) = .*get-tuple-element\(%?[\w.\-]+\), "
                               r"index=(\d+)", b)
                if gte:
                    passed[gte.group(1)] = int(gte.group(2))
                if b.lstrip().startswith("ROOT"):
                    root = re.findall(r"%([\w.\-]+)", b.split(" tuple(", 1)[-1])
            for i, t in enumerate(types):
                out.append((t, array_bytes(t)[0], passed.get(root[i] if i < len(root) else "")
                            != i))
    return out


def totals(ops: list[Collective], axes=None) -> dict[tuple[str, tuple[str, ...]], int]:
    """Bytes per step (V x count) for each (kind, axes) of the non-scalar ops, keeping only
    ops whose axes lie inside `axes` when given (e.g. the data-parallel axes)."""
    out: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    for c in ops:
        if not c.scalar and (axes is None or set(c.axes) <= set(axes)):
            out[(c.kind, c.axes)] += c.nbytes * c.count
    return dict(out)


__all__ = ["Collective", "KINDS", "ring_steps", "ring_bytes", "collectives", "with_branch_runs", "totals", "array_bytes",
           "loop_carry", "computations"]
