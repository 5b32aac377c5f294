"""Which process holds which rank, node by node, when ranks fail and warm spares take their place (the rank
assignment of the in-process engine, ``engine.py``).

The processes are launched node by node: ``per_node`` training ranks and ``spares`` warm spares on each of
``nodes`` nodes, then ``spare_nodes`` whole nodes of spares, in that order of their initial ranks (Slurm's block
distribution, or one machine playing several nodes). ffstate places a rank by its number (rank // per_node is its
node, docs/design.md section 7), so a rank is only ever handed to a process on the node that runs it:

- a rank whose process died goes to a live spare of the same node (its node's slots still hold its last commit);
- a node with no spare left for it moves whole to a spare node: its surviving processes step aside as spares and
  the spare node's processes take every rank of the node (a node lost: they restore from the replicas);
- with neither, the node leaves the job when the layout allows it to shrink (``min_nodes``): the other nodes go on
  at the smaller world size, their ranks numbered again in node order, and the node's surviving processes wait as
  spares of a machine no node runs on (the resize restores every rank from the copies, docs/elastic.md);
- else the job cannot go on: every process is told so (``NoSpareLeft``).

Every live process runs the same assignment on the same record of failures, so all agree without talking.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class NoSpareLeft(RuntimeError):
    """A rank died on a node that has no spare process left and no spare node is free."""


@dataclass(frozen=True)
class Layout:
    """How the processes were launched: ``nodes`` nodes of ``per_node`` ranks and ``spares`` spares each, then
    ``spare_nodes`` nodes of ``per_node + spares`` spares; the job may shrink to ``min_nodes`` nodes (0: never)."""

    nodes: int
    per_node: int
    spares: int = 0
    spare_nodes: int = 0
    min_nodes: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1 or self.spares < 0 or self.spare_nodes < 0:
            raise ValueError(f"a layout needs nodes >= 1, per_node >= 1, spares >= 0, spare_nodes >= 0: {self}")
        if not 0 <= self.min_nodes <= self.nodes:
            raise ValueError(f"min_nodes must be between 0 (never shrink) and the {self.nodes} training nodes, got "
                             f"{self.min_nodes}")

    @property
    def per_machine(self) -> int:
        """Processes launched on each node (training ranks and spares)."""
        return self.per_node + self.spares

    @property
    def processes(self) -> int:
        return (self.nodes + self.spare_nodes) * self.per_machine

    @property
    def world(self) -> int:
        """The training's world size."""
        return self.nodes * self.per_node

    @staticmethod
    def of(processes: int, nodes: int, spares: int, spare_nodes: int, min_nodes: int = 0) -> "Layout":
        """The layout of ``processes`` processes on ``nodes + spare_nodes`` machines with ``spares`` each.

        Raises:
            ValueError: the numbers do not fit together.
        """
        machines = nodes + spare_nodes
        if machines < 1 or processes % machines:
            raise ValueError(f"{processes} processes do not divide evenly over {machines} nodes "
                             f"({nodes} training, {spare_nodes} spare)")
        per_node = processes // machines - spares
        if per_node < 1:
            raise ValueError(f"{processes // machines} processes a node leave no training rank beside {spares} "
                             "spares")
        return Layout(nodes, per_node, spares, spare_nodes, min_nodes)


@dataclass
class Assignment:
    """The current holder of each rank (process ids: initial ranks), and the machine of each process."""

    layout: Layout
    alive: list[int] = field(default_factory=list)  # live processes, in the order of their engine ranks
    holder: list[int] = field(default_factory=list)  # rank -> process
    node_machine: list[int] = field(default_factory=list)  # ffstate node -> the machine that runs it
    failures: list[int] = field(default_factory=list)  # processes lost so far, in the order they were reported

    @staticmethod
    def start(layout: Layout) -> "Assignment":
        per, m = layout.per_node, layout.per_machine
        holder = [node * m + j for node in range(layout.nodes) for j in range(per)]
        return Assignment(layout, list(range(layout.processes)), holder, list(range(layout.nodes)))

    @property
    def world(self) -> int:
        """The training's world size now (smaller than the layout's after a shrink)."""
        return len(self.holder)

    def machine(self, process: int) -> int:
        return process // self.layout.per_machine

    def lose(self, processes: set[int]) -> None:
        """Processes that died: their ranks go to spares of their nodes, or their nodes to spare nodes, or (where
        the layout allows it) their nodes leave the job.

        Raises:
            NoSpareLeft: a node that lost a rank has no spare left, no spare node is free, and the job may not
                shrink below the nodes it has.
        """
        lost = set(processes)
        self.failures += sorted(lost)
        self.alive = [p for p in self.alive if p not in lost]
        per, live = self.layout.per_node, set(self.alive)
        leaving: dict[int, str] = {}
        for node, machine in enumerate(self.node_machine):
            ranks = range(node * per, (node + 1) * per)
            dead = [r for r in ranks if self.holder[r] not in live]
            if not dead:
                continue
            spares = [p for p in self._idle() if self.machine(p) == machine]
            if len(spares) >= len(dead):  # the node's own spares (its slots hold the ranks' last commits)
                for r, p in zip(dead, spares):
                    self.holder[r] = p
                continue
            free = next((q for q in self._spare_machines() if self._whole(q)), None)
            if free is None:
                leaving[node] = f"node {node} lost rank(s) {dead} and has {len(spares)} spare(s) left"
                continue
            procs = [p for p in self.alive if self.machine(p) == free]
            self.node_machine[node] = free
            for r, p in zip(ranks, procs):  # the node moves whole: its survivors are spares from now on
                self.holder[r] = p
        if leaving:
            self._shrink(leaving)

    def _shrink(self, leaving: dict[int, str]) -> None:
        """Nodes with no spare and no spare node leave the job; the others' ranks are numbered again in node order."""
        per, nodes = self.layout.per_node, len(self.node_machine)
        if not self.layout.min_nodes or nodes - len(leaving) < self.layout.min_nodes:
            limit = (f"the job may not shrink below {self.layout.min_nodes} node(s)" if self.layout.min_nodes else
                     "the job may not shrink (Config.min_nodes 0)")
            raise NoSpareLeft(f"{'; '.join(leaving.values())}; no spare node is free, and {limit}: the job cannot go "
                              f"on at {nodes - len(leaving)} of its {nodes} node(s)")
        kept = [n for n in range(nodes) if n not in leaving]
        self.holder = [self.holder[n * per + j] for n in kept for j in range(per)]
        self.node_machine = [self.node_machine[n] for n in kept]

    def _idle(self) -> list[int]:
        busy = set(self.holder)
        return [p for p in self.alive if p not in busy]

    def _spare_machines(self) -> list[int]:
        used = set(self.node_machine)
        machines = self.layout.nodes + self.layout.spare_nodes
        return [q for q in range(machines) if q not in used]

    def _whole(self, machine: int) -> bool:
        """Whether a machine no ffstate node runs on has enough live processes for a node's ranks."""
        return sum(1 for p in self.alive if self.machine(p) == machine) >= self.layout.per_node

    def rank_of(self, process: int) -> int | None:
        """The training rank ``process`` holds (None: a spare)."""
        try:
            return self.holder.index(process)
        except ValueError:
            return None

    def copy(self) -> "Assignment":
        return dataclasses.replace(self, alive=list(self.alive), holder=list(self.holder),
                                   node_machine=list(self.node_machine), failures=list(self.failures))
