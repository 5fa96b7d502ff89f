"""train/ is written once: no branch on the framework's name and no import of a framework
outside the places listed here (issue 34 item 4). The decoder, its pipeline Stage and
its loss are defined once over ``Platform.module_types()`` and the platform's ops
(``train/model.py``).

``hf_model.py`` is torch by nature (Hugging Face models, through
``integrations/transformers``). ``REMAINING`` lists what is still written per framework,
file by file: the check fails when a file gains a branch or an import, and also when one
is removed without shrinking the list, so the list only ever shrinks.

No ranks, no framework: the files are read as Python syntax trees.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "hyper_parallel" / "train"

FRAMEWORKS = ("torch", "mindspore", "torch_npu")

#: Files that may import a framework and branch on it, whole.
EXEMPT = {
    "hf_model.py": "Hugging Face models are torch modules (integrations/transformers)",
}

#: Per file, what may stay: the command line's --platform parsing (kind -> count).
ALLOWED: dict[str, dict[str, int]] = {
    # TrainConfig validates --platform: a framework name; --hf-config needs torch
    "config.py": {"branch": 1},
}

#: Per file, the framework imports and branches still to remove (kind -> count).
REMAINING: dict[str, dict[str, int]] = {}


def _names_framework(node: ast.AST) -> bool:
    """``x.framework``, or a string constant that names a framework (or starts one)."""
    if isinstance(node, ast.Attribute) and node.attr == "framework":
        return True
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
        node.value.split("-")[0] in FRAMEWORKS


def findings(source: str) -> Counter[str]:
    """``{"import": n, "branch": m}`` of one file: imports of a framework (module level or
    inside a function), and comparisons or ``startswith`` calls on a framework's name."""
    found: Counter[str] = Counter()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found["import"] += sum(alias.name.split(".")[0] in FRAMEWORKS for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found["import"] += node.module.split(".")[0] in FRAMEWORKS
        elif isinstance(node, ast.Compare):
            found["branch"] += any(_names_framework(part) for part in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith"):
            found["branch"] += any(_names_framework(arg) for arg in node.args) or \
                any(isinstance(arg, ast.Tuple) and any(map(_names_framework, arg.elts)) for arg in node.args)
    return +found


def test_the_checker_sees_branches_and_imports() -> None:
    source = (
        "import torch.nn\n"
        "def f(p, cfg):\n"
        "    from mindspore import mint\n"
        "    if p.framework == 'torch':\n"
        "        return 1\n"
        "    return cfg.platform.startswith('mindspore')\n"
    )
    assert findings(source) == Counter({"import": 2, "branch": 2})
    assert findings("def f(p):\n    return p.name == 'cpu'\n") == Counter()


def test_train_is_written_once() -> None:
    seen = {path.name: dict(findings(path.read_text())) for path in sorted(TRAIN.glob("*.py"))
            if path.name not in EXEMPT}
    seen = {name: kinds for name, kinds in seen.items() if kinds}
    expected = {**REMAINING, **ALLOWED}
    assert seen == expected, (
        f"framework imports and branches in hyper_parallel/train: {seen}, expected {expected}. Write new code over "
        "the platform (Platform.module_types(), its ops, TENSOR_METHODS); when you remove one, shrink REMAINING")


def test_the_decoder_is_defined_once() -> None:
    source = (TRAIN / "model.py").read_text()
    assert findings(source) == Counter()
    classes = [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]
    duplicated = sorted(name for name, n in Counter(classes).items() if n > 1)
    assert not duplicated, f"train/model.py defines {duplicated} more than once"
