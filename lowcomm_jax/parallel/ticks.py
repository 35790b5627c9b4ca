"""A pipeline schedule compiled ahead of time into ticks: per tick and device, one op and one send.

The grid has S stages × R replicas; device d = r·S + s (replica-major, the order of the mesh axes
`replica`, `stage`). Each micro-batch follows its `Route`: forward (F) on every device of the route
in order, the loss (L) back on its origin (stage 0, which holds the embedding and the head), then
backward (B) along the reversed route. Every op takes one tick (unit costs). After its op a device
sends at most one message: F sends the activation to the next device of the route (or, after the
last stage, to the origin for the loss); L and B send the gradient with respect to their input to
the previous device (B on stage 0 sends nothing). A message sent at the end of tick t can be used at
t+1.

`compile_ticks` turns routes into a `TickTable` by list scheduling in discrete time, with the policy
of the SkipPipe simulator (`skippipe.simulator`, unit costs, zero link cost), so the two predict the
same busy and idle ticks:
- a device runs one ready op per tick; ready ops wait in arrival order, ties by micro-batch id
  (`order="gpipe"`: every forward that arrived earlier goes first, which gives GPipe's all-forward
  then all-backward order on a full pipeline), or with losses and backwards first
  (`order="1f1b"`, with at most `memory` = S micro-batches in flight: one-forward-one-backward);
- a micro-batch enters only when every device on its route has a free activation slot (`memory`),
  and frees the slot when its backward there ends.

Each tick's transfers must be one static permutation per direction (`lax.ppermute`): a device can
receive at most one activation and one gradient per tick. Routes that are permutations at every
boundary in lock step (full pipelines, NoLoCo's random routing) never contend; SkipPipe's paths can
(two paths entering one node in the same tick). By default the later device's op then waits a tick
(a port conflict the continuous-time simulator does not model, so there the plan can be longer than
its prediction); `on_collision="raise"` rejects the schedule instead. `validate` checks that, and
that every micro-batch's ops follow its route in time order, and raises one ValueError naming the
tick, the device and the micro-batches before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from lowcomm_jax.parallel.routing import Route

IDLE, FORWARD, LOSS, BACKWARD = 0, 1, 2, 3
OP_NAMES = {IDLE: ".", FORWARD: "F", LOSS: "L", BACKWARD: "B"}
ORDERS = ("gpipe", "1f1b")


def device_index(stage: int, replica: int, num_stages: int) -> int:
  return int(replica) * int(num_stages) + int(stage)


def device_name(device: int, num_stages: int) -> str:
  return f"device {device} (stage {device % num_stages}, replica {device // num_stages})"


def route_tasks(route: Route, num_stages: int) -> list[tuple[int, int]]:
  """(device, op) of one micro-batch in order: F along the route, L at the origin, B reversed."""
  devices = [device_index(s, r, num_stages) for s, r in zip(route.stages, route.replicas)]
  return ([(d, FORWARD) for d in devices] + [(devices[0], LOSS)]
          + [(d, BACKWARD) for d in reversed(devices)])


def _message_destinations(route: Route, num_stages: int) -> list[int]:
  """Where each task of `route_tasks` sends its output (-1: nowhere)."""
  tasks = route_tasks(route, num_stages)
  # F_i -> next F (or the loss); L -> the last forward device; B_i -> the previous device; B_0 ->
  # none.
  return [tasks[i + 1][0] for i in range(len(tasks) - 1)] + [-1]


@dataclasses.dataclass(frozen=True)
class TickTable:
  """The compiled schedule.

  Attributes:
    num_stages: S.
    num_replicas: R.
    routes: one per micro-batch (micro-batch id = index).
    op: int8[T, D], IDLE / FORWARD / LOSS / BACKWARD per tick and device.
    microbatch: int32[T, D], the micro-batch of that op (-1 when idle).
    send: int32[T, D], the device that op's output goes to (-1: none).
    order: the policy that built it ("gpipe", "1f1b" or "manual").
    port_waits: ops the compiler held back a tick because their message would have met another at
      the same device (0: the plan follows the simulator's policy exactly).
  """

  num_stages: int
  num_replicas: int
  routes: tuple[Route, ...]
  op: np.ndarray
  microbatch: np.ndarray
  send: np.ndarray
  order: str = "manual"
  port_waits: int = 0

  @property
  def num_ticks(self) -> int:
    return int(self.op.shape[0])

  @property
  def num_devices(self) -> int:
    return self.num_stages * self.num_replicas

  @property
  def num_microbatches(self) -> int:
    return len(self.routes)

  def busy_ticks(self) -> np.ndarray:
    """int[D]: ticks each device computes, as planned."""
    return (self.op != IDLE).sum(0)

  def idle_ticks(self) -> np.ndarray:
    """int[D]: ticks each device waits, as planned (the bubble)."""
    return self.num_ticks - self.busy_ticks()

  def bubble_fraction(self) -> float:
    return float(self.idle_ticks().sum() / (self.num_ticks * self.num_devices))

  def received(self, kind: str) -> np.ndarray:
    """int32[T, D]: the micro-batch whose activation ("act") or gradient ("grad") arrives at a
    device at the end of each tick (-1: none). Assumes a validated table."""
    ops = (FORWARD,) if kind == "act" else (LOSS, BACKWARD)
    out = np.full(self.op.shape, -1, np.int32)
    t, src = np.nonzero(np.isin(self.op, ops) & (self.send >= 0))
    out[t, self.send[t, src]] = self.microbatch[t, src]
    return out

  def permutations(self, kind: str) -> list[tuple[tuple[int, int], ...]]:
    """Per tick, the static (source, destination) pairs of activations or gradients."""
    ops = (FORWARD,) if kind == "act" else (LOSS, BACKWARD)
    return [tuple((int(d), int(self.send[t, d])) for d in range(self.num_devices)
                  if self.op[t, d] in ops and self.send[t, d] >= 0) for t in range(self.num_ticks)]

  def text(self) -> str:
    """The table as text: a row per device, a column per tick, op letter + micro-batch id."""
    width = max(2, len(str(max(self.num_microbatches - 1, 0))) + 1)
    rows = []
    for d in range(self.num_devices):
      cells = [(OP_NAMES[int(o)] + (str(int(m)) if o else "")).ljust(width)
               for o, m in zip(self.op[:, d], self.microbatch[:, d])]
      rows.append(f"s{d % self.num_stages} r{d // self.num_stages} | " + " ".join(cells))
    return "\n".join(rows)


def check_routes(routes: Sequence[Route], num_stages: int, num_replicas: int) -> tuple[Route, ...]:
  """Routes as a tuple, or a ValueError naming the micro-batch and what is wrong."""
  routes = tuple(Route(tuple(int(s) for s in r.stages), tuple(int(x) for x in r.replicas))
                 for r in routes)
  if not routes:
    raise ValueError("routes: need at least one micro-batch route")
  for m, route in enumerate(routes):
    if len(route.stages) != len(route.replicas) or not route.stages:
      raise ValueError(f"routes: micro-batch {m} has {len(route.stages)} stages and "
                       f"{len(route.replicas)} replicas; give one replica per visited stage (>= 1)")
    if route.stages[0] != 0:
      raise ValueError(f"routes: micro-batch {m} starts at stage {route.stages[0]}; every route "
                       f"starts at stage 0 (embedding and loss live there)")
    if len(set(route.stages)) != len(route.stages):
      raise ValueError(f"routes: micro-batch {m} visits a stage twice: {list(route.stages)}")
    if not all(0 <= s < num_stages for s in route.stages):
      raise ValueError(f"routes: micro-batch {m} visits stages {list(route.stages)}, outside "
                       f"[0, num_stages={num_stages})")
    if not all(0 <= r < num_replicas for r in route.replicas):
      raise ValueError(f"routes: micro-batch {m} uses replicas {list(route.replicas)}, outside "
                       f"[0, num_replicas={num_replicas})")
  return routes


def compile_ticks(routes: Sequence[Route], num_stages: int, num_replicas: int,
                  order: str = "gpipe", memory: int | None = None,
                  on_collision: str = "wait") -> TickTable:
  """List-schedules `routes` into a validated `TickTable` (see the module docstring).

  Args:
    routes: one `Route` per micro-batch.
    num_stages: S.
    num_replicas: R.
    order: "gpipe" (ready ops in arrival order) or "1f1b" (losses and backwards first).
    memory: micro-batches whose activations a device holds at once; default: all of them for
      "gpipe", S for "1f1b".
    on_collision: "wait" (an op whose message would reach a device that already receives one of
      the same direction in that tick waits, and the device takes its next ready op or idles) or
      "raise" (keep the simulator's policy and reject such a schedule).

  Raises:
    ValueError: a bad option or route, or a schedule whose transfers collide (two micro-batches sent
      to one device in one tick).
  """
  if order not in ORDERS:
    raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}")
  if on_collision not in ("wait", "raise"):
    raise ValueError(f"on_collision must be 'wait' or 'raise', got {on_collision!r}")
  routes = check_routes(routes, num_stages, num_replicas)
  if memory is None:
    memory = len(routes) if order == "gpipe" else num_stages
  if int(memory) < 1:
    raise ValueError(f"memory must be >= 1 micro-batch per device, got {memory}")
  num_devices = num_stages * num_replicas
  tasks = [route_tasks(r, num_stages) for r in routes]
  dests = [_message_destinations(r, num_stages) for r in routes]
  route_devices = [sorted({d for d, _ in ts}) for ts in tasks]
  held = np.zeros(num_devices, np.int64)
  next_task = [0] * len(routes)
  arrived = [None] * len(routes)  # tick at which the next task became ready; None: not admitted
  waiting = list(range(len(routes)))
  ops, mbs, sends = [], [], []
  t = port_waits = 0
  while any(n < len(ts) for n, ts in zip(next_task, tasks)):
    still = []
    for m in waiting:  # admission in micro-batch order, as the simulator's
      if all(held[d] < memory for d in route_devices[m]):
        held[route_devices[m]] += 1
        arrived[m] = t
      else:
        still.append(m)
    waiting = still
    op_row = np.zeros(num_devices, np.int8)
    mb_row = np.full(num_devices, -1, np.int32)
    send_row = np.full(num_devices, -1, np.int32)
    ports: set[tuple[bool, int]] = set()  # (is activation, destination) already receiving this tick
    for d in range(num_devices):
      ready = [m for m in range(len(routes)) if arrived[m] is not None and arrived[m] <= t
               and next_task[m] < len(tasks[m]) and tasks[m][next_task[m]][0] == d]
      def key(m):
        rank = 0 if order == "1f1b" and tasks[m][next_task[m]][1] != FORWARD else 1
        return (rank, arrived[m], m)
      for m in sorted(ready, key=key):
        op, dest = tasks[m][next_task[m]][1], dests[m][next_task[m]]
        port = (op == FORWARD, dest)
        if dest >= 0 and port in ports and on_collision == "wait":
          port_waits += 1
          continue  # its message would meet another at `dest` this tick: try the next ready op
        if dest >= 0:
          ports.add(port)
        op_row[d], mb_row[d], send_row[d] = op, m, dest
        break
    for d in np.nonzero(op_row)[0]:
      m = int(mb_row[d])
      if op_row[d] == BACKWARD:
        held[d] -= 1
      next_task[m] += 1
      arrived[m] = t + 1
    ops.append(op_row)
    mbs.append(mb_row)
    sends.append(send_row)
    t += 1
    if t > 4 * sum(len(ts) for ts in tasks) + 4:
      raise RuntimeError("compile_ticks made no progress; this is a bug")
  table = TickTable(num_stages, num_replicas, routes, np.stack(ops), np.stack(mbs), np.stack(sends),
                    order, port_waits)
  validate(table)
  return table


def validate(table: TickTable) -> TickTable:
  """Checks a tick table before it is compiled; returns it, or raises one clear ValueError.

  - op codes and shapes;
  - per tick, each device receives at most one activation and at most one gradient (each
    direction's transfers are one static permutation);
  - every micro-batch runs exactly its route's tasks, each after the previous one's tick, each
    sending to the device its route says.
  """
  num_ticks, num_devices = table.op.shape if np.ndim(table.op) == 2 else (None, None)
  if num_devices != table.num_devices:
    raise ValueError(f"tick table: op must be [ticks, S·R = {table.num_devices}], got shape "
                     f"{np.shape(table.op)}")
  for name in ("microbatch", "send"):
    if np.shape(getattr(table, name)) != np.shape(table.op):
      raise ValueError(f"tick table: {name} must have the shape of op {np.shape(table.op)}, got "
                       f"{np.shape(getattr(table, name))}")
  bad = ~np.isin(table.op, (IDLE, FORWARD, LOSS, BACKWARD))
  if bad.any():
    t, d = map(int, np.argwhere(bad)[0])
    raise ValueError(f"tick table: tick {t}, {device_name(d, table.num_stages)} has op code "
                     f"{int(table.op[t, d])}; allowed: 0 idle, 1 F, 2 L, 3 B")
  routes = check_routes(table.routes, table.num_stages, table.num_replicas)
  for kind, ops in (("activation", (FORWARD,)), ("gradient", (LOSS, BACKWARD))):
    for t in range(num_ticks):
      by_dest: dict[int, list[int]] = {}
      for d in range(num_devices):
        if table.op[t, d] in ops and table.send[t, d] >= 0:
          by_dest.setdefault(int(table.send[t, d]), []).append(int(table.microbatch[t, d]))
      for dest, mbs in by_dest.items():
        if len(mbs) > 1:
          raise ValueError(
              f"tick table: at tick {t}, {device_name(dest, table.num_stages)} would receive the "
              f"{kind}s of micro-batches {mbs} at once; a tick's transfers must be one permutation "
              f"(each device receives at most one {kind} per tick). Check the routing (is it a "
              f"permutation at every stage boundary?) or the schedule's timing.")
  for m, route in enumerate(routes):
    expected = route_tasks(route, table.num_stages)
    dests = _message_destinations(route, table.num_stages)
    t_idx, d_idx = np.nonzero((table.microbatch == m) & (table.op != IDLE))
    done = sorted(zip(t_idx.tolist(), d_idx.tolist()))
    got = [(d, int(table.op[t, d])) for t, d in done]
    if got != expected:
      raise ValueError(f"tick table: micro-batch {m} runs {[(OP_NAMES[o], d) for d, o in got]} but "
                       f"its route needs {[(OP_NAMES[o], d) for d, o in expected]} (op, device)")
    ticks = [t for t, _ in done]
    if len(set(ticks)) != len(ticks):
      raise ValueError(f"tick table: micro-batch {m} is on two devices in tick "
                       f"{next(t for t in ticks if ticks.count(t) > 1)}")
    for (t, d), dest in zip(done, dests):
      if int(table.send[t, d]) != dest:
        raise ValueError(f"tick table: at tick {t}, {device_name(d, table.num_stages)} sends "
                         f"micro-batch {m} to device {int(table.send[t, d])}; its route "
                         f"needs {dest}")
  return table
