"""``python -m kvelastic_dev.contacts_moved``: a new release's moved contacts, judged on small source trees."""

from __future__ import annotations

from pathlib import Path

from kvelastic.patching.spec import Absent, Signature, Target
from kvelastic.patching.versions import Version, VersionRange
from kvelastic_dev.contacts_moved import judge

OLD = '''
def kept(a, b):
    """Kept as it was."""
    return a + b


def reshaped(a):
    return a


def rewritten(a):
    """The docstring changes too, which alone would not count."""
    return a


class Holder:
    def __init__(self):
        self.x = 1


def removed():
    pass
'''
NEW = '''
def kept(a, b):
    """Kept as it was, but its docstring was reworded."""

    return a + b


def reshaped(a, evict_first=False):
    return a


def rewritten(a):
    return -a


class Holder:
    def __init__(self):
        self.y = 1
'''
EVERY = VersionRange.of("0.1", "0.3")


def _tree(root: Path, text: str) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "mod.py").write_text(text)
    return root


def _function(name: str, params: tuple[str, ...]) -> Target:
    return Target("vllm.mod", name, (Signature(EVERY, params),))


def test_each_contact_is_moved_changed_or_the_same(tmp_path: Path) -> None:
    from kvelastic.patching.spec import Attributes

    old, new = _tree(tmp_path / "old", OLD), _tree(tmp_path / "new", NEW)
    held = {_function("kept", ("a", "b")): ("p",), _function("reshaped", ("a",)): ("p",),
            _function("rewritten", ("a",)): ("p", "q"), _function("removed", ()): ("p",),
            Target("vllm.mod", "Holder", (Attributes(EVERY, ("x",)),), kind="class", use="read"): ("p",),
            Target("vllm.mod", "never", (Absent(EVERY),)): ("p",)}
    verdicts = {v.target.qualname: v for v in judge(old, new, Version.parse("0.2"), held)}
    assert {name: v.kind for name, v in verdicts.items()} == {
        "reshaped": "moved", "removed": "moved", "Holder": "moved", "rewritten": "body", "kept": "same",
        "never": "same"}
    assert "evict_first" in verdicts["reshaped"].detail and "x" in verdicts["Holder"].detail
    assert verdicts["rewritten"].patches == ("p", "q")
