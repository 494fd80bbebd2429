"""The one exception hierarchy of ggufkit.

Every error a user can cause derives from :class:`GGUFKitError`. Each class also inherits the natural
builtin (``ValueError``, ``LookupError``, ...) so callers that do not know ggufkit can still catch it,
and states its process exit code once (``exit_code``): 2 for bad input or usage, 1 for a check that ran
and failed. The CLI maps these to one-line messages in ``ggufkit/cli/_errors.py``; anything outside this
hierarchy is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


class GGUFKitError(Exception):
    """Base class of every error ggufkit reports to a user."""

    exit_code: int = EXIT_BAD_INPUT

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        self.message = message
        self.path = str(path) if path is not None else None
        super().__init__(f"{self.path}: {message}" if self.path else message)


class GGUFFormatError(GGUFKitError, ValueError):
    """A GGUF file is malformed: what is wrong and at which byte offset."""

    def __init__(self, message: str, *, path: str | Path | None = None, offset: int | None = None) -> None:
        self.offset = offset
        where = f"at byte {offset}: " if offset is not None else ""
        super().__init__(where + message, path=path)


class MetadataKeyNotFoundError(GGUFKitError, LookupError):
    """A metadata key that must exist does not."""

    def __init__(self, key: str, *, path: str | Path | None = None, hint: str = "") -> None:
        self.key = key
        super().__init__(f"metadata key {key!r} not found" + (f"; {hint}" if hint else ""), path=path)


class MetadataValueError(GGUFKitError, ValueError):
    """A metadata value cannot be parsed, has the wrong type or is out of range."""

    def __init__(self, message: str, *, key: str | None = None, path: str | Path | None = None) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message, path=path)


class UsageError(GGUFKitError, ValueError):
    """Options that are each valid but cannot be combined, or an argument the parser cannot check."""


class OutputExistsError(GGUFKitError, FileExistsError):
    """The output path is unusable (it is the input of a non-atomic operation, or a directory)."""


class TensorNotFoundError(GGUFKitError, LookupError):
    """A named tensor is missing from a file."""

    def __init__(self, name: str, *, path: str | Path | None = None) -> None:
        self.tensor = name
        super().__init__(f"tensor {name!r} not found", path=path)


class QuantizationError(GGUFKitError, ValueError):
    """A tensor cannot be quantized as asked (NaN/inf data, a forbidden fallback, a bad imatrix)."""

    def __init__(self, message: str, *, tensor: str | None = None, path: str | Path | None = None) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: {message}" if tensor else message, path=path)


class DeviceUnavailableError(GGUFKitError, RuntimeError):
    """A device (CUDA) was asked for explicitly and is not available."""


class RegistryError(GGUFKitError, ValueError):
    """registry.yaml is malformed: which entry, which field, what is wrong."""

    def __init__(self, message: str, *, entry: str | None = None, field: str | None = None) -> None:
        self.entry = entry
        self.field = field
        where = "registry.yaml"
        if entry is not None:
            where += f": entry {entry!r}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")


class UnsupportedArchitectureError(GGUFKitError, LookupError):
    """A checkpoint's HF class, or a GGUF's architecture, is not supported."""


class CheckpointError(GGUFKitError, ValueError):
    """A Hugging Face checkpoint is incomplete, inconsistent or unsafe to load."""


class TensorMappingError(GGUFKitError, ValueError):
    """Source tensors that no rule consumes, or required GGUF tensors that nothing produces."""


class TokenizerError(GGUFKitError, ValueError):
    """A vocabulary cannot be converted or rebuilt, or a pre-tokenizer cannot be identified."""


class EvaluationError(GGUFKitError, ValueError):
    """The evaluator cannot run on this input (too few tokens, unsupported architecture or type)."""


class CheckFailedError(GGUFKitError):
    """A check ran and failed: a quality gate, a fidelity check. The output, if any, is kept."""

    exit_code = EXIT_CHECK_FAILED


def did_you_mean(word: str, choices: list[str]) -> str:
    """``"did you mean Q4_K_M? "`` for a near miss of one of ``choices`` (case, ``_`` and ``-`` ignored), else ``""``.

    Meant to stand before the list of choices in an error message: ``f"unknown type {w!r}; {did_you_mean(w, c)}
    choose one of ..."``.
    """
    import difflib

    def key(text: str) -> str:
        return text.lower().replace("_", "").replace("-", "")

    keyed = {key(c): c for c in choices}
    match = difflib.get_close_matches(key(word), list(keyed), n=1, cutoff=0.6)
    return f"did you mean {keyed[match[0]]}? " if match else ""
