"""One pass over a float32 weight for a delta push (``run.weight_push=delta``): its value at the engine's dtype
compared with the bits the engine holds, and for the elements that differ their flat positions, new bits and the int8
steps between the two bit patterns, without materialising the cast tensor.

:func:`changed_steps` computes exactly what the separate passes compute
(``new = w.to(dtype)``; ``changed(new, held)``; ``steps_of(new[idx], held[idx])`` of
:mod:`models.engines.weight_delta`): bfloat16's rounding is float32's to nearest, ties to even (torch's, c10's
``round_to_nearest_even``), the steps wrap at the element's width and are -128 outside -127..127. One C loop reads 6
bytes an element (bfloat16: 4 of the source, 2 held) and writes 11 per changed element, counting the steps SIGN and
STEP8 cannot carry as it goes; the separate passes read and write the whole tensor four times, and two more count the
exceptions and write the new values into the copy kept. Where the CPU has AVX2 (x86-64) the loop casts and compares 8
elements at a time and visits only the changed ones (2026-11-30, one core of the test machine, ``time.process_time``
around this function on 140M random float32 elements, 3.5 % of them changed: 0.086 s against 0.16 s for the scalar
loop; the separate passes took 0.54 s, ``benchmarks/bench_delta_push.py``'s profile of 2026-11-29).

The loop is C built on first use (:mod:`kernels.native`).

None where it does not apply, and the caller takes the separate passes: a source other than a contiguous float32
CPU tensor, an engine dtype other than bfloat16 or float32, a NaN in the source (torch's vectorised cast and its
scalar one give NaN different bits), more changed elements than ``capacity`` (then a sparse encoding rarely pays),
or no C compiler.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from kernels.native import as_tensor, compiled

__all__ = ["Changed", "changed_steps", "library", "simd", "warm"]

SOURCE = r"""
#include <stdint.h>

/* Each loop returns the count of elements whose bits differ (the first `cap` of them written), or -1 at a NaN
   (bfloat16's). The scalar loops take every element; the AVX2 ones (x86-64, where the CPU has it) compare 8 at a
   time and take only the changed ones, the rest of the tensor in the scalar loop. */

static inline int16_t bf16_of(uint32_t u) { return (int16_t)(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }

/* tally[0]: steps other than +1 and -1 (SIGN's exceptions); tally[1]: steps of -128 (STEP8's) */
static inline void step(int64_t d, int8_t *steps, int64_t c, int64_t *tally) {
    int8_t s = (d >= -127 && d <= 127) ? (int8_t)d : (int8_t)-128;
    steps[c] = s;
    tally[0] += (s != 1 && s != -1);
    tally[1] += (s == -128);
}

/* keep (NULL or held, writable): the new bits written there as the loop finds them (their cache line is in hand),
   the old ones kept in prev[c], so a pass that does not apply can put them back. */
typedef struct { void *keep; void *prev; } Keep;

static inline void put16(int64_t i, int16_t b, int16_t h, int64_t *pos, int16_t *out, int8_t *steps, int64_t c,
                         int64_t *tally, Keep k) {
    int32_t d = (int32_t)b - (int32_t)h;
    if (d > 32767) d -= 65536; else if (d < -32768) d += 65536;
    pos[c] = i; out[c] = b; step(d, steps, c, tally);
    if (k.keep) { ((int16_t *)k.prev)[c] = h; ((int16_t *)k.keep)[i] = b; }
}

static inline void put32(int64_t i, int32_t b, int32_t h, int64_t *pos, int32_t *out, int8_t *steps, int64_t c,
                         int64_t *tally, Keep k) {
    int64_t d = (int64_t)b - (int64_t)h;
    if (d > 2147483647LL) d -= 4294967296LL; else if (d < -2147483648LL) d += 4294967296LL;
    pos[c] = i; out[c] = b; step(d, steps, c, tally);
    if (k.keep) { ((int32_t *)k.prev)[c] = h; ((int32_t *)k.keep)[i] = b; }
}

static int64_t bf16_scalar(const uint32_t *src, const int16_t *held, int64_t i, int64_t n, int64_t *pos,
                           int16_t *out, int8_t *steps, int64_t cap, int64_t c, int64_t *tally, Keep kp) {
    for (; i < n; i++) {
        uint32_t u = src[i];
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) { tally[2] = c; return -1; }
        int16_t b = bf16_of(u);
        if (b != held[i]) {
            if (c < cap) put16(i, b, held[i], pos, out, steps, c, tally, kp);
            c++;
        }
    }
    return c;
}

static int64_t f32_scalar(const int32_t *src, const int32_t *held, int64_t i, int64_t n, int64_t *pos, int32_t *out,
                          int8_t *steps, int64_t cap, int64_t c, int64_t *tally, Keep kp) {
    for (; i < n; i++) {
        if (src[i] != held[i]) {
            if (c < cap) put32(i, src[i], held[i], pos, out, steps, c, tally, kp);
            c++;
        }
    }
    return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

int simd_available(void) { return __builtin_cpu_supports("avx2") ? 1 : 0; }

__attribute__((target("avx2")))
static int64_t bf16_avx2(const uint32_t *src, const int16_t *held, int64_t n, int64_t *pos, int16_t *out,
                         int8_t *steps, int64_t cap, int64_t *tally, Keep kp) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i nan = _mm256_setzero_si256();
    int64_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(src + i));
        nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(u, magnitude), inf));
        __m256i even = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), even), 16);
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(held + i)));
        unsigned m = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, h))) & 0xFFu;
        for (; m; m &= m - 1) {
            int64_t k = i + __builtin_ctz(m);
            if (c < cap) put16(k, bf16_of(src[k]), held[k], pos, out, steps, c, tally, kp);
            c++;
        }
    }
    if (!_mm256_testz_si256(nan, nan)) { tally[2] = c; return -1; }
    return bf16_scalar(src, held, i, n, pos, out, steps, cap, c, tally, kp);
}

__attribute__((target("avx2")))
static int64_t f32_avx2(const int32_t *src, const int32_t *held, int64_t n, int64_t *pos, int32_t *out,
                        int8_t *steps, int64_t cap, int64_t *tally, Keep kp) {
    int64_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i h = _mm256_loadu_si256((const __m256i *)(held + i));
        unsigned m = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, h))) & 0xFFu;
        for (; m; m &= m - 1) {
            int64_t k = i + __builtin_ctz(m);
            if (c < cap) put32(k, src[k], held[k], pos, out, steps, c, tally, kp);
            c++;
        }
    }
    return f32_scalar(src, held, i, n, pos, out, steps, cap, c, tally, kp);
}
#else
int simd_available(void) { return 0; }
#define bf16_avx2(src, held, n, pos, out, steps, cap, t, kp) \
    bf16_scalar(src, held, 0, n, pos, out, steps, cap, 0, t, kp)
#define f32_avx2(src, held, n, pos, out, steps, cap, t, kp) f32_scalar(src, held, 0, n, pos, out, steps, cap, 0, t, kp)
#endif

/* keep, prev: see Keep (NULL: held only read). tally[2]: the changed elements found (also where the pass fails). */
int64_t bf16_steps(const uint32_t *src, const int16_t *held, int64_t n, int64_t *pos, int16_t *out, int8_t *steps,
                   int64_t cap, int simd, int64_t *tally, int16_t *keep, int16_t *prev) {
    Keep kp = {keep, prev};
    tally[0] = tally[1] = 0;
    int64_t c = simd ? bf16_avx2(src, held, n, pos, out, steps, cap, tally, kp)
                     : bf16_scalar(src, held, 0, n, pos, out, steps, cap, 0, tally, kp);
    if (c >= 0) tally[2] = c;
    return c;
}

int64_t f32_steps(const int32_t *src, const int32_t *held, int64_t n, int64_t *pos, int32_t *out, int8_t *steps,
                  int64_t cap, int simd, int64_t *tally, int32_t *keep, int32_t *prev) {
    Keep kp = {keep, prev};
    tally[0] = tally[1] = 0;
    int64_t c = simd ? f32_avx2(src, held, n, pos, out, steps, cap, tally, kp)
                     : f32_scalar(src, held, 0, n, pos, out, steps, cap, 0, tally, kp);
    if (c >= 0) tally[2] = c;
    return c;
}

/* The old bits put back where a pass that kept its new ones failed: held[pos[k]] = prev[k]. */
void put_bits16(int16_t *held, const int64_t *pos, const int16_t *out, int64_t count) {
    for (int64_t k = 0; k < count; k++) held[pos[k]] = out[k];
}

void put_bits32(int32_t *held, const int64_t *pos, const int32_t *out, int64_t count) {
    for (int64_t k = 0; k < count; k++) held[pos[k]] = out[k];
}
"""

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_STEPS = (_I64, [_P, _P, _I64, _P, _P, _P, _I64, ctypes.c_int, _P, _P, _P])
_FUNCTIONS = {**{name: _STEPS for name in ("bf16_steps", "f32_steps")},
              **{name: (None, [_P, _P, _P, _I64]) for name in ("put_bits16", "put_bits32")},
              "simd_available": (ctypes.c_int, [])}


def library() -> Optional[ctypes.CDLL]:
    """The compiled loops (:func:`kernels.native.compiled`), or None where no C compiler builds them."""
    return compiled("bit_steps", SOURCE, _FUNCTIONS)


def warm() -> threading.Thread:
    """Build (or find) the library in a background thread: a trainer that will push deltas starts it when it
    starts, not at its first push. A call meanwhile waits for it."""
    thread = threading.Thread(target=library, name="bit-steps-build", daemon=True)
    thread.start()
    return thread


_KINDS = {torch.bfloat16: ("bf16_steps", "put_bits16", np.int16, torch.int16),
          torch.float32: ("f32_steps", "put_bits32", np.int32, torch.int32)}


class Changed(NamedTuple):
    """:func:`changed_steps`'s result: the changed elements' flat positions (int64, ascending), their new values at
    the kept dtype and their int8 steps, and how many of the steps SIGN and STEP8 cannot carry
    (:func:`models.engines.weight_delta.exceptions_of`)."""

    positions: torch.Tensor
    values: torch.Tensor
    steps: torch.Tensor
    exceptions: Tuple[int, int]


def simd() -> bool:
    """Whether the loops compare 8 elements at a time here (AVX2 on x86-64), or take every element."""
    lib = library()
    return bool(lib is not None and lib.simd_available())


def changed_steps(src: torch.Tensor, held: torch.Tensor, capacity: Optional[int] = None,
                  vectorised: Optional[bool] = None, keep: bool = False) -> Optional[Changed]:
    """``src`` (float32) at ``held``'s dtype against ``held``'s bits: the elements that differ (:class:`Changed`), or
    None where the pass does not apply (see the module's docstring). ``capacity``: the most changed elements to take
    (default a sixteenth of the elements, at least 1,024). ``keep``: the new values written into ``held`` as the loop
    finds them (their cache line in hand: no second pass over ``held``), the old ones put back where the pass does not
    apply (otherwise ``held`` is only read). ``vectorised`` False: the scalar loop where the AVX2 one would
    run (:func:`simd`; both give the same, bit for bit)."""
    kind = _KINDS.get(held.dtype)
    if (kind is None or src.dtype != torch.float32 or src.device.type != "cpu" or held.device.type != "cpu"
            or not src.is_contiguous() or not held.is_contiguous() or src.shape != held.shape):
        return None
    lib = library()
    if lib is None:
        return None
    name, put, np_int, torch_int = kind
    numel = src.numel()
    cap = min(numel, max(1024, numel // 16)) if capacity is None else capacity
    pos, new, steps = np.empty(cap, np.int64), np.empty(cap, np_int), np.empty(cap, np.int8)
    prev = np.empty(cap if keep else 0, np_int)  # the old bits of those written, while the pass may still fail
    tally = np.zeros(3, np.int64)
    wide = simd() and vectorised is not False  # (never AVX2 on a CPU without it)
    bits = held.view(torch_int).data_ptr()
    count = getattr(lib, name)(src.data_ptr(), bits, numel, pos.ctypes.data, new.ctypes.data, steps.ctypes.data, cap,
                               int(wide), tally.ctypes.data, bits if keep else None, prev.ctypes.data if keep else None)
    if count < 0 or count > cap:
        if keep:
            getattr(lib, put)(bits, pos.ctypes.data, prev.ctypes.data, min(int(tally[2]), cap))
        return None
    return Changed(as_tensor(pos[:count]), as_tensor(new[:count]).view(held.dtype), as_tensor(steps[:count]),
                   (int(tally[0]), int(tally[1])))
