"""llama.cpp's own convert_hf_to_gguf.py (kept by bench/build_llamacpp.sh beside llama-server)
run on a tiny Hugging Face folder: an independent writer of a family's GGUF layout.

NOTE: the converter names the BPE pre-tokenizer by a hash of the tokenizer's output and
refuses one it does not know; write_tiny_llama's 320-token byte-level BPE has none of the
known hashes, so the converter is told the name (`pre`: GPT-2's, the tiny tokenizer's own, or
the family's, as its released GGUFs name it). Everything else is the converter's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.server_proc import llamacpp_default

_RUN = """
import importlib, runpy, sys
convert, out, outtype, folder, pre, bpe_for = sys.argv[1:7]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
if bpe_for:
    module, cls = bpe_for.split(":")
    setattr(getattr(importlib.import_module(module), cls), "set_vocab", TextModel._set_vocab_gpt2)
sys.argv = [convert, folder, "--outfile", out, "--outtype", outtype, *sys.argv[7:]]
runpy.run_path(convert, run_name="__main__")
"""


def converter() -> Path:
    return llamacpp_default().parents[1] / "convert" / "convert_hf_to_gguf.py"


def require_llamacpp(path: Path) -> Path:
    """`path` (one of bench/build_llamacpp.sh's files), or the test skips (fails under
    CELLSERVE_REQUIRE_TOOLS=1)."""
    import pytest

    if not path.is_file():
        reason = f"no {path.name} at {path} (bench/build_llamacpp.sh builds it)"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{reason} (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    return path


def convert_with_llamacpp(
    folder: Path,
    out: Path,
    outtype: str = "f32",
    pre: str = "gpt-2",
    flags: tuple[str, ...] = (),
    bpe_for: str = "",
) -> Path:
    """folder -> out (a GGUF) by convert_hf_to_gguf.py with its own gguf-py; `pre`: the
    tokenizer.ggml.pre it writes; `flags`: more of its command-line options; `bpe_for`
    ("conversion.jamba:JambaModel"): a converter class whose own set_vocab expects another
    tokenizer (Jamba's: a Llama one) writes the tiny byte-level BPE as GPT-2's instead (the
    tensors and parameters are still its own)."""
    script = require_llamacpp(converter())
    paths = [str(script.parent), str(script.parent / "gguf-py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, "-c", _RUN, str(script), str(out), outtype, str(folder), pre, bpe_for]
    cmd += flags
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
