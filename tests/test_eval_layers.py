"""eval/'s own layering (issue 31): no import circle, the MoE FFN through the model's public layer
interface, Gemma's llama.cpp constants written once (converters/gemma.py)."""

from __future__ import annotations

import ast

from test_format_layers import subpackage_graph
from test_layout import ROOT, import_cycles, runtime_imports

EVAL = ROOT / "eval"


def test_eval_has_no_import_circle_function_level_imports_included() -> None:
    assert import_cycles(subpackage_graph("ggufkit.eval")) == []


def test_the_moe_ffn_uses_only_the_models_public_layer_interface() -> None:
    tree = ast.parse((EVAL / "moe.py").read_text())
    private = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and n.attr.startswith("_") and not n.attr.startswith("__")})
    assert private == []
    assert "ggufkit.eval.model" not in runtime_imports(EVAL / "moe.py")


def test_eval_modules_import_no_private_names_of_other_modules() -> None:
    for path in sorted(EVAL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ggufkit"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_the_evaluator_reads_gemmas_constants_from_the_converters_one_copy() -> None:
    from ggufkit.converters import gemma
    from ggufkit.eval.arch import ARCH_TRAITS

    for arch in ("gemma2", "gemma3"):
        assert ARCH_TRAITS[arch].gemma_27b_layers == gemma.LAYERS_27B[arch]
        assert ARCH_TRAITS[arch].swa_pattern == gemma.SWA_PATTERN[arch]
    numbers = {n.value for n in ast.walk(ast.parse((EVAL / "arch.py").read_text()))
               if isinstance(n, ast.Constant) and type(n.value) is int}
    assert not numbers & {46, 62}, "a Gemma 27B layer count is written in eval/arch.py again"
    assert "ggufkit.converters.gemma" in runtime_imports(EVAL / "arch.py")
