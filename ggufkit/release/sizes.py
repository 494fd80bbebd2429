"""Exact file sizes for ``release --dry-run``, before any file exists.

The master's size follows from the converter's dry-run plan (its header, written as
:func:`ggufkit.format.write_gguf` writes it, plus the aligned tensor data). Each type's size is that of the
file ``quantize_file`` writes: llama-quantize's plan (llama.cpp src/llama-quant.cpp:
llama_model_quantize_impl, llama_tensor_get_type) computed on the master, and the header it writes with it
(:func:`ggufkit.quant.llama_quantize.pipeline.predict_file_size`). Before the master exists, the plan is computed on a
*skeleton* master: the real master's header in a sparse file of the master's size whose data is a hole, so
nothing is converted and nothing but the header takes disk space. Before the importance matrix exists, its
header fields are those it will have (the file name, the calibration text's name, a sha256's 64 digits); only
their lengths matter to the size.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ggufkit.release.plan import ReleasePlan, master_holds_mxfp4


def _header_and_size(cplan: Any, split_max_size: int | None = None) -> tuple[bytes, int, int]:
    """A converter plan's header bytes, its file size and its shard count (write_gguf's layout)."""
    from ggufkit.constants import DEFAULT_SLACK_BYTES
    from ggufkit.format.reader import align_up
    from ggufkit.format.writer import (
        TensorSpec,
        alignment_of,
        encode_header,
        plan_shards,
        tensor_offsets,
        with_slack,
    )

    specs = [TensorSpec(e.name, e.ggml_type, e.shape) for e in cplan.entries]
    alignment = alignment_of(cplan.metadata)
    header = encode_header(cplan.magic, with_slack(cplan.metadata, DEFAULT_SLACK_BYTES), specs,
                           tensor_offsets(specs, alignment))
    size = align_up(len(header), alignment) + sum(align_up(s.nbytes, alignment) for s in specs)
    return header, size, len(plan_shards(specs, alignment, split_max_size, None))


def converted_size(cplan: Any) -> int:
    """The exact size of the single file a converter plan writes."""
    return _header_and_size(cplan)[1]


def _stand_in_imatrix(plan: ReleasePlan, master: Any) -> Any:
    """The importance matrix as the quant step will pass it (its own file when it exists or is given, else
    one with the header fields the collected file will have and an entry per matrix)."""
    import dataclasses

    import numpy as np

    from ggufkit.quant.imatrix.reader import Imatrix, load_imatrix

    if not plan.use_imatrix or plan.imatrix_file is None:
        return None
    o = plan.options
    existing = o.imatrix if o.imatrix is not None else plan.outdir / plan.imatrix_file
    if Path(existing).is_file():
        return dataclasses.replace(load_imatrix(existing), path=Path(plan.imatrix_file))
    entries = {t.name: np.zeros(int(np.prod(t.shape[:-2], dtype=np.int64)) * t.shape[-1], np.float32)
               for t in master.tensors if len(t.shape) >= 2 and t.name != "token_embd.weight"}
    name = plan.imatrix_text.name if plan.imatrix_text is not None else ""
    return Imatrix(Path(plan.imatrix_file), entries, (name,), chunk_count=1, sha256="0" * 64)


def type_sizes(plan: ReleasePlan, qtypes: list[str]) -> tuple[int | None, dict[str, int]]:
    """The master's exact size (None when it would be sharded) and each preset type's (MIX entries and a
    sharded master are left out: their sizes come from a search, or from several files)."""
    from ggufkit.format import open_gguf
    from ggufkit.quant.llama_quantize.pipeline import predict_file_size, quantize_file

    cplan = plan.master_plan
    header, size, shards = _header_and_size(cplan, plan.options.split_max_size)
    if shards != 1:
        return None, {}
    with tempfile.TemporaryDirectory(prefix="ggufkit-release-") as tmp:
        master = plan.outdir / plan.master_file()
        if not master.is_file():
            master = Path(tmp) / plan.master_file()
            with open(master, "wb") as f:
                f.write(header)
                f.truncate(size)  # a hole: the data is never read by the plan
        out = {}
        with open_gguf(master) as model:
            im = _stand_in_imatrix(plan, model)
            for qtype in qtypes:
                report = quantize_file(master, None, qtype, imatrix=im, dry_run=True, device="cpu",
                                       **({"allow_requantize": True} if master_holds_mxfp4(plan.master_plan) else {}))
                out[qtype] = predict_file_size(model, report.plan, im if report.plan.options.imatrix_sizes
                                               is not None else None)
    return size, out
