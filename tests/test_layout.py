"""The package's structure: imports flow one way, no module borrows another's private names,
and the host's argument lists match the kernels' signatures."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

from dmattn_cute.kernels.bwd import BwdScalars, BwdSpec, FlashBwd
from dmattn_cute.kernels.fwd import FlashFwd, FwdScalars, FwdSpec
from dmattn_cute.kernels.launch import kernel_scalars
from dmattn_cute.kernels.sm90.bwd import FlashBwdSm90, Sm90BwdSpec
from dmattn_cute.kernels.sm90.fwd import FlashFwdSm90, Sm90FwdSpec
from dmattn_cute.problem import Problem

PACKAGE = Path(__file__).resolve().parent.parent / "dmattn_cute"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, imported name or "") of every import of a package module in `path`, lazy
    imports inside functions included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add((submodule, "") if submodule in modules else (base, alias.name))
    return {(module, item) for module, item in found if module in modules}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    modules = _modules()
    return {
        name: {module for module, _ in _imports(name, path, modules)}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle:
                return cycle
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_have_no_cycles() -> None:
    assert find_cycle(import_graph()) is None


def test_backward_borrows_nothing_from_the_forward() -> None:
    graph = import_graph()
    kernels = "dmattn_cute.kernels."
    for name, targets in graph.items():
        if name.startswith(kernels + "bwd"):
            forward = sorted(t for t in targets if t.startswith(kernels + "fwd"))
            assert not forward, f"{name} imports {forward}"


def test_no_private_names_cross_modules() -> None:
    modules = _modules()
    borrowed = [
        f"{name} imports {item} from {module}"
        for name, path in modules.items()
        for module, item in _imports(name, path, modules)
        if item.startswith("_")
    ]
    assert borrowed == []


def _params(kernel: type) -> list[inspect.Parameter]:
    """The parameters of a kernel class's __call__ after self (@cute.jit wraps the function;
    inspect.unwrap finds the one written)."""
    call = inspect.unwrap(kernel.__dict__["__call__"])
    return list(inspect.signature(call).parameters.values())[1:]


def _scalar_params(kernel: type) -> list[str]:
    """The names of the parameters between a kernel's last tensor and its stream."""
    *params, stream = _params(kernel)
    assert stream.name == "stream"
    tensors = [i for i, param in enumerate(params) if "Tensor" in str(param.annotation)]
    return [param.name for param in params[max(tensors) + 1 :]]


@pytest.mark.parametrize(
    ("kernel", "scalars", "spec"),
    [
        pytest.param(FlashFwd, FwdScalars, FwdSpec.build("sm_80", "bf16", 64, *[None] * 2,
                                                         False, False), id="fwd"),
        pytest.param(FlashFwdSm90, FwdScalars, Sm90FwdSpec.build("sm_90a", "bf16", 64,
                                                                 *[None] * 2, False, False),
                     id="fwd_sm90"),
        pytest.param(FlashBwd, BwdScalars, BwdSpec.build("sm_80", "bf16", 64, *[None] * 3,
                                                         False, False, True), id="bwd"),
        pytest.param(FlashBwdSm90, BwdScalars, Sm90BwdSpec.build("sm_90a", "bf16", 64,
                                                                 *[None] * 3, False, False),
                     id="bwd_sm90"),
    ],
)  # fmt: skip
def test_named_scalars_are_the_kernel_parameters(kernel, scalars, spec) -> None:
    assert list(scalars._fields) == _scalar_params(kernel)
    names = [param.name for param in _params(kernel)]
    # example_args passes one value per parameter, the scalars in their place.
    args = spec.example_args()
    assert len(args) == len(names)
    first = names.index(scalars._fields[0])
    assert tuple(args[first : first + len(scalars._fields)]) == scalars()


def test_scalars_of_a_problem() -> None:
    problem = Problem.from_tensors(
        torch.empty(2, 7, 8, 64, device="meta", dtype=torch.bfloat16),
        torch.empty(2, 9, 2, 64, device="meta", dtype=torch.bfloat16),
        softmax_scale=0.125, is_causal=True, softcap=0.0, window_left=3, window_right=-1,
        deterministic=False,
    )  # fmt: skip
    mask = torch.empty(2, 2, 7, 9, device="meta", dtype=torch.uint8)
    fwd = kernel_scalars(FwdScalars, problem, mask, None)
    bwd = kernel_scalars(BwdScalars, problem, mask, None)
    assert fwd.scale_log2 == pytest.approx(0.125 * math.log2(math.e))
    assert fwd.bias_scale == 8.0 and fwd.softcap == 0.0
    assert (fwd.window_left, fwd.window_right) == (3, 0)
    assert (fwd.mask_head_div, fwd.bias_head_div, fwd.group) == (4, 8, 4)
    assert bwd.softmax_scale == 0.125
    assert fwd.key_chunks == 1  # the forward's alone (split-KV decode sets it per launch)
    shared = [name for name in fwd._fields if name != "key_chunks"]
    assert {name: getattr(bwd, name) for name in shared} == {n: getattr(fwd, n) for n in shared}
