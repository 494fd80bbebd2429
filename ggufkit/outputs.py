"""Where a command's outputs go, and the one rule that protects the user's files.

Every command that names an output file goes through :func:`resolve_output` (``-o`` as a file, a folder,
a path ending in a separator, or a template) and, before it does any work, :func:`refuse_overwriting_inputs`
(no output may be one of the command's inputs, by path or by inode). The files themselves are then
written by :func:`ggufkit.format.atomic.atomic_write`.

The template vocabulary is the same for every command (``convert``, ``quantize``, ``release``):

- ``{type}`` the type in lower case (``q4_k_m``), ``{TYPE}`` in upper case (``Q4_K_M``);
- ``{ftype}``/``{FTYPE}`` and ``{outtype}``/``{OUTTYPE}``, the same, in the spelling of llama.cpp's
  ``convert_hf_to_gguf.py --outfile`` template.

Any other ``{...}`` is a one-line error.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable
from pathlib import Path

from ggufkit.errors import OutputExistsError, UsageError

#: The placeholders an output template may hold, each with whether it is written in upper case.
PLACEHOLDERS: dict[str, bool] = {"type": False, "TYPE": True, "ftype": False, "FTYPE": True,
                                 "outtype": False, "OUTTYPE": True}

#: One sentence for ``--help`` texts.
TEMPLATE_HELP = ("{type} (q4_k_m) or {TYPE} (Q4_K_M) in a name is replaced by the type "
                 "({ftype}/{FTYPE}, {outtype}/{OUTTYPE} are the same)")


def template_fields(template: str) -> list[str]:
    """The placeholders named in ``template``, in order.

    Raises:
        UsageError: unbalanced braces, a positional ``{}``, a format spec, or a name outside :data:`PLACEHOLDERS`.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UsageError(f"output template {template!r}: {exc}") from None
    fields: list[str] = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conversion:
            known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            raise UsageError(f"output template {template!r}: unknown placeholder {{{name}}}; use one of {known}")
        fields.append(name)
    return fields


def is_template(path: str | Path) -> bool:
    """True when ``path`` holds a placeholder (after checking that every ``{...}`` in it is known)."""
    text = str(path)
    return ("{" in text or "}" in text) and bool(template_fields(text))


def expand_template(template: str | Path, type_name: str) -> str:
    """``template`` with every placeholder replaced by ``type_name`` in the placeholder's case.

    Raises:
        UsageError: as :func:`template_fields`.
    """
    text = str(template)
    template_fields(text)  # validates
    values = {name: (type_name.upper() if upper else type_name.lower()) for name, upper in PLACEHOLDERS.items()}
    return text.format(**values)


def ends_with_separator(path: str | Path) -> bool:
    text = str(path)
    return text.endswith(os.sep) or (os.altsep is not None and text.endswith(os.altsep))


def resolve_output(output: str | Path | None, default_name: str, default_dir: Path,
                   type_name: str | None = None) -> Path:
    """The file a command writes, from its ``-o``.

    Args:
        output: None (``default_dir/default_name``), an existing folder or a path ending in a separator
            (``default_name`` inside it; the folder must exist), a template (expanded with ``type_name``),
            or a file path.
        default_name: the file name used inside a folder.
        default_dir: where the file goes without ``-o``.
        type_name: the value of the template placeholders; None where the command names no type.

    Raises:
        UsageError: a path ending in a separator whose folder does not exist, a template where the command
            has no type, or a bad template.
    """
    if output is None:
        return default_dir / default_name
    text = str(output)
    if ends_with_separator(text):
        folder = Path(text)
        if not folder.is_dir():
            raise UsageError(f"output folder {text} does not exist (a path ending in {os.sep} names a folder; "
                             "create it first, or drop the separator to name a file)")
        return folder / default_name
    if Path(text).is_dir():
        return Path(text) / default_name
    if "{" in text or "}" in text:
        fields = template_fields(text)
        if fields and type_name is None:
            raise UsageError(f"output template {text!r}: this command has no type to put in "
                             f"{{{fields[0]}}}")
        if fields:
            text = expand_template(text, type_name or "")
    return Path(text)


def _identity(path: Path) -> tuple[str, tuple[int, int] | None]:
    try:
        st = path.stat()
        inode: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        inode = None
    return os.path.realpath(path), inode


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when ``a`` and ``b`` are one file: the same resolved path (symbolic links, ``./x`` and ``x``,
    ``..``) or, for existing files, the same inode (hard links)."""
    path_a, inode_a = _identity(Path(a))
    path_b, inode_b = _identity(Path(b))
    return path_a == path_b or (inode_a is not None and inode_a == inode_b)


def refuse_overwriting_inputs(outputs: Iterable[str | Path], inputs: Iterable[str | Path | None]) -> None:
    """The rule of every command: no output is one of its inputs. Called before any work.

    Args:
        outputs: every file the command will write.
        inputs: every file it reads (model, text, imatrix, baseline, checkpoint files); None entries are
            skipped, so optional inputs can be passed as they are.

    Raises:
        OutputExistsError: an output is an input (one line naming both), or two outputs are the same file.
    """
    outs = [Path(o) for o in outputs]
    ins = [Path(i) for i in inputs if i is not None]
    for out in outs:
        for src in ins:
            if same_file(out, src):
                also = "" if os.path.realpath(out) == os.path.realpath(src) else f" (the same file as {src})"
                raise OutputExistsError(f"the output {out} would overwrite the input {src}{also}; "
                                        "choose another output path")
    for i, a in enumerate(outs):
        for b in outs[i + 1:]:
            if same_file(a, b):
                raise OutputExistsError(f"two outputs are the same file: {a} and {b}")
