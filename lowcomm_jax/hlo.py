"""Reading compiled HLO: which collectives a program runs and what they wait for.

Used by tests (and users) to prove the communication contract on the program XLA will run:
a non-sync step has no cross-replica collective; a sync step moves only its fragment; an
overlapped fragment's collective does not depend on the step's forward and backward.
"""

from __future__ import annotations

import re

COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter",
                  "all-reduce-start", "all-gather-start", "collective-permute-start")
# Opcodes that mean "the model's compute": matmuls, and the scan over layers.
COMPUTE_OPS = ("dot", "convolution", "while")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")


def _parse(hlo_text: str):
  """{computation: {instruction: (opcode, operands, called computations, text)}}, and the entry."""
  computations, current, entry = {}, None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line[:1].isspace():  # instructions are indented, computation headers are not
      current = header.group(1)
      computations[current] = {}
      if line.startswith("ENTRY"):
        entry = current
      continue
    inst = _INSTRUCTION.match(line)
    if inst and current is not None:
      name, _, opcode, rest = inst.groups()
      args = rest.split(")", 1)[0]
      operands = re.findall(r"%([\w.\-]+)", args)
      called = re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-, "
                          r"%]+)\}?", rest)
      called = [c.strip().lstrip("%") for group in called for c in group.split(",")]
      computations[current][name] = (opcode, operands, called, line)
  return computations, entry


def collectives(hlo_text: str) -> list[str]:
  """The lines of every collective instruction in the module."""
  computations, _ = _parse(hlo_text)
  return [inst[3].strip() for comp in computations.values() for inst in comp.values()
          if inst[0] in COLLECTIVE_OPS]


def _has_compute(computations, name, seen) -> bool:
  if name in seen or name not in computations:
    return False
  seen.add(name)
  return any(op in COMPUTE_OPS or any(_has_compute(computations, c, seen) for c in called)
             for op, _, called, _ in computations[name].values())


def collective_depends_on_compute(hlo_text: str) -> list[bool]:
  """For each collective of the entry computation: does its input depend on a matmul or loop?

  Walks the operands backwards through the entry computation; a fusion or call counts as compute
  when its called computation (recursively) holds a dot, convolution or while loop.
  """
  computations, entry = _parse(hlo_text)
  body = computations[entry]
  results = []
  for name, (opcode, operands, _, _) in body.items():
    if opcode not in COLLECTIVE_OPS:
      continue
    stack, visited, depends = list(operands), set(), False
    while stack and not depends:
      current = stack.pop()
      if current in visited or current not in body:
        continue
      visited.add(current)
      op, ops, called, _ = body[current]
      if op in COMPUTE_OPS or any(_has_compute(computations, c, set()) for c in called):
        depends = True
      stack.extend(ops)
    results.append(depends)
  return results


def _collectives_under(computations, name, seen) -> list[str]:
  """The collective lines of computation `name` and of every computation it calls."""
  if name in seen or name not in computations:
    return []
  seen.add(name)
  lines = []
  for op, _, called, text in computations[name].values():
    if op in COLLECTIVE_OPS:
      lines.append(text.strip())
    for c in called:
      lines.extend(_collectives_under(computations, c, seen))
  return lines


def conditional_branch_collectives(hlo_text: str) -> list[list[list[str]]]:
  """For each `conditional` instruction: per branch, the collective lines that branch runs.

  A conditional runs one branch, so collectives found here run only when their branch is taken
  (a `select` between branches would run them all: those appear outside any conditional).
  """
  computations, _ = _parse(hlo_text)
  return [[_collectives_under(computations, branch, set()) for branch in called]
          for comp in computations.values() for op, _, called, _ in comp.values()
          if op == "conditional"]


def collectives_outside_conditionals(hlo_text: str) -> list[str]:
  """The collective lines that run whatever branch a conditional takes (every program run)."""
  computations, entry = _parse(hlo_text)
  inside = {line for branches in conditional_branch_collectives(hlo_text)
            for branch in branches for line in branch}
  return [line for line in _collectives_under(computations, entry, set()) if line not in inside]

