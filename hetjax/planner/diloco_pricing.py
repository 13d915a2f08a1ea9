"""DiLoCo pricing: what synchronous data parallelism across sites costs per step against
DiLoCo's local SGD (each site trains `H` inner steps alone, then the sites exchange
pseudo-gradients once), in step time and in bytes crossing the inter-site links.

Sites are topology clusters, or groups of them (`diloco.sites`, e.g. ("ohio+virginia",
"tokyo")). Inside a site the step follows the site's own plan (the planner's, on the site's
sub-topology with the global batch split evenly over the sites). Between sites:

- synchronous DP: every step, one all-reduce of the fp32 gradient (4 bytes a parameter);
- DiLoCo: every H steps, the pseudo-gradients; without a codec an fp32 all-reduce, with
  int8 / int4 a reduce-scatter and an all-gather of quantized shards (1 or 1/2 byte a
  parameter plus one fp32 scale per row of d_model values): each site's pseudo-gradient is
  quantized once, each shard's owner averages the dequantized shards and quantizes the mean
  once more for the all-gather (two rounding steps; the runner does the same). Blocking,
  the exchange adds t_sync / H to a step; streamed (fragments synced while the next inner
  steps run) a step costs at best max(t_inner, t_sync / H) (the "streamed" row, a bound).
- what the runner does with F fragments (`diloco.fragments`) and tau overlap steps
  (`diloco.overlap_steps`), the "F= overlap" row: F exchanges a round of 1/F of the payload
  each; with tau = 0 each is a blocking all-reduce as above; with tau > 0 each is the
  runner's all-gather of the encoded fragments over the bridge (every site sends its wire to
  the n - 1 others at once, one flow to each: one wire's time on the slowest pair link, not
  a ring's n - 1 hops) hidden behind tau inner steps, so a step costs
  t_inner + F max(0, t_fragment - tau t_inner) / H.

Both exchanges use the slowest link between two sites (a ring pays its slowest hop) with
`ring_time`; a site with k nodes splits the exchange over its k nodes' flows (the cost model's
links are per flow, as DT-FM's measured pair bandwidths are). Pure Python: no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetjax.errors import ConfigError
from hetjax.core.hardware import Link, Topology
from hetjax.core.plan import DilocoPlan, Plan
from hetjax.planner.network import ring_time
from hetjax.core.hlo import ring_bytes
from hetjax.core.wire import BITS, DILOCO_CODECS as CODECS

SCALE_BYTES = 4  # one float32 scale per quantized row
SLOW_LINK_GBPS = 10.0  # `hetjax plan` prices DiLoCo when sites are joined by slower links


def site_clusters(topology: Topology, sites=()) -> list[tuple[str, tuple[int, ...]]]:
    """(site name, cluster indices) per site: every cluster its own site when `sites` is
    empty, else one site per entry, clusters joined by '+' ("ohio+virginia")."""
    names = [c.name for c in topology.clusters]
    if not sites:
        return [(n, (i,)) for i, n in enumerate(names)]
    out, seen = [], set()
    for entry in sites:
        idx = []
        for name in str(entry).split("+"):
            name = name.strip()
            if name not in names:
                raise ConfigError("diloco.sites", f"{name!r} is not a cluster of topology "
                                  f"{topology.name!r}", f"use cluster names from: "
                                  f"{', '.join(names)} (join clusters of one site with '+')")
            if name in seen:
                raise ConfigError("diloco.sites", f"cluster {name!r} is in two sites",
                                  "put every cluster in exactly one site")
            seen.add(name)
            idx.append(names.index(name))
        out.append(("+".join(names[i] for i in idx), tuple(idx)))
    missing = [n for n in names if n not in seen]
    if missing:
        raise ConfigError("diloco.sites", f"clusters {missing} are in no site",
                          "list every cluster of the topology in one site")
    return out


def site_topology(topology: Topology, clusters: tuple[int, ...]) -> Topology:
    """The sub-topology of one site: its clusters and the links among them."""
    keep = [topology.clusters[i] for i in clusters]
    names = {c.name for c in keep}
    return Topology(name=f"{topology.name}/{'+'.join(c.name for c in keep)}",
                    clusters=tuple(keep), inter_cluster=topology.inter_cluster,
                    cluster_links=tuple(cl for cl in topology.cluster_links
                                        if cl.a in names and cl.b in names))


def site_first_ranks(topology: Topology, sites) -> list[list[int]]:
    """The topology ranks of each site's devices, in site order."""
    return [[r for i in clusters for r in topology.cluster_ranks(i)] for _, clusters in sites]


def slowest_site_link(topology: Topology, sites) -> Link:
    """The slowest link joining two different sites (what a ring across sites pays)."""
    links = [topology.cluster_link(a, b)
             for i, (_, ca) in enumerate(sites) for _, cb in sites[i + 1:]
             for a in ca for b in cb]
    if not links:
        raise ConfigError("diloco.sites", "there is only one site", "DiLoCo needs two sites "
                          "or more: use a topology with several clusters, or diloco.sites")
    return min(links, key=lambda lk: (lk.bandwidth_gbps, -lk.latency_us))


def payload_bytes(num_params: int, codec: str, row: int) -> float:
    """Bytes of one site's pseudo-gradient under `codec` (rows of `row` values share a scale)."""
    if codec not in CODECS:
        raise ConfigError("diloco.codec", f"unknown codec {codec!r}",
                          f"choose one of {', '.join(CODECS)}")
    if codec == "none":
        return 4.0 * num_params
    return num_params * BITS[codec] / 8 + SCALE_BYTES * num_params / row


@dataclass(frozen=True)
class Exchange:
    """One way of joining the sites: seconds per step and bytes one site sends across the
    inter-site links per step (averaged over a round for DiLoCo)."""

    name: str
    step_time_s: float
    bytes_per_step: float
    tokens_per_s: float
    sync_time_s: float  # one exchange


@dataclass(frozen=True)
class DilocoPricing:
    sites: tuple[str, ...]
    site_step_s: tuple[float, ...]  # each site's inner step under its own plan
    link: Link
    rows: tuple[Exchange, ...]

    def table(self) -> str:
        lk = self.link
        if len(self.sites) <= 4:
            inner = ", ".join(f"{s} {_time(t)}" for s, t in zip(self.sites, self.site_step_s))
        else:
            inner = (f"{len(self.sites)} sites, {_time(min(self.site_step_s))} to "
                     f"{_time(max(self.site_step_s))}")
        w = max(len(r.name) for r in self.rows)
        lines = [f"inner step on each site's own plan: {inner}",
                 f"slowest link between sites: {lk.bandwidth_gbps:g} Gb/s, "
                 f"{lk.latency_us / 1e3:g} ms",
                 f"{'':<{w}}  {'step':>9}  {'tokens/s':>11}  {'bytes/step/site':>15}  "
                 f"{'one exchange':>12}"]
        for r in self.rows:
            known = r.bytes_per_step == r.bytes_per_step  # not NaN (the planner's own layout)
            lines.append(f"{r.name:<{w}}  {_time(r.step_time_s):>9}  {r.tokens_per_s:>11,.0f}  "
                         f"{_size(r.bytes_per_step) if known else '-':>15}  "
                         f"{_time(r.sync_time_s) if known else '-':>12}")
        return "\n".join(lines)


def _time(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _size(n: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} B"


def price(topology: Topology, sites, site_step_s, num_params: int, row: int,
          tokens_per_step: int, inner_steps: int, codec: str,
          whole_plan_step_s: float | None = None, fragments: int = 1,
          overlap_steps: int = 0) -> DilocoPricing:
    """Price synchronous DP across `sites` against DiLoCo (H = inner_steps, `codec`), given
    each site's predicted inner step time. `whole_plan_step_s`: the planner's synchronous plan
    over the whole topology, shown for reference (its bytes depend on its layout).
    `fragments` F > 1 or `overlap_steps` tau > 0 add the row of what the runner does with
    them (see the module docstring)."""
    if inner_steps < 1:
        raise ConfigError("diloco.inner_steps", f"must be >= 1 to price DiLoCo, got "
                          f"{inner_steps}", "set --config.diloco.inner_steps=50")
    n = len(sites)
    link = slowest_site_link(topology, sites)
    flows = min(sum(topology.clusters[i].nodes for i in c) for _, c in sites)
    t_inner = max(site_step_s)

    def allreduce(nbytes):
        return ring_time("all_reduce", nbytes / flows, n, link)

    grad = 4.0 * num_params
    ar_bytes = ring_bytes("all_reduce", grad, n)  # what a ring all-reduce sends from each site
    rows = []
    if whole_plan_step_s is not None:
        rows.append(Exchange("synchronous, planner's layout", whole_plan_step_s, float("nan"),
                             tokens_per_step / whole_plan_step_s, float("nan")))
    t_sync = allreduce(grad)
    rows.append(Exchange("synchronous DP across sites", t_inner + t_sync, ar_bytes,
                         tokens_per_step / (t_inner + t_sync), t_sync))
    h = inner_steps
    for c in dict.fromkeys(("none", codec)):
        q = payload_bytes(num_params, c, row)
        t, sent = allreduce(q), ring_bytes("all_reduce", q, n)
        label = f"DiLoCo H={h}" + ("" if c == "none" else f" {c}")
        rows.append(Exchange(label, t_inner + t / h, sent / h, tokens_per_step / (t_inner + t / h),
                             t))
        streamed = max(t_inner, t / h)
        rows.append(Exchange(label + " streamed", streamed, sent / h, tokens_per_step / streamed,
                             t))
        if fragments > 1 or overlap_steps:
            rows.append(_fragmented(label, q, n, flows, link, t_inner, h, fragments,
                                    overlap_steps, tokens_per_step))
    return DilocoPricing(tuple(s for s, _ in sites), tuple(site_step_s), link, tuple(rows))


def _fragmented(label: str, q: float, n: int, flows: int, link: Link, t_inner: float, h: int,
                fragments: int, tau: int, tokens_per_step: int) -> Exchange:
    """F exchanges a round of q / F each; tau > 0: an all-gather over the bridge (each site
    sends its wire to the n - 1 others) of which only what outlasts tau inner steps shows."""
    part = q / fragments
    if tau:
        # (n - 1) wires a site, sent and pulled concurrently (OverlapTransport), each on its
        # own pair link (links are per flow): the slowest pair's one wire
        one = link.latency_s + part / flows / link.bytes_per_s
        exposed, sent = max(0.0, one - tau * t_inner), (n - 1) * q
    else:
        one = ring_time("all_reduce", part / flows, n, link)
        exposed, sent = one, ring_bytes("all_reduce", q, n)
    step = t_inner + fragments * exposed / h
    return Exchange(f"{label} F={fragments} overlap {tau}", step, sent / h,
                    tokens_per_step / step, one)


def site_config(c, n_sites: int):
    """The config a site plans with: the global batch split evenly over the sites, pp = 1 (a
    site trains alone inside its own clusters; a pipeline across clusters is what DiLoCo
    replaces, so the job's parallel.pp applies to synchronous training only), dp left to the
    site, tp as configured (0: the planner's)."""
    sc = c.copy_and_resolve_references()
    if c.train.batch_size % n_sites:
        raise ConfigError("train.batch_size", f"{c.train.batch_size} sequences do not split "
                          f"evenly over {n_sites} DiLoCo sites",
                          f"make train.batch_size a multiple of {n_sites}")
    sc.train.batch_size = c.train.batch_size // n_sites
    sc.parallel.pp = 1
    sc.pipeline.stage_layers = ()
    sc.parallel.dp = 0
    # a site's own layout: one stage, on its sub-topology's devices (validation refuses
    # per-stage degrees and devices left out under DiLoCo)
    sc.parallel.stage_dp = sc.parallel.stage_tp = sc.parallel.exclude = ()
    return sc


def plan_sites(c, topology: Topology) -> DilocoPlan:
    """The DiLoCo plan of config `c` on `topology`: its sites and each site's plan (the
    planner's, for the site's sub-topology and `site_config`)."""
    from hetjax.planner.config_plan import plan_from_config

    d = c.diloco
    sites = site_clusters(topology, tuple(d.sites))
    if len(sites) < 2:
        raise ConfigError("diloco.sites", f"topology {topology.name!r} gives one site",
                          "use a topology with two clusters or more, or diloco.inner_steps=0")
    sc = site_config(c, len(sites))
    subs = tuple(site_topology(topology, clusters) for _, clusters in sites)
    return DilocoPlan(
        sites=tuple(sites), site_topologies=subs,
        site_plans=tuple(plan_from_config(sc, sub) for sub in subs),
        site_ranks=tuple(tuple(r) for r in site_first_ranks(topology, sites)),
        rows_per_site=sc.train.batch_size, inner_steps=d.inner_steps, codec=d.codec,
        fragments=d.fragments, overlap_steps=d.overlap_steps, mix=float(d.mix),
        outer_optimizer=d.outer_optimizer, outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum, inner_optimizer=d.inner_optimizer,
        inner_lr_scale=float(d.inner_lr_scale), log_every=c.train.log_every,
        steps=c.train.steps)


def plan_to_run(c, topology: Topology, plan: Plan) -> Plan | DilocoPlan:
    """What the executor of config `c` runs (`hetjax.parallel.executor.make_executor` chooses it
    from this): `plan` (the planner's for the whole topology), or with `diloco.inner_steps`
    > 0 the DiLoCo plan of the sites (`plan_sites`)."""
    return plan_sites(c, topology) if c.diloco.inner_steps else plan


def price_config(c, topology: Topology, whole_plan=None) -> DilocoPricing:
    """`price` for a hetjax config: site plans from the planner, the model's size."""
    from hetjax.planner import model_from_config, predict
    from hetjax.planner.config_plan import options_from_config, plan_from_config

    sites = site_clusters(topology, tuple(c.diloco.sites))
    sc = site_config(c, len(sites))
    model = model_from_config(c, topology=topology)
    steps = []
    for _, clusters in sites:
        sub = site_topology(topology, clusters)
        p = plan_from_config(sc, sub)
        if "step_time_s" not in p.predicted:
            p = dataclasses.replace(p, predicted=predict(p, sub, model,
                                                         options_from_config(sc)).as_dict())
        steps.append(p.predicted["step_time_s"])
    whole = whole_plan.predicted.get("step_time_s") if whole_plan is not None else None
    return price(topology, sites, steps, model.num_params, c.model.d_model,
                 c.train.batch_size * c.train.seq_len, c.diloco.inner_steps or 50,
                 c.diloco.codec, whole, c.diloco.fragments, c.diloco.overlap_steps)


def sites_are_slow(topology: Topology) -> bool:
    """Whether some clusters are joined by links slower than SLOW_LINK_GBPS (DiLoCo's case)."""
    n = len(topology.clusters)
    return any(lk is not None and lk.bandwidth_gbps < SLOW_LINK_GBPS
               for a in range(n) for b in range(a + 1, n)
               for lk in [topology._cluster_link_or_none(a, b)])


def plan_lines(c, topology: Topology, whole_plan) -> list[str]:
    """What `hetjax plan` adds: the DiLoCo comparison, when DiLoCo is on or sites are joined
    by slow links (a config whose sites cannot be planned gets one line saying why)."""
    from hetjax.errors import HetjaxError

    if not c.diloco.inner_steps and not sites_are_slow(topology):
        return []
    try:
        pricing = price_config(c, topology, whole_plan)
    except HetjaxError as e:
        return [f"DiLoCo across sites: not priced ({e})"]
    on = "on" if c.diloco.inner_steps else "off; diloco.inner_steps=H turns it on"
    return [f"DiLoCo across sites (diloco.* {on}; predicted, per step):",
            *("  " + line for line in pricing.table().splitlines())]


__all__ = ["plan_lines", "CODECS", "DilocoPlan", "DilocoPricing", "Exchange", "payload_bytes",
           "plan_sites", "plan_to_run", "price", "price_config",
           "site_clusters", "site_config", "site_topology", "site_first_ranks",
           "slowest_site_link", "sites_are_slow"]
