"""Integer-dot matmuls over the GGUF's own blocks (Q4_0, Q4_1, Q8_0; Q4_K, Q5_0, Q5_K and Q6_K rewritten to blocks
of 32; Q2_K and Q3_K on their superblocks of 256, repacked), for CPUs whose best torch path is AVX2, and AVX512 ones where they measure faster than torch's int4 (why_not).

On such CPUs torch's int4 kernel widens every weight to float32 and multiplies in floats, and there is no native bf16:
one SmolLM2 decode step's matmuls took longer than llama.cpp's whole token. llama.cpp quantizes the activations to
8 bits per block of 32 and multiplies integers (AVX2's maddubs: 32 products per instruction); qdot.cpp does the same,
as torch ops (`torch.ops.stagemesh_qdot.q4_1 / q8_0 / q6_16 / q5_0 / q5_1 / q2_k / q3_k`, q6_16 Q6_K's 6-bit levels
with a scale per 16; q2_k and q3_k with the activations quantized per 256 as llama.cpp's q8_K), which
torch.compile's decode graphs call like any other op, over blocks of 8 rows interleaved (interleave: one maddubs
multiplies 8 rows at once, their sums side by side in one register). Same matrices: well under half int4's time; and
faster than the dense float32 kernel at every micro-batch size, so weights mode auto keeps no dense copy of them
(docs/models.md#what-each-type-runs-as---weights has the figures; benchmarks/decode_step.py measures the step).
Numerically it is llama.cpp's own scheme for these types (the activations' 8-bit rounding, fp16 block scales), with
the distance from an exact product that llama.cpp's own run of a quantized file has (for Q4_K and Q6_K llama.cpp
rounds the activations per 256; Q6_K's q6_16 per 16).

The ops are compiled from qdot.cpp once per machine (c++, seconds) into ~/.cache/stagemesh/kernels/ (where that is not
writable, the temporary directory's stagemesh-kernels/) under a name that hashes the source, torch's version and the
flags, and loaded from there afterwards. `why_not()` says whether they run here and, if not, why (no AVX2 + FMA +
F16C; an AVX512 CPU where torch's int4 kernel measured faster; no C++ compiler; STAGEMESH_QDOT=off);
where they do not, the int4 kernel runs as before.
The same library holds decode attention: one sequence's (`decode_attention`, which the compiled decode step calls,
attention.OneSequenceDecode) and a batch's (`decode_attention_batch`, the batched steps', attention.KernelDecode
and BatchDecode), on these CPUs for float32 layers without a soft cap (a sliding layer reads its window). It reads the
KV cache in place and each key and value row once, where torch's SDPA read it at a fraction of the memory's speed at
one token.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from shared.cpu import cpu_flags
from shared.kernels.plans import kernel_plan

log = logging.getLogger("stagemesh.qdot")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qdot.cpp")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
# where the CPU has AVX512-VNNI the dot products take one vpdpbusd (on 256-bit registers) for AVX2's three
# instructions, the same integers (qdot.cpp's add_products)
VNNI_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512_vnni": "-mavx512vnni"}
# where the CPU has AMX's tiles with bf16 and AVX512-BF16 (Sapphire Rapids and later Xeons), prefill-sized calls of
# q4_1 / q8_0 / q6_16 run on the tile units (qdot.cpp's amx_mm; amx_rows says from how many rows)
AMX_FLAGS = {"amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16", "avx512_bf16": "-mavx512bf16"}
AMX_OPS = ("q4_1", "q8_0", "q6_16")
AMX_ENV = "STAGEMESH_AMX"  # "off": never use the tiles
# the fewest rows a call takes to the tiles: two tiles of 16 rows share each dequantized weight tile; below that the
# dequantizing costs more than the tiles win (benchmarks/amx.py prints the curve: 0.6-1.0x at 16 rows, 0.96-1.4x at
# 24, 1.1-1.9x at 32 on the Q4_K / Q6_K matrices of the 1B and 3B shapes)
AMX_MIN_ROWS = 32
ENV = "STAGEMESH_QDOT"  # "off": never use the integer-dot kernels; "on": on an AVX512 CPU too, without measuring
# bytes per block of one row in the ops' layouts: blocks of 32 weights, q2_k's and q3_k's of 256 (BLOCK_WEIGHTS)
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q6_16": 28, "q5_0": 22, "q5_1": 24, "q2_k": 84, "q3_k": 114}
BLOCK_WEIGHTS = {"q2_k": 256, "q3_k": 256}  # Q2_K's and Q3_K's own superblocks (qdot.cpp's kquant_mm); others 32
# the scales leading each block, the bytes of each: fp16 d (and m), or q6_16's fp16 d and int8 scale of each half;
# q2_k's fp16 d and dmin and its 16 scale bytes (sc | m << 4), q3_k's fp16 d and 16 int8 scales
SCALES = {"q4_1": (2, 2), "q8_0": (2,), "q6_16": (2, 1, 1), "q5_0": (2,), "q5_1": (2, 2), "q2_k": (2, 2) + (1,) * 16,
          "q3_k": (2,) + (1,) * 16}
FIFTH_BIT_OPS = ("q5_0", "q5_1")  # their blocks end in 4 bytes of fifth bits (bit i: element i's), after the nibbles
GROUP_ROWS = 8  # rows whose blocks the ops' layout interleaves
CPU_FLAGS = ("avx2", "fma", "f16c")


def cache_dirs() -> list[str]:
    """Where a built library is looked for, in order, and built into: the first that is writable (a container with
    a read-only root filesystem has only its temporary directory)."""
    return [os.path.join(os.path.expanduser("~"), ".cache", "stagemesh", "kernels"),
            os.path.join(tempfile.gettempdir(), "stagemesh-kernels")]


def flags() -> list[str]:
    """The compiler's flags for this CPU: AVX2's, AVX512-VNNI's where it has all of it, and AMX's (with AVX512-BF16)
    on top of those where it has them too."""
    vnni = list(VNNI_FLAGS.values()) if all(f in cpu_flags() for f in VNNI_FLAGS) else []
    amx = list(AMX_FLAGS.values()) if vnni and all(f in cpu_flags() for f in AMX_FLAGS) else []
    return FLAGS + vnni + amx


def _library_name() -> str:
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(flags()).encode() + torch.__version__.encode()).hexdigest()[:16]
    return f"stagemesh_qdot-{digest}.so"


def _library_path() -> str:
    """The built library where one exists, else where to build it."""
    name = _library_name()
    for d in cache_dirs():
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    for d in cache_dirs():
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return os.path.join(d, name)
    return os.path.join(cache_dirs()[-1], name)


def build(path: str) -> None:
    """Compile qdot.cpp against this torch into `path` (written to a temporary name, then renamed: processes
    building at once each finish with a whole library)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ / g++) to build the integer-dot kernels; install g++")
    from torch.utils import cpp_extension

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [arg for inc in cpp_extension.include_paths() for arg in ("-isystem", inc)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [compiler, *flags(), abi, *includes, SOURCE, "-o", tmp, f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{torch_lib}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"building the integer-dot kernels failed ({compiler}):\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> str | None:
    """Build (once per machine) and load the ops. None when they are loaded; otherwise why they cannot run here."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "false", "no"):
        return f"turned off ({ENV}={os.environ[ENV]})"
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    path = _library_path()
    try:
        if not os.path.exists(path):
            log.info("building the integer-dot kernels (once per machine, a few seconds) into %s", path)
            build(path)
        torch.ops.load_library(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the integer-dot kernels are not available, int4 runs instead: %s", e)
        return str(e).splitlines()[0]
    global _fakes_registered
    if not _fakes_registered:
        for op in BLOCK_BYTES:
            torch.library.register_fake(f"stagemesh_qdot::{op}", _fake_mm)
        for op in ("decode_attention", "decode_attention_batch"):
            torch.library.register_fake(f"stagemesh_qdot::{op}", _fake_attention)
        _fakes_registered = True
    return None


_fakes_registered = False


def _fake_mm(x: torch.Tensor, blocks: torch.Tensor, n: int, tile_rows: int = 0) -> torch.Tensor:
    """The ops' output for tracing (torch.compile): [M, N] float32."""
    return x.new_empty(x.shape[0], n)


def _fake_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot, ctx, scale: float,
                    window: int = 0):
    """Either decode attention's output for tracing: q's shape (slot and ctx: ints, or [B] tensors for the batch)."""
    return q.new_empty(q.shape)


@functools.cache
def why_not() -> str | None:
    """None where the weights' blocks run on these kernels: the ops load, on a CPU whose torch kernels are AVX2, or
    AVX512 where they measured faster than torch's int4 kernel at one token (ONE_TOKEN_PROBE, once per machine, kept
    in the kernel plans file). They had been kept to AVX2 on the belief that AVX512's bf16 int4 is faster; on an AMD
    Zen 4 they beat both int4 on a Q4_K matrix and int8 rows on a Q6_K lm_head, so the probe decides, not the ISA
    (docs/models.md#what-each-type-runs-as---weights). STAGEMESH_QDOT=on takes them without measuring. Otherwise why
    not (a stage's /info shows it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2" and not capability.startswith("AVX512"):
        return f"torch's kernels here are {capability}"
    if (why := load()) is not None:
        return why
    if capability != "AVX2" and os.environ.get(ENV, "").lower() != "on":
        # one choice for every process here, whatever its thread count: stages and the tools that check them (trace,
        # a local baseline) must run the same kernels, or their numbers differ
        faster, _ = kernel_plan(ONE_TOKEN_PROBE, _faster_at_one_token, lambda v: v in ("integer-dot", "int4"),
                                per_thread_count=False)
        if faster == "int4":
            return f"torch's kernels here are {capability}, and its int4 kernel measured faster at one token"
    return None


ONE_TOKEN_PROBE = "integer-dot or int4 for every thread count, one token through a 4096 x 4096 4-bit matrix"


def _faster_at_one_token() -> str:
    """"integer-dot" or "int4": the faster for one token's row through a 4096 x 4096 matrix of random 4-bit levels,
    as each holds it (q4_1 blocks interleaved; torch's int4 pack with bf16 scales), each kernel's best of 5 timings of
    10 calls, taken in turn."""
    import time

    n = k = 4096
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32)
    groups = levels.view(n, k // 32, 32).to(torch.uint8)
    scales = torch.tensor([0.01, -0.08], dtype=torch.float16).view(torch.uint8).expand(n, k // 32, 4)
    blocks = interleave("q4_1", torch.cat([scales, groups[..., :16] | (groups[..., 16:] << 4)], dim=-1).reshape(n, -1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    scales_and_zeros = torch.tensor([0.01, 0.0], dtype=torch.bfloat16).expand(k // 32, n, 2).contiguous()
    x = torch.randn(1, k)
    kernels = {"integer-dot": lambda: mm("q4_1", x, blocks, n),
               "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32,
                                                                          scales_and_zeros)}

    timed = {name: float("inf") for name in kernels}
    for kernel in kernels.values():
        kernel()
    for _ in range(5):  # in turn, so that a busy moment of the machine weighs on both
        for name, kernel in kernels.items():
            t0 = time.perf_counter()
            for _ in range(10):
                kernel()
            timed[name] = min(timed[name], (time.perf_counter() - t0) * 100)
    log.info("one token through a 4096 x 4096 4-bit matrix: %s", ", ".join(f"{k} {ms:.3f} ms" for k, ms in timed.items()))
    return min(timed, key=timed.get)


def usable() -> bool:
    return why_not() is None


@functools.cache
def amx_rows() -> int:
    """From how many rows a call of AMX_OPS runs on the AMX tiles (qdot.cpp's amx_mm: weights dequantized to bf16 on
    the fly, bf16 products summed in float32); 0 where it never does: the ops do not run here, the CPU or the compiler
    lacks AMX-BF16, the kernel refused this process the tile state (arch_prctl), or STAGEMESH_AMX=off. Below it, and
    for the other ops, the integer-dot path runs."""
    return AMX_MIN_ROWS if amx_why_not() is None else 0


@functools.cache
def amx_why_not() -> str | None:
    """None where AMX_OPS take prefill-sized calls to the tiles; otherwise why not (a stage's /info shows it)."""
    if os.environ.get(AMX_ENV, "").lower() in ("off", "0", "false", "no"):
        return f"turned off ({AMX_ENV}={os.environ[AMX_ENV]})"
    if (why := load()) is not None:
        return f"the integer-dot kernels do not run: {why}"
    if missing := [f for f in AMX_FLAGS if f not in cpu_flags()]:
        return f"the CPU lacks {', '.join(missing)}"
    if not torch.ops.stagemesh_qdot.amx_ready():
        return "the kernel did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def row_bytes(op: str, k: int) -> int:
    """The bytes of one row of K weights in the op's layout (K a multiple of its block)."""
    return k // BLOCK_WEIGHTS.get(op, 32) * BLOCK_BYTES[op]


def interleave(op: str, blocks: torch.Tensor) -> torch.Tensor:
    """A matrix's rows of blocks [N, row_bytes] (the op's layout: Q4_1's, Q8_0's, q6_16's, ..., q2_k's superblocks)
    -> the ops' layout [ceil(N/8), 8 * row_bytes]: rows 8 at a time (zero rows pad the last group), and for each group
    and block, each of the 8 rows' scales side by side, then their levels (and q6_16's high bits) 4 bytes of each row
    at a time (qdot.cpp's header)."""
    n, width = blocks.shape
    size, scales = BLOCK_BYTES[op], SCALES[op]
    nb, groups = width // size, -(-n // GROUP_ROWS)
    padded = blocks.new_zeros(groups * GROUP_ROWS, width)
    padded[:n] = blocks
    b = padded.view(groups, GROUP_ROWS, nb, size)
    parts, at = [], 0
    for each in scales:
        parts.append(b[..., at:at + each].permute(0, 2, 1, 3).reshape(groups, nb, each * GROUP_ROWS))
        at += each
    level_end = size - 4 if op in FIFTH_BIT_OPS else size
    levels = b[..., at:level_end].reshape(groups, GROUP_ROWS, nb, -1, 4).permute(0, 2, 3, 1, 4)
    parts.append(levels.reshape(groups, nb, -1))
    if op in FIFTH_BIT_OPS:
        parts.append(_fifth_bit_masks(b[..., level_end:]))
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _fifth_bit_masks(qh: torch.Tensor) -> torch.Tensor:
    """Each row's fifth bits qh [groups, 8 rows, blocks, 4 bytes] -> [groups, blocks, 32 bytes]: byte 4n + b holds
    at bit 2j + h row n's element 16h + 4j + b's, the element at that byte of the j-th 32 bytes of interleaved
    nibbles, low (h = 0) or high (qdot.cpp's header)."""
    groups, rows, nb, _ = qh.shape
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((qh[..., None] >> shifts) & 1).reshape(groups, rows, nb, 2, 4, 4)  # [.., n, block, h, j, b]
    bits = bits.permute(0, 2, 1, 5, 4, 3).reshape(groups, nb, 32, 8)  # [.., block, byte 4n + b, bit 2j + h]
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def mm(op: str, x: torch.Tensor, blocks: torch.Tensor, n: int, tile_rows: int = 0) -> torch.Tensor:
    """x [M, K] (any float dtype) @ the matrix [n, K] whose interleaved blocks these are -> [M, n] float32.
    tile_rows > 0 (AMX_OPS only; amx_rows()): a call of at least that many rows runs on the AMX tiles, where its rows'
    numbers are bf16 products' rather than the 8-bit scheme's; 0: the integer-dot path for every M, a row's result
    independent of M."""
    if tile_rows and op in AMX_OPS:
        return getattr(torch.ops.stagemesh_qdot, op)(x.float().contiguous(), blocks, n, tile_rows)
    return getattr(torch.ops.stagemesh_qdot, op)(x.float().contiguous(), blocks, n)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, ctx: int,
                     scale: float, window: int = 0) -> torch.Tensor:
    """One sequence's decode attention (qdot.cpp): q [H, hd] float32 against the first ctx positions of row `slot` of
    k_cache / v_cache [rows, KVH, max_seq, hd] (contiguous float32, float16 or bfloat16, read in place, widened to
    float32 as loaded) -> [H, hd]; slot and ctx may be
    a compiled graph's symbolic sizes. window > 0 (a sliding layer's): only the last `window` of those positions."""
    return torch.ops.stagemesh_qdot.decode_attention(q, k_cache, v_cache, slot, ctx, scale, window)


def decode_attention_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           ctxs: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """B sequences' decode attention (qdot.cpp), the batched steps' (eager and compiled): q [B, H, hd] float32,
    sequence b against the first ctxs[b] positions of row slots[b] of k_cache / v_cache (slots, ctxs [B] int64) ->
    [B, H, hd]. Row b's numbers are decode_attention's for that sequence alone, whatever else is in the batch.
    window: as decode_attention's."""
    return torch.ops.stagemesh_qdot.decode_attention_batch(q, k_cache, v_cache, slots, ctxs, scale, window)


def temper(logits: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """Sampling's tempered probabilities (qdot.cpp): logits [M, V] float32, inv_t [M] float32 -> exp((logits - each
    row's max) x its inv_t) [M, V], each row's largest 1. A row's numbers never depend on the other rows."""
    return torch.ops.stagemesh_qdot.temper(logits.contiguous(), inv_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (qdot.cpp): x [..., D] contiguous float32, weight [D] float32 -> [..., D], in one pass;
    a row's numbers never depend on the other rows. The eager step's norm (transformer.rms_norm)."""
    return torch.ops.stagemesh_qdot.rms_norm(x, weight, eps)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[slots[n], :, positions[n]] = k[n] and the same for v, in place, in one call (qdot.cpp): caches
    [rows, KVH, max_seq, hd] contiguous float32, float16 or bfloat16, slots / positions [N] int64, k / v
    [N, KVH, hd] of any float dtype (converted to the cache's, rounding to nearest even)."""
    torch.ops.stagemesh_qdot.write_kv(k_cache, v_cache, slots, positions, k.to(k_cache.dtype), v.to(v_cache.dtype))


def build_now() -> None:
    """`make install`: build the kernels at install time, so that no stage waits for them."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    why = load()
    print(f"integer-dot kernels: {'ready, ' + _library_path() if why is None else 'not used here: ' + why}")
