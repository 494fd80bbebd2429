"""SHA-256 of the whole file of every llama-quantize preset on the test models, with and without an imatrix.

A refactor that must not change any byte (issue 31) runs this before and after and compares the JSON:

    python benchmarks/hash_every_preset.py before.json      # on the old commit
    python benchmarks/hash_every_preset.py after.json       # on the new one
    cmp before.json after.json

The models are the ones tests/test_quant_presets_oracle.py plans against (built by tests/fixtures_quantize.py,
seeded, so both runs quantize the same bytes). A preset that refuses (an IQ type without an imatrix, Q1_0 on
288-wide rows) records its one-line error, which must not change either.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fixtures_quantize import (  # noqa: E402
    arch_case,
    imatrix_values,
    make_gguf,
    make_llama_gguf,
    write_imatrix_gguf,
)

from ggufkit.errors import GGUFKitError  # noqa: E402
from ggufkit.quant import quantize_file  # noqa: E402
from ggufkit.quant.llama_quantize.presets import PRESETS  # noqa: E402


def models(d: Path) -> dict[str, Path]:
    out = {
        "gqa4": make_llama_gguf(d / "gqa4.gguf", n_embd=256, n_ff=512, n_layer=4, n_head=4, n_head_kv=1,
                                n_vocab=256),
        "mha_tied_odd": make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=600, n_layer=2, n_head=4, n_head_kv=4,
                                        n_vocab=256, tied=True, seed=2),
    }
    for arch_name in ("mixtral", "qwen2"):
        arch, hp, tensors = arch_case(arch_name, n_layer=2)
        out[arch_name] = make_gguf(d / f"{arch_name}.gguf", arch, hp, tensors, seed=4)
    return out


def main(result_path: str) -> None:
    hashes: dict[str, str] = {}
    # A fixed folder: the imatrix's path is written into the file (quantize.imatrix.file).
    d = Path(tempfile.gettempdir()) / "ggufkit-hash-every-preset"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    for name, model in models(d).items():
        imatrix = write_imatrix_gguf(d / f"{name}.imatrix.gguf", imatrix_values(model))
        for preset in PRESETS:
            for im in (None, imatrix):
                key = f"{name}/{preset}/{'imatrix' if im else 'plain'}"
                out = d / "out.gguf"
                try:
                    quantize_file(model, out, preset, imatrix=im, threads=2)
                    hashes[key] = hashlib.sha256(out.read_bytes()).hexdigest()
                    out.unlink()
                except GGUFKitError as e:
                    hashes[key] = f"error: {e}"
                print(key, hashes[key][:16], flush=True)
    Path(result_path).write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
