"""No import circles among hetjax's modules (docs/design.md: a circle is a bug).

Every import counts, at module level, inside functions and under
TYPE_CHECKING: a function-level import that closes a circle still ties two
floors together. A package's own `__init__` is not an edge of its submodules.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
  """The hetjax modules `path` imports anywhere in its text."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    else:
      continue
    out |= {t for t in targets if t in modules and t != name}
  return out


def import_graph() -> dict[str, set[str]]:
  """hetjax module -> the hetjax modules it imports."""
  paths = {_module_name(p): p for p in (ROOT / "hetjax").rglob("*.py")}
  return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_walker_sees_a_circle_and_function_level_imports():
  assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  graph = import_graph()
  assert "hetjax.config" in graph["hetjax.cli.commands"]  # Module level.
  assert "hetjax.trainer" in graph["hetjax.cli.commands"]  # Inside a function.


def test_no_import_circles():
  found = circles(import_graph())
  assert not found, "import circles (move the shared names down a floor): " + "; ".join(
      " <-> ".join(c) for c in found)
