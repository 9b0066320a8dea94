"""What a collective costs: the bytes each rank sends, and the seconds that takes on a link.

The one price of a collective. The partitioner (`partition/planning/redistribute.py`), `nf.plan`'s
closed forms (`planner/estimate.py`) and the replay (`replay/timeline.py`) all read it, on the links
a `Machine` gives the mesh's axes: a planner `Cluster`'s where one is given (NVLink within a node,
the fabric where a group spans nodes), this machine's (`HOST`) otherwise.

Over `n` ranks, about a value of `size` bytes (the gathered whole; the reduced, scattered or
exchanged input; a permute's block), on a ring (Thakur, Rabenseifner and Gropp 2005, "Optimization
of Collective Communication Operations in MPICH"):

| kind | bytes a rank sends | latency steps |
| --- | --- | --- |
| `all_gather`, `reduce_scatter`, `all_to_all` | (n - 1) / n x size | n - 1 |
| `all_reduce` (a reduce-scatter, then an all-gather) | 2 (n - 1) / n x size | 2 (n - 1) |
| `permute` / `ppermute` (a block to one peer; a ring of k such hops) | size (k x size) | 1 (k) |

and takes `link.overhead + steps x link.latency + sent / link.bandwidth` seconds. Over one rank
every collective is the identity: nothing is sent, and it takes no time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ndfunc._src.planner.cluster import Cluster

PERMUTES = ("permute", "ppermute")  # the partitioner's step, and the program's collective


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of the network, per rank: `bandwidth` bytes/s each way, `latency` s per ring step,
    and `overhead` s once per collective, whatever its group (0 for a cluster's links).

    Example:
        >>> link = Link(bandwidth=100e9, latency=1e-6)
        >>> round(link.all_gather(4, 400e6), 6)   # 3 steps of 1 us + 300 MB at 100 GB/s
        0.003003
        >>> link.all_reduce(4, 400e6) == 2 * link.all_gather(4, 400e6), link.all_gather(1, 400e6)
        (True, 0.0)
    """

    bandwidth: float
    latency: float
    overhead: float = 0.0

    def all_gather(self, n: int, size: float) -> float:
        """Seconds to all-gather a `size`-byte result (each rank contributes `size / n`)."""
        return seconds("all_gather", n, size, self)

    def reduce_scatter(self, n: int, size: float) -> float:
        """Seconds to reduce-scatter a `size`-byte input; the ring mirrors the all-gather."""
        return seconds("reduce_scatter", n, size, self)

    def all_reduce(self, n: int, size: float) -> float:
        """Seconds to all-reduce `size` bytes: reduce-scatter, then all-gather."""
        return seconds("all_reduce", n, size, self)

    def send(self, size: float) -> float:
        """Seconds for one point-to-point hop of `size` bytes (a ring-attention step)."""
        return seconds("permute", 2, size, self)


def fraction(kind: str, n: int) -> float:
    """Bytes a rank sends per byte of the value, for a collective of `kind` over `n` ranks."""
    if n <= 1:
        return 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in PERMUTES:
        return 1.0
    raise ValueError(f"collective_cost: no price for a collective of kind {kind!r}; expected one of all_gather, "
                     f"reduce_scatter, all_to_all, all_reduce, {', '.join(PERMUTES)}.")


def sent_bytes(kind: str, n: int, size: float) -> float:
    """Bytes each rank sends for a collective of `kind` over `n` ranks about `size` bytes."""
    return fraction(kind, n) * size


def steps(kind: str, n: int, size: float = 0.0, sent: float | None = None) -> int:
    """The latency steps of a collective (module text); a permute that sends `sent` bytes over
    `size`-byte hops takes one a hop (a ring attention's, round the ring)."""
    if n <= 1:
        return 0
    if kind in PERMUTES:
        return max(1, round(sent / size)) if sent is not None and size else 1
    return (2 if kind == "all_reduce" else 1) * (n - 1)


def seconds(kind: str, n: int, size: float, link: Link, sent: float | None = None) -> float:
    """Seconds a collective of `kind` over `n` ranks about `size` bytes takes on `link`. `sent`:
    what each rank sends, where the program records it (a bucket of collectives, a ring's hops);
    `sent_bytes` otherwise."""
    if n <= 1:
        return 0.0
    if sent is None:
        sent = sent_bytes(kind, n, size)
    return link.overhead + steps(kind, n, size, sent) * link.latency + sent / link.bandwidth


# This machine's defaults, what the partitioner prices a plan on when it is given no cluster: a
# collective's fixed cost is worth 4,096 bytes sent (between plans moving about as much, fewer
# calls), once per collective whatever its group (ndfunc runs gloo's collectives as all-to-alls,
# one exchange each), and a byte sent is worth 100 flops (CPU-like; GPUs compute more per byte).
# Only these ratios choose a plan; the bandwidth, a power of two, keeps the partitioner's sums of
# bytes exact.
HOST = Link(bandwidth=2.0 ** 33, latency=0.0, overhead=4096 / 2.0 ** 33)
HOST_FLOPS = 100 * HOST.bandwidth


@dataclasses.dataclass(frozen=True)
class Machine:
    """The link each mesh axis crosses and what a rank computes: what a step is priced on.

    `links`: per mesh axis, `(axis, level, Link)`; an axis not listed crosses `HOST` (level
    'host'). `flops`: a rank's flop/s. Build one with `machine(sizes, cluster)`.

    Example:
        >>> m = machine({"dp": 2, "tp": 8}, None)
        >>> m.link(("tp",)) == ("host", HOST), m.cost("all_gather", ("tp",), 8)
        (True, (0.875, 4096.0))
    """

    links: tuple[tuple[str, str, Link], ...]
    flops: float

    @property
    def unit(self) -> float:
        """The bandwidth of the partitioner's unit (`cost`): the fastest link's."""
        return max((link.bandwidth for _, _, link in self.links), default=HOST.bandwidth)

    def link(self, axes: Sequence[str]) -> tuple[str, Link]:
        """`(level, Link)` a group over `axes` crosses: the slowest of theirs (a ring runs at the
        pace of its slowest hop; a group spans nodes where its outermost axis does)."""
        known = {axis: (level, link) for axis, level, link in self.links}
        found = [known.get(axis, ("host", HOST)) for axis in axes] or [("host", HOST)]
        return min(found, key=lambda level_link: level_link[1].bandwidth)

    def cost(self, kind: str, axes: Sequence[str], n: int) -> tuple[float, float]:
        """A collective's `seconds` times `unit`, as `(per byte of the value, once)`: the
        partitioner's cost of it, in bytes sent at the fastest link's rate."""
        _, link = self.link(axes)
        per_byte = fraction(kind, n) * (self.unit / link.bandwidth)
        return per_byte, (link.overhead + steps(kind, n) * link.latency) * self.unit if n > 1 else 0.0

    @property
    def flops_per_unit(self) -> float:
        """Flops a rank computes in the time the partitioner's unit (a byte at `unit`) takes."""
        return self.flops / self.unit


def machine(sizes: Mapping[str, int], cluster: Cluster | None = None) -> Machine:
    """The links of a mesh's axes (`sizes`: name -> size in mesh order, ranks row-major) on a
    planner `Cluster`: its NVLink-class link where an axis's group stays in a node, its fabric where
    the group spans nodes; a rank computes at the device's bf16 peak. With no cluster, `HOST`."""
    if cluster is None:
        return Machine((), HOST_FLOPS)
    out, stride = [], 1
    for axis in reversed(list(sizes)):  # the innermost axis's ranks are neighbours
        crosses = cluster.crosses_nodes(sizes[axis], stride)
        out.append((axis, "inter" if crosses else "intra", cluster.inter if crosses else cluster.intra))
        stride *= sizes[axis]
    return Machine(tuple(reversed(out)), cluster.device.peak_bf16_flops)
