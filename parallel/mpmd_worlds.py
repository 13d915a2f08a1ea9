"""The MPMD executor across JAX worlds: this process's world runs its own stages, the bridge
carries what crosses to the other worlds.

A multi-world job runs one `jax.distributed` job per world (`hetjax.planner.worlds`); every
process of every world runs this executor with the same plan. A world builds `hetjax.parallel.mpmd`
`Stage`s (sub-mesh, shardings, compiled F / B / I / W / update programs) only for its own
stages, on its own devices, and interprets the same program (`hetjax.core.program`) as the
single-world executor, skipping other worlds' ops. Only send and receive change: when
the peer stage lives in another world, the activation of a forward, the gradient of a
backward's input, the tied embedding's gradient (summed in the same order as in one world),
the loss and each world's part of the squared gradient norm go over the bridge
(`hetjax.parallel.bridge`) instead of `jax.device_put`.

Stages on different groups of processes have the same mesh shape (dp, dp_os, dp_p, tp) (a plan
with per-stage shapes runs as one group), so an array of one stage and its counterpart on
another stage have, at every mesh *position*, the same shard: the process
holding a position on the receiving side pulls that shard from the process holding the same
position on the sending side (message part = leaf * positions + position). Receives are
prefetched a few tasks ahead (never blocking on a prefetch: a peer may need this world's next
send first), up to the bridge's in-flight bound.

Stages of one world may sit on different processes (`stage_groups`): a process runs the stages
of its *group* (the stages held by exactly its set of processes), and what crosses between
groups -- of another world or the same one -- goes over the bridge like traffic between worlds
(`jax.device_put` onto another process's devices is not available on this CPU build). When
every world is one group, groups and worlds coincide.

Evaluation runs the chunks' forwards in model order across the groups; checkpoints are
written by group 0 in the plan-independent layout one process writes (`WorldsLayout`: the
other groups send their stages' states over the bridge) and restored by every world from the
step group 0 chose (docs/worlds.md).

Deadlock freedom: each group issues its tasks in one global topological order and sends never
block, so the earliest unfinished task of the whole job can always run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hetjax.errors import HetjaxError, PlanError
from hetjax.core import program as pg
from hetjax.parallel.bridge import Bridge, message_key
from hetjax.parallel.mesh import AXES, DP_AXES, stage_mesh_shape
from hetjax.parallel.mpmd import MpmdExecutor, MpmdState, Stage, StepRun, merge_states, stage_tree
from hetjax.parallel.train_state import Executor, TrainState

LOOKAHEAD = 4  # tasks ahead whose remote inputs are prefetched


@dataclass(frozen=True)
class Group:
    """Stages that run on the same processes: group `index` (numbered by first stage) of
    world `world`. A world whose stages all sit on its every process is one group; stages of
    one world on different processes are different groups, and what crosses between them
    goes over the bridge too (one process cannot `jax.device_put` onto another's devices
    here)."""

    index: int
    world: int
    stages: tuple[int, ...]
    processes: tuple[int, ...]  # global process indices (bridge ranks)


def stage_groups(plan, worlds: Sequence, owner: dict[int, int]) -> list[Group]:
    """The worlds' stages grouped by the set of processes holding their devices; a stage
    whose processes overlap another's without being the same is a HetjaxError."""
    found: dict[tuple, list[int]] = {}
    for w in worlds:
        for s in w.stages:
            procs = tuple(sorted({owner[r] for r in plan.stage_ranks(s)}))
            found.setdefault((w.index, procs), []).append(s)
    keys = sorted(found, key=lambda k: found[k][0])
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if set(a[1]) & set(b[1]):
                raise HetjaxError(
                    f"stages {found[a]} run on processes {list(a[1])} and stages {found[b]} on "
                    f"processes {list(b[1])}: a process holds part of two stage groups; give "
                    "each process whole stages (change pipeline.stage_layers, parallel.dp/tp, "
                    "or the process count)")
    return [Group(i, k[0], tuple(found[k]), k[1]) for i, k in enumerate(keys)]


class WorldsExecutor(MpmdExecutor):
    """`MpmdExecutor` for the stages of world `world` of `worlds` (`World`s from
    `hetjax.planner.worlds.plan_worlds`); `owner[rank]` is the global process (= bridge rank)
    that runs topology rank `rank`; `devices` are the world's devices in rank order (default:
    every device of this process's jax.distributed job). The train state holds the local
    stages only."""

    def __init__(self, plan, topology, model_cfg, tx, lr_schedule, grad_clip: float,
                 worlds: Sequence, world: int, owner: dict[int, int], bridge: Bridge,
                 devices: Sequence | None = None):
        Executor.__init__(self, plan, topology, model_cfg, tx, lr_schedule)
        self._lower(grad_clip)
        self.worlds, self.world = list(worlds), worlds[world]
        self.owner, self.bridge = owner, bridge
        self.groups = stage_groups(plan, self.worlds, owner)
        if not plan.uniform and len(self.groups) > 1:
            # the bridge pulls each mesh position's shard from the same position of its peer
            raise PlanError(
                f"stages with different (dp, tp) shapes {list(plan.stage_shapes)} run on "
                f"{len(self.groups)} groups of processes, and what crosses between groups "
                "goes over the bridge, which needs one shape on both sides. Fix: give every "
                "stage the same parallel.stage_dp and parallel.stage_tp, or run the stages "
                "in one process (hetjax train, or fewer launch processes)")
        self.group = next(g for g in self.groups if bridge.rank in g.processes)
        self.group_of = {s: g.index for g in self.groups for s in g.stages}
        for w in self.worlds:  # a peer that never comes up is named with its world
            for i, p in enumerate(sorted({owner[r] for r in w.ranks})):
                bridge.peer_names[p] = f"world {w.index}, its process {i}"
        # each stage's ranks in its mesh's shape (dp / s_os, s_os / s_p, s_p, tp)
        self.grid = [plan.stage_mesh(s).reshape(stage_mesh_shape(plan, s))
                     for s in range(plan.pp)]
        if devices is None:  # this world's jax.distributed job: its devices in rank order
            devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        # the ranks its processes hold (also those the plan leaves out, which stay idle)
        procs = {owner[r] for r in self.world.ranks}
        held = sorted(r for r, p in owner.items() if p in procs)
        if len(devices) != len(held):
            raise HetjaxError(
                f"world {self.world.index} runs topology ranks {held[:4]}... "
                f"({len(held)} devices) but its jax.distributed job has "
                f"{len(devices)} devices; start each world with its own processes and devices")
        device_of = dict(zip(held, devices))
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.stages: list[Stage | None] = [None] * plan.pp
        self.position: dict[tuple[int, Any], int] = {}  # (stage, device) -> mesh position
        for s in self.group.stages:
            grid = np.vectorize(device_of.get, otypes=[object])(self.grid[s])
            mesh = Mesh(grid, AXES[1:], axis_types=(AxisType.Auto,) * (len(AXES) - 1))
            chunks = self.chunks_of(s)
            self.stages[s] = Stage(self, s, mesh, chunks, jax.eval_shape(
                lambda b, c=chunks: stage_tree(b, c, self.tied), boxed))
            for p, d in enumerate(grid.flat):
                self.position[s, d] = p
        self.local = list(self.group.stages)
        self.batch_sharding = {}
        if self.chunks[0].stage in self.local:
            self.batch_sharding["inputs"] = self.stages[self.chunks[0].stage].batch
        if self.chunks[-1].stage in self.local:
            self.batch_sharding["targets"] = self.stages[self.chunks[-1].stage].batch
        self.mesh = None  # no mesh spans every stage here
        b = plan.microbatch_size // plan.ep_replicas()
        self.activation = jax.ShapeDtypeStruct(
            (plan.ep_replicas(), b, plan.seq_len, model_cfg.d_model), jnp.dtype(model_cfg.dtype))
        self._calls = 0  # steps run: the message keys' step field
        self._evals = (0, 0)  # (step field, eval batches run at it): eval messages' keys
        self._route_cache: dict[tuple, list[list[int]]] = {}
        self._boxed = boxed
        # Group 0 (world 0) writes the checkpoints (the others send it their stages' states)
        # and tells the others which step to restore.
        self.writes_checkpoints = self.group.index == 0

    @classmethod
    def create(cls, plan, topology, model_cfg, optimizer, runtime):
        """This process's world of `runtime.worlds`, over `runtime.bridge`."""
        return cls(plan, topology, model_cfg, optimizer.tx, optimizer.lr_schedule,
                   optimizer.grad_clip, runtime.worlds, runtime.world, runtime.owner,
                   runtime.bridge)

    def describe(self) -> str:
        return (super().describe() + f"\nworld {self.world.index} of {len(self.worlds)}: "
                f"stages {list(self.local)} here; the bridge carries the rest")

    # --- state ----------------------------------------------------------------------------
    def init_state(self, seed: int) -> MpmdState:
        # On one local device, then through the host: every process of the world has it.
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        natural = jax.device_get(jax.jit(self._unboxed_init, out_shardings=one)(
            jax.random.key(seed)))
        return self.from_natural_params(natural)

    def _unboxed_init(self, key):
        import flax.linen as nn

        return nn.unbox(self._init_boxed(key))

    def params(self, state):
        raise HetjaxError("the natural parameters of a multi-world job are spread over its "
                          "worlds; read each world's stages from MpmdState.stages")

    def checkpoint_layout(self, state) -> "WorldsLayout":
        if len(self.groups) != len(self.worlds):
            raise HetjaxError(
                "checkpoints of a multi-world job whose world runs stages on different "
                "processes are not written yet; set --config.checkpoint.every=0, or give each "
                "world's processes all of its stages")
        return WorldsLayout(self)

    def eval_loss(self, state: MpmdState, batch: dict[str, np.ndarray]) -> float:
        """`MpmdExecutor.eval_loss` across the worlds: each world runs its chunks' forwards in
        model order (the activations cross over the bridge), the head's world sends every
        micro-batch's mean loss to the others, and every world sums them in the same order,
        so all return the one-world value."""
        m_count, stages, chunks = self.plan.microbatches, self.stages, self.chunks
        dev = self.put_batch(batch)
        pieces = {s: stages[s].run(stages[s].gather, st.params)
                  for s, st in zip(self.local, state.stages)}
        field, n = self._evals
        if field != self._calls:
            n = 0
        self._evals = (self._calls, n + 1)
        head_s, means = chunks[-1].stage, []
        for m in range(m_count):
            x, mb = None, n * m_count + m  # the message keys' micro-batch field
            for chunk in chunks:
                s = chunk.stage
                if s not in self.local:
                    continue
                st = stages[s]
                if not chunk.first:
                    prev = chunks[chunk.index - 1]
                    x = (self.move(x, prev.stage, s) if prev.stage in self.local else
                         self._recv(s, prev.stage, self.activation, st.activation, "eval",
                                    prev.index, mb))
                x = st.run(st.eval_forward, chunk.position, pieces[s][chunk.position], x,
                           dev.get("inputs"), dev.get("targets"), st.constants[2][m])
                if not chunk.last and chunks[chunk.index + 1].stage not in self.local:
                    self._send(x, s, chunks[chunk.index + 1].stage, st.activation, "eval",
                               chunk.index, mb)
            if head_s in self.local:  # x is the last chunk's: the per-device losses
                means.append(jnp.mean(x))
        first = stages[self.local[0]]
        shape = jax.ShapeDtypeStruct((m_count,), jnp.float32)
        if head_s in self.local:
            values = jax.device_put(jnp.stack(means), first.scalar)
            self._to_other_groups(values, "eval_loss", n)
        else:
            values = self._from_group(self.group_of[head_s], "eval_loss", shape, n)
        total = 0.0
        for v in np.asarray(values.addressable_shards[0].data):
            total += float(v)  # as MpmdExecutor.eval_loss adds them
        return total / m_count

    # --- checkpoints: world 0 writes the natural state of every stage -------------------------
    def _stage_layout(self, s: int) -> Stage:
        """Stage s's shardings: this world's own stage, or (for another world's stage) its
        specs on this world's first stage's devices -- where its state arrives (jit is lazy,
        so nothing compiles)."""
        if self.stages[s] is not None:
            return self.stages[s]
        home, chunks = self.stages[self.local[0]], self.chunks_of(s)
        return Stage(self, s, home.mesh, chunks, jax.eval_shape(
            lambda b: stage_tree(b, chunks, self.tied), self._boxed))

    def _abstract_stage_state(self, st: Stage) -> TrainState:
        return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=st.abstract,
                          opt_state=jax.eval_shape(self.tx.init, st.abstract))

    def gather_stage_states(self, state: MpmdState) -> list[TrainState] | None:
        """World 0: every stage's train state, in stage order (another world's sent over the
        bridge, one message per leaf, onto world 0's first stage's devices with its own
        specs). Other worlds: send their stages' states to world 0; None."""
        writer = self.groups[0]
        if self.group is not writer:
            for s, st in zip(self.local, state.stages):
                shardings = jax.tree.leaves(self.stages[s].state_sharding)
                for i, (leaf, sh) in enumerate(zip(jax.tree.leaves(st), shardings)):
                    self._send(leaf, s, writer.stages[0], sh, "state", s, i)
            return None
        home, out = self.local[0], dict(zip(self.local, state.stages))
        for s in range(self.plan.pp):
            if s in out:
                continue
            st = self._stage_layout(s)
            leaves, treedef = jax.tree.flatten(self._abstract_stage_state(st))
            shardings = jax.tree.leaves(st.state_sharding)
            out[s] = jax.tree.unflatten(treedef, [
                self._recv(home, s, leaf, sh, "state", s, i)
                for i, (leaf, sh) in enumerate(zip(leaves, shardings))])
        return [out[s] for s in range(self.plan.pp)]

    def agree_step(self, step: int | None) -> int | None:
        """World 0 tells every world the checkpoint step it restored (None: none); the
        others return it."""
        if self.group is self.groups[0]:
            self._to_other_groups(np.int32(-1 if step is None else step), "control")
            return step
        got = int(np.asarray(self._from_group(0, "control", jax.ShapeDtypeStruct(
            (), jnp.int32)).addressable_shards[0].data))
        return None if got < 0 else got

    @property
    def data_rows(self) -> np.ndarray:
        """The global batch rows this process's devices hold: of the inputs (first stage's
        group), or of the targets (last stage's group); a process holding neither reads row 0
        and does not use it (its loader's position keeps pace with the others')."""
        from hetjax.parallel.train_state import batch_rows

        if self._rows is None:
            shardings = list(self.batch_sharding.values())
            self._rows = batch_rows(self.plan, shardings[0]) if shardings else np.arange(1)
        return self._rows

    def put_batch(self, batch, rows=None):
        return super().put_batch({k: v for k, v in batch.items() if k in self.batch_sharding},
                                 rows)

    # --- moving arrays between worlds --------------------------------------------------------
    def _routes(self, s_local: int, s_to: int, shape, sharding) -> list[list[int]]:
        """For an array of `shape` laid out like `sharding` (on local stage s_local; every
        stage has the same mesh shape), the mesh positions of stage s_to grouped by receiving
        process and shard: each group's first position is pulled over the bridge once, and the
        rest of the group gets a local copy (so a shard replicated over tp crosses once per
        process)."""
        key = (s_local, s_to, tuple(shape), sharding.spec)
        if key not in self._route_cache:
            index = {self.position[s_local, d]: tuple((i.start, i.stop) for i in idx)
                     for d, idx in sharding.devices_indices_map(tuple(shape)).items()}
            groups: dict[tuple, list[int]] = {}
            for p in range(self.grid[s_to].size):
                receiver = self.owner[int(self.grid[s_to].flat[p])]
                groups.setdefault((receiver, index[p]), []).append(p)
            self._route_cache[key] = [sorted(ps) for ps in groups.values()]
        return self._route_cache[key]

    def _send(self, tree, s_from: int, s_to: int, shardings, kind: str, field: int,
              mb: int) -> None:
        """Offer the shards of `tree` (resharded to `shardings` on stage s_from) that stage
        s_to's processes will pull from this process."""
        leaves = jax.tree.leaves(jax.device_put(tree, shardings))
        devices, n, me = self.stages[s_from].mesh.devices.flat, self.grid[s_from].size, \
            self.bridge.rank
        for i, leaf in enumerate(leaves):
            shards = {sh.device: sh.data for sh in leaf.addressable_shards}
            for ps in self._routes(s_from, s_to, leaf.shape, leaf.sharding):
                if self.owner[int(self.grid[s_from].flat[ps[0]])] == me:
                    self.bridge.send(message_key(self._calls, field, mb, kind, i * n + ps[0]),
                                     [shards[devices[ps[0]]]])

    def _pulls(self, s_to: int, s_from: int, abstract, shardings, kind: str, field: int,
               mb: int):
        """(peer, key, spec, leaf, positions) of every shard this process's devices of stage
        s_to need: pulled onto the first position's device, copied to the others."""
        out = []
        n, me = self.grid[s_to].size, self.bridge.rank
        devices = self.stages[s_to].mesh.devices.flat
        leaves = jax.tree.leaves(abstract)
        for i, (leaf, sharding) in enumerate(zip(leaves, jax.tree.leaves(shardings))):
            shard_shape = sharding.shard_shape(leaf.shape)
            for ps in self._routes(s_to, s_to, leaf.shape, sharding):
                if self.owner[int(self.grid[s_to].flat[ps[0]])] != me:
                    continue
                peer = self.owner[int(self.grid[s_from].flat[ps[0]])]
                spec = jax.ShapeDtypeStruct(shard_shape, leaf.dtype, sharding=(
                    jax.sharding.SingleDeviceSharding(devices[ps[0]])))
                out.append((peer, message_key(self._calls, field, mb, kind, i * n + ps[0]),
                            spec, i, ps))
        return out

    def _prefetch(self, pulls) -> None:
        for peer, key, spec, _, _ in pulls:
            if self.bridge.in_flight >= self.bridge.max_in_flight:
                return  # never block on a prefetch (see the module docstring)
            self.bridge.prefetch(peer, key, [spec])

    def _recv(self, s_to: int, s_from: int, abstract, shardings, kind: str, field: int,
              mb: int):
        devices = self.stages[s_to].mesh.devices.flat
        arrays: dict[int, list] = {}
        for peer, key, spec, i, ps in self._pulls(s_to, s_from, abstract, shardings, kind,
                                                  field, mb):
            (x,) = self.bridge.recv(peer, key, [spec])
            arrays.setdefault(i, []).append(x)
            arrays[i] += [jax.device_put(x, devices[q]) for q in ps[1:]]
        leaves, treedef = jax.tree.flatten(abstract)
        sh = jax.tree.leaves(shardings)
        return jax.tree.unflatten(treedef, [
            jax.make_array_from_single_device_arrays(leaf.shape, sh[i], arrays[i])
            for i, leaf in enumerate(leaves)])

    # --- the step ---------------------------------------------------------------------------
    def loss_and_grads(self, state, batch):
        loss, grads, _ = self.stage_loss_and_grads(state, batch)
        return loss, grads

    def stage_loss_and_grads(self, state: MpmdState, batch, task_times=None):
        """`MpmdExecutor.stage_loss_and_grads` for this world's stages: the mean loss, the
        local stages' gradients (in `self.local` order) and the global gradient norm."""
        stages, chunks, local = self.stages, self.chunks, self.local
        mine = dict(zip(local, state.stages))
        head_s, embed_s = chunks[-1].stage, chunks[0].stage
        finished = self.run_tasks(mine, batch, task_times)
        grads = {s: finished[s][0] for s in local}
        first = stages[local[0]]
        # What other groups wait for leaves first, so that no group waits for the end of a
        # later one's step: the loss, the head's half of the tied embedding's gradient and
        # the head's norm part (which leaves the embedding out: the embedding's stage counts
        # the sum). The head's stage then waits for the embedding's half while the first
        # stage already starts the next step (the head idles then anyway, waiting for its
        # first activation).
        if head_s in mine:
            loss = jax.device_put(finished[head_s][1], first.scalar)
            self._to_other_groups(loss, "loss")
        # this group holds one of the tied embedding's two stages, the other group the other
        remote_tie = self.tied and (head_s in mine) != (embed_s in mine)
        if remote_tie:
            self._offer_embedding(grads, head_s, embed_s)
        if self.tied and head_s != embed_s and embed_s in mine:
            grads = self._sum_embedding(grads, head_s, embed_s)
        sq = sum(jax.device_put(stages[s].run(stages[s].squared_norm, grads[s]), first.scalar)
                 for s in local)
        parts = self._all_groups(sq, "norm")
        g_norm = jnp.sqrt(sum(parts))
        if remote_tie and head_s in mine:
            grads = self._sum_embedding(grads, head_s, embed_s)
        if head_s not in mine:
            loss = self._from_group(self.group_of[head_s], "loss")
        self._calls += 1
        return loss, [grads[s] for s in local], g_norm

    def send(self, step: StepRun, op: pg.Send) -> None:
        """Within this group as in one world; to another group over the bridge (the message
        is keyed by the sender's model chunk)."""
        self._prefetch_ahead(step)
        if op.peer in self.local:
            return super().send(step, op)
        b = op.buffer
        self._send(step.buffers[op.stage, b], op.stage, op.peer,
                   self.stages[op.stage].activation, b.kind, b.source, b.microbatch)

    def recv(self, step: StepRun, op: pg.Recv) -> None:
        """Within this group as in one world; from another group pulled over the bridge."""
        self._prefetch_ahead(step)
        if op.peer in self.local:
            return super().recv(step, op)
        step.buffers[op.stage, op.buffer] = self._recv(op.stage, op.peer,
                                                       *self._boundary(op))

    def _boundary(self, op: pg.Recv) -> tuple:
        """The `_recv` / `_pulls` arguments after the peer stage, for a received buffer."""
        b = op.buffer
        return (self.activation, self.stages[op.stage].activation, b.kind, b.source,
                b.microbatch)

    def _prefetch_ahead(self, step: StepRun) -> None:
        """Start the bridge pulls of the remote receives of about the next LOOKAHEAD tasks
        (those before the (LOOKAHEAD + 1)-th run after this op). Sends and receives call it,
        so nearly every task of a pipeline does; a prefetch never blocks."""
        runs = 0
        for i in range(step.position + 1, len(step.ops)):
            op = step.ops[i]
            if isinstance(op, pg.Run):
                runs += 1
                if runs > LOOKAHEAD:
                    return
            elif isinstance(op, pg.Recv) and op.peer not in self.local:
                self._prefetch(self._pulls(op.stage, op.peer, *self._boundary(op)))

    def _embedding_transfer(self, s: int, like):
        """How a tied embedding's gradient crosses between stage groups: each leaf split over
        the stage's data-parallel devices where its rows divide (every replica pulls 1 / dp of
        it; the receiving world gathers the rest on its own link), else as the optimizer
        state holds it."""
        st = self.stages[s]
        dp = self.plan.dp
        rows = NamedSharding(st.mesh, P(DP_AXES))
        return jax.tree.map(lambda sh, leaf: rows if leaf.ndim and leaf.shape[0] % dp == 0
                            else sh, st.os_sharding["embedder"], like)

    def _offer_embedding(self, grads, head_s: int, embed_s: int) -> None:
        """Send this group's half of the tied embedding's gradient to the other's stage."""
        s = embed_s if embed_s in grads else head_s
        other = head_s if s == embed_s else embed_s
        g = grads[s]["embedder"]
        self._send(g, s, other, self._embedding_transfer(s, g), "embedding_gradient", s, 0)

    def _sum_embedding(self, grads, head_s: int, embed_s: int):
        """The tied embedding's two gradients summed, a + b (embed's + head's) on this
        group's stages, as `MpmdExecutor` does, whichever worlds the two stages live in (the
        other's half pulled over the bridge; `_offer_embedding` sent ours)."""
        stages, out = self.stages, dict(grads)
        here = [s for s in (embed_s, head_s) if s in grads]
        if len(here) == 2:  # one world: as in MpmdExecutor
            a, b = grads[embed_s]["embedder"], grads[head_s]["embedder"]
            e, h = stages[embed_s], stages[head_s]
            out[embed_s] = {**grads[embed_s], "embedder": e.run(
                e.add, a, jax.device_put(b, e.os_sharding["embedder"]))}
            out[head_s] = {**grads[head_s], "embedder": h.run(
                h.add, jax.device_put(a, h.os_sharding["embedder"]), b)}
            return out
        if not here:
            return out
        (s,) = here
        other = head_s if s == embed_s else embed_s
        st = stages[s]
        mine_g = grads[s]["embedder"]
        theirs = self._recv(s, other, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mine_g),
            self._embedding_transfer(s, mine_g), "embedding_gradient", other, 0)
        theirs = jax.device_put(theirs, st.os_sharding["embedder"])  # gathered in this world
        a, b = (mine_g, theirs) if s == embed_s else (theirs, mine_g)
        out[s] = {**grads[s], "embedder": st.run(st.add, a, b)}
        return out

    # --- scalars between stage groups -------------------------------------------------------
    def _to_other_groups(self, x, kind: str, n: int = 0) -> None:
        """Send the replicated array `x` to every other stage group (message `n` of this kind
        at this step)."""
        st, k = self.stages[self.local[0]], len(self.groups)
        for g in self.groups:
            if g is not self.group:
                self._send(x, st.index, g.stages[0], st.scalar, kind, self.group.index,
                           n * k + g.index)

    def _from_group(self, g: int, kind: str, abstract=None, n: int = 0):
        st = self.stages[self.local[0]]
        abstract = jax.ShapeDtypeStruct((), jnp.float32) if abstract is None else abstract
        return self._recv(st.index, self.groups[g].stages[0], abstract, st.scalar, kind, g,
                          n * len(self.groups) + self.group.index)

    def _all_groups(self, x, kind: str) -> list:
        """Every group's value of the scalar `x`, in group (= stage) order, on this group's
        first stage."""
        self._to_other_groups(x, kind)
        return [x if g is self.group else self._from_group(g.index, kind) for g in self.groups]

    def finish(self) -> None:
        """Wait until every peer process has pulled this process's last messages."""
        peers = sorted({p for g in self.groups if g is not self.group for p in g.processes})
        self.bridge.barrier(peers)


class WorldsLayout:
    """`hetjax.checkpoint.Layout` of a multi-world job: the natural TrainState one process
    would write (`hetjax.parallel.mpmd.MpmdLayout`), assembled in world 0, which writes it; the
    other worlds only send their stages' states (`writes` False). Every world restores the
    step world 0 chose (`agree_step`) from the directory itself, replicated on its first
    stage's devices, and keeps its own stages."""

    def __init__(self, ex: WorldsExecutor):
        self.ex = ex
        self.writes = ex.writes_checkpoints
        home = ex.stages[ex.local[0]]
        self.sharding = NamedSharding(home.mesh, P())
        chunks_of = [ex.chunks_of(s) for s in range(ex.plan.pp)]
        sharding = self.sharding

        def merge(states: list[TrainState]) -> TrainState:
            return merge_states(states, chunks_of)

        self._merge = jax.jit(merge, out_shardings=sharding)
        abstract = [ex._abstract_stage_state(ex._stage_layout(s)) for s in range(ex.plan.pp)]
        self.target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(merge, abstract))

    def to_natural(self, state: MpmdState) -> TrainState | None:
        states = self.ex.gather_stage_states(state)
        if states is None:
            return None
        return self._merge([jax.device_put(t, self.sharding) for t in states])

    def natural_target(self):
        return self.target

    def from_natural(self, natural: TrainState) -> MpmdState:
        return self.ex.from_natural_state(natural)

    def agree_step(self, step: int | None) -> int | None:
        return self.ex.agree_step(step)


__all__ = ["WorldsExecutor", "WorldsLayout"]
