"""The quantized files the suite holds against llama.cpp, built by llama.cpp's quantizer before the tests run (`make
quantized-fixtures`, a step of `make test`'s setup) into services.testing.tiny_gguf.QUANT_CACHE, where the tests'
quantize_preset finds them: every preset of PRESETS of the tiny files of tests/test_real_files.py and each one's F32
dequantization (its exact reference), SmolLM2 requantized to REAL_FILE_PRESETS, Gemma 3 270M's F32. A test finds a
file missing builds it the same way; built here, ~5 min of the quantizer on a fresh 2-core machine leave the suite's
test phase. A stamp named after the jobs says they are all built: a second run does nothing.

    python -m tests.quantized_fixtures
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

from tqdm import tqdm

from services.testing.tiny_gguf import PRESETS, QUANT_CACHE, PresetRefused, quantize_preset
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from tests.test_real_files import REAL_FILE_PRESETS, write_sources


def jobs(folder: str) -> list[tuple[str, str, bool]]:
    """(source file, preset, whether its F32 dequantization is wanted too) for every file the suite quantizes."""
    out = [(src, preset, True) for src in write_sources(folder).values() for preset in PRESETS]
    out += [(resolve_model("smollm2"), preset, False) for preset in REAL_FILE_PRESETS]
    try:
        out.append((resolve_model("gemma3-270m"), "F32", False))
    except Exception:  # not assembled here: its tests say so themselves
        pass
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        todo = jobs(folder)
        key = hashlib.sha256(repr([(GgufLoader(src).fingerprint, p, f) for src, p, f in todo]).encode()).hexdigest()
        stamp = os.path.join(QUANT_CACHE, f".fixtures-{key[:16]}")
        if os.path.exists(stamp):
            print(f"the suite's quantized files are built ({QUANT_CACHE})")
            return
        # (the bar on stdout: llama.cpp's quantizer logs every tensor on stderr, which make sends to a file)
        for src, preset, exact in tqdm(todo, desc="quantizing the suite's files", unit="file", file=sys.stdout):
            try:
                built = quantize_preset(src, preset)
                if exact:
                    quantize_preset(built, "F32")
            except PresetRefused:  # cached as refused: the test skips with llama.cpp's reason
                pass
        with open(stamp, "w") as f:
            f.write(f"{len(todo)} quantizations\n")


if __name__ == "__main__":
    main()
