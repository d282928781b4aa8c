"""The store's parts own their state (docs/design-notes.md, "The store as parts, under one lock"):
each file of tierd/store/ but core.py (the store that composes them) uses, through `self.`, at
most a few names it neither assigns nor defines itself. A part that starts reading another
part's fields again, as the mixins once did (154 such names), fails here with the names."""

import ast
from collections import defaultdict
from pathlib import Path

STORE = Path(__file__).resolve().parent.parent / "tierd" / "store"
AT_MOST = 15


def _foreign_names() -> dict[str, list[str]]:
    own: dict[str, set[str]] = defaultdict(set)
    used: dict[str, set[str]] = defaultdict(set)
    files = sorted(p for p in STORE.glob("*.py") if p.name != "__init__.py")
    for p in files:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own[p.name].add(n.name)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                own[p.name].add(n.target.id)           # dataclass fields
            elif isinstance(n, ast.Assign):
                own[p.name].update(t.id for t in n.targets if isinstance(t, ast.Name))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                (own if isinstance(n.ctx, ast.Store) else used)[p.name].add(n.attr)
    everyone = set().union(*own.values())
    return {p.name: sorted((used[p.name] - own[p.name]) & everyone) for p in files if p.name != "core.py"}


def test_the_store_parts_read_few_names_they_do_not_own():
    foreign = _foreign_names()
    assert set(foreign) >= {"index.py", "residency.py", "ownership.py", "promotion.py", "demotion.py",
                            "keeping.py", "health.py", "remote.py", "feed.py", "namespaces.py"}
    total = sum(len(v) for v in foreign.values())
    assert total <= AT_MOST, {f: names for f, names in foreign.items() if names}
