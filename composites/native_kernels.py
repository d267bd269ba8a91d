"""One-pass CPU kernels for the fused bodies: a small C file generated here, compiled with gcc on first use (1-5 s on
the loaded development machine: it includes no PyTorch header; cached in ``~/.cache/multicomposite`` or
``MULTICOMPOSITE_KERNEL_CACHE``, keyed by source, compiler flags and CPU) and called through ctypes on the tensors'
memory.

Why not Inductor: ``torch.compile`` of the bit select took 1.48 ms warm on the development machine against 0.43 ms
for the eager bit formulation and 0.06 ms for one pass over the data, after 96 s of compilation (``python -m bench
--pieces --compile``). These kernels are one pass each: ``select`` reads the mask and both inputs once and writes
once (gcc vectorizes it); ``scatter_rows`` and ``gather_rows`` walk each row once with a running count of Trues,
branchless.

They move bits, so one kernel per element size serves every dtype of that size (float, int, bool); values are
copied exactly (NaN payloads, infinities, -0.0). Where gcc is missing or fails, ``available()`` is False and the
callers use the eager formulation; ``COMPILE_SECONDS`` keeps the first-use compile time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

import torch

from composites.shapes import broadcast_shape

_TYPES = {1: "uint8_t", 2: "uint16_t", 4: "uint32_t", 8: "uint64_t"}

_SOURCE_TEMPLATE = """
#include <stdint.h>
#define R __restrict__

/* out[r, c] = mask[r, c] ? a[r, c] : b[r, c] on the bits; a, b: full rows (cs 1) or one value per row (cs 0). */
void select_{n}(const uint8_t* R mask, const {t}* R a, int64_t a_rs, int64_t a_cs, const {t}* R b, int64_t b_rs,
                int64_t b_cs, {t}* R out, int64_t rows, int64_t cols) {{
  for (int64_t r = 0; r < rows; ++r) {{
    const uint8_t* R m = mask + r * cols;
    const {t}* R ar = a + r * a_rs;
    const {t}* R br = b + r * b_rs;
    {t}* R o = out + r * cols;
    if (a_cs && b_cs) {{
      for (int64_t c = 0; c < cols; ++c) o[c] = br[c] ^ ((ar[c] ^ br[c]) & ({t})(0 - ({t})m[c]));
    }} else if (b_cs) {{
      const {t} av = ar[0];
      for (int64_t c = 0; c < cols; ++c) o[c] = br[c] ^ ((av ^ br[c]) & ({t})(0 - ({t})m[c]));
    }} else if (a_cs) {{
      const {t} bv = br[0];
      for (int64_t c = 0; c < cols; ++c) o[c] = bv ^ ((ar[c] ^ bv) & ({t})(0 - ({t})m[c]));
    }} else {{
      const {t} av = ar[0], bv = br[0];
      for (int64_t c = 0; c < cols; ++c) o[c] = bv ^ ((av ^ bv) & ({t})(0 - ({t})m[c]));
    }}
  }}
}}

/* masked_scatter per row: the k-th True of row r takes src[r, k]; elsewhere self. Returns the number of rows with
   more Trues than src_cols (whose extra Trues read src[r, 0]: the caller raises). */
int64_t scatter_rows_{n}(const uint8_t* R mask, const {t}* R self, const {t}* R src, {t}* R out, int64_t rows,
                      int64_t cols, int64_t src_cols) {{
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {{
    const uint8_t* R m = mask + r * cols;
    const {t}* R s = self + r * cols;
    const {t}* R sr = src + r * src_cols;
    {t}* R o = out + r * cols;
    int64_t k = 0;
    for (int64_t c = 0; c < cols; ++c) {{
      const {t} keep = ({t})(0 - ({t})m[c]);
      const int64_t at = k < src_cols ? k : 0;
      o[c] = s[c] ^ ((sr[at] ^ s[c]) & keep);
      k += m[c];
    }}
    bad += k > src_cols;
  }}
  return bad;
}}

/* The adjoint: out[r, k] = values[r, c] for the k-th True c of row r, zeros after the last; out rows have
   out_cols + 1 elements (the last is scratch). */
void gather_rows_{n}(const uint8_t* R mask, const {t}* R values, {t}* R out, int64_t rows, int64_t cols,
                     int64_t out_cols) {{
  for (int64_t r = 0; r < rows; ++r) {{
    const uint8_t* R m = mask + r * cols;
    const {t}* R v = values + r * cols;
    {t}* R o = out + r * (out_cols + 1);
    int64_t k = 0;
    for (int64_t c = 0; c < cols; ++c) {{
      o[k < out_cols ? k : out_cols] = v[c];
      k += m[c];
    }}
    for (int64_t j = k < out_cols ? k : out_cols; j <= out_cols; ++j) o[j] = 0;
  }}
}}
"""

SOURCE = "#include <stdint.h>\n" + "\n".join(
    _SOURCE_TEMPLATE.format(n=size * 8, t=ctype) for size, ctype in _TYPES.items())

COMPILE_SECONDS: dict[str, float] = {}
_lock = threading.Lock()
_library: Any = None
_failed: str | None = None
_enabled = os.environ.get("MULTICOMPOSITE_NATIVE_KERNELS", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Use the compiled kernels (True, the default) or only the eager formulations (False)."""
    global _enabled
    _enabled = enabled


def _build() -> Any:
    global _library, _failed
    with _lock:
        if _library is not None or _failed is not None:
            return _library
        compiler = shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            _failed = "no C compiler (gcc or cc) on PATH"
            return None
        command = [compiler, "-O3", "-march=native", "-shared", "-fPIC"]
        # -march=native: the library is cached per source, compiler, flags and CPU, so it always fits the machine.
        digest = hashlib.sha256("\n".join([SOURCE, *command, _cpu_signature()]).encode()).hexdigest()[:20]
        library = os.path.join(_cache_dir(), f"kernels-{digest}.so")
        start = time.perf_counter()
        if not os.path.exists(library):
            try:  # built beside its cache entry, so the final rename stays on one filesystem
                os.makedirs(os.path.dirname(library), exist_ok=True)
                folder, cached = tempfile.mkdtemp(prefix="build-", dir=os.path.dirname(library)), True
            except OSError:  # an unwritable cache: build in a temporary folder and load it from there
                folder, cached = tempfile.mkdtemp(prefix="multicomposite-kernels-"), False
            source, built = os.path.join(folder, "kernels.c"), os.path.join(folder, "kernels.so")
            try:
                with open(source, "w") as file:
                    file.write(SOURCE)
                done = subprocess.run([*command, "-o", built, source], capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    _failed = f"{compiler} failed: {done.stderr.strip()[:300]}"
                    return None
                if cached:
                    os.replace(built, library)  # atomic: a concurrent process loads one whole library or the other
                else:
                    library = built
                    _library = _load(library)  # the mapping outlives the file, which goes with the folder
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if not cached:
                COMPILE_SECONDS["kernels.c"] = time.perf_counter() - start
                return _library
        COMPILE_SECONDS["kernels.c"] = time.perf_counter() - start
        _library = _load(library)
        return _library


def _load(library: str) -> Any:
    lib = ctypes.CDLL(library)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for bits in (8, 16, 32, 64):
        getattr(lib, f"select_{bits}").argtypes = [p, p, i64, i64, p, i64, i64, p, i64, i64]
        getattr(lib, f"scatter_rows_{bits}").argtypes = [p, p, p, p, i64, i64, i64]
        getattr(lib, f"scatter_rows_{bits}").restype = i64
        getattr(lib, f"gather_rows_{bits}").argtypes = [p, p, p, i64, i64, i64]
    return lib


def _cache_dir() -> str:
    return os.environ.get("MULTICOMPOSITE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "multicomposite")


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = [line for line in file if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def available() -> bool:
    """Whether the kernels can run here (compiling them on first call)."""
    return _enabled and _build() is not None


def failure() -> str | None:
    """Why the kernels are unavailable, or None."""
    return _failed


def usable(*tensors: torch.Tensor | None) -> bool:
    """Plain CPU tensors with memory of their own, of an element size the kernels handle (not wrapped by a
    transform, not a subclass, not complex128)."""
    from torch._C._functorch import (  # noqa: PLC2701 - functorch's bindings have no public API
        is_legacy_batchedtensor,
        maybe_get_level,
    )

    for t in tensors:
        if t is None:
            continue
        if (t.device.type != "cpu" or t.layout != torch.strided or t.element_size() not in _TYPES
                or type(t) not in (torch.Tensor, torch.nn.Parameter) or maybe_get_level(t) != -1
                or is_legacy_batchedtensor(t) or (t.requires_grad and torch.is_grad_enabled())
                # Forward AD's efficient zero tangents have no memory; conj and neg views are applied lazily.
                or t._is_zerotensor() or t.is_conj() or t.is_neg()):
            return False
    return available()


def _rows_operand(x: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """(tensor, row stride, column stride) of ``x`` broadcast to ``shape`` viewed as rows of ``shape[-1]``: full
    rows, or one value per row where ``x`` is constant along the last dimension; None is a zero."""
    cols = shape[-1] if len(shape) else 1
    if x is None:
        return torch.zeros(1, dtype=dtype), 0, 0
    if x.numel() == 1:
        return x.reshape(1).contiguous(), 0, 0
    if (x.dim() == 0 or x.shape[-1] == 1) and len(shape) and cols != 1:
        per_row = x.expand(*shape[:-1], 1).contiguous()
        return per_row, 1, 0
    return x.expand(shape).contiguous(), cols, 1


def select(mask: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``torch.where(mask, a, b)`` (None is zero) in one pass; the caller checked ``usable``."""
    like = a if a is not None else b
    shape = torch.Size(broadcast_shape(mask.shape, *(t.shape for t in (a, b) if t is not None)))
    dtype, bits = like.dtype, like.element_size() * 8
    out = torch.empty(shape, dtype=dtype)
    if out.numel() == 0:
        return out
    cols = shape[-1] if len(shape) else 1
    rows = out.numel() // cols
    flat_mask = mask.expand(shape).contiguous().view(torch.uint8)
    a_, a_rs, a_cs = _rows_operand(a, shape, dtype)
    b_, b_rs, b_cs = _rows_operand(b, shape, dtype)
    getattr(_library, f"select_{bits}")(flat_mask.data_ptr(), a_.data_ptr(), a_rs, a_cs, b_.data_ptr(), b_rs, b_cs,
                                        out.data_ptr(), rows, cols)
    return out


def scatter_rows(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Per row (the last dimension; ``self`` and ``mask`` of one shape, ``source`` with the same leading
    dimensions): the k-th True takes the row's k-th source element. Raises where a row has more Trues than its
    source has elements; the caller checked ``usable``."""
    out = torch.empty(self.shape, dtype=self.dtype)
    if out.numel() == 0:
        return out
    cols = self.shape[-1]
    rows = self.numel() // cols
    self_, mask_ = self.contiguous(), mask.contiguous().view(torch.uint8)
    source_ = source.contiguous()
    src_cols = source_.numel() // max(rows, 1)
    short = getattr(_library, f"scatter_rows_{self.element_size() * 8}")(
        mask_.data_ptr(), self_.data_ptr(), source_.data_ptr(), out.data_ptr(), rows, cols, src_cols)
    if short:
        raise RuntimeError(f"masked_scatter: {short} sample(s) of the mask have more Trues than source has "
                           f"elements ({src_cols}); give each sample a source at least that long")
    return out


def gather_rows(values: torch.Tensor, mask: torch.Tensor, out_cols: int) -> torch.Tensor:
    """Per row: the values at the row's Trues, in order, then zeros, ``out_cols`` of them."""
    cols = values.shape[-1]
    rows = values.numel() // max(cols, 1)
    out = torch.empty(rows, out_cols + 1, dtype=values.dtype)
    if values.numel() and out_cols:
        values_, mask_ = values.contiguous(), mask.contiguous().view(torch.uint8)
        getattr(_library, f"gather_rows_{values.element_size() * 8}")(mask_.data_ptr(), values_.data_ptr(),
                                                                      out.data_ptr(), rows, cols, out_cols)
    else:
        out.zero_()
    return out[:, :out_cols]
