"""BLOCK8 deltas (:mod:`models.engines.weight_delta`) built and applied in one pass each, in C
(:mod:`kernels.native`): the sender's positions, given as the ascending pieces each trainer rank gathered (int32 or
int64 positions within its part, and its part's first element), become the per-block counts and the offsets without
an int64 copy of the positions, and a mode of steps its sign bits (SIGN) and its exceptions' ordinals; the engine's
tensor takes a delta straight from the payload (each element's bits plus its step, or its value), without the int64
positions, the gathered old values and the stepped new ones torch's path makes (five passes over the changed elements
and two over their positions).

The bytes are :func:`~models.engines.weight_delta.encode`'s and the result :func:`~models.engines.weight_delta.stepped`
and ``index_copy_``'s, bit for bit (tests/unit/kernels/test_block8.py). Each function returns None where it does not
apply and the caller takes torch's path: no C compiler, a block of 256 all changed (BLOCK8 cannot carry it), a target
other than a contiguous CPU tensor of the pushed dtype.
"""

from __future__ import annotations

import ctypes
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from kernels.native import as_tensor, compiled

__all__ = ["Head", "apply", "exceptions", "head", "library"]

SOURCE = r"""
#include <stdint.h>

/* Positions (ascending, within [0, numel)) into BLOCK8's head: counts[p >> 8] += 1 (zeroed by the caller), the k-th
   offset p & 255. Called once per piece (its positions plus its `start`), *last the last position so far (in and
   out). Returns 0; -1 where a block would count 256; -2 where a position is not after the last or not in numel. */
#define HEAD(NAME, T)                                                                                                 \
int NAME(const T *pos, int64_t n, int64_t start, int64_t numel, uint8_t *counts, uint8_t *offsets, int64_t *last) { \
    int64_t prev = *last;                                                                                             \
    for (int64_t k = 0; k < n; k++) {                                                                                 \
        int64_t p = (int64_t)pos[k] + start;                                                                          \
        if (p <= prev || p >= numel) return -2;                                                                       \
        uint8_t *c = counts + (p >> 8);                                                                               \
        if (*c == 255) return -1;                                                                                     \
        (*c)++;                                                                                                       \
        offsets[k] = (uint8_t)(p & 255);                                                                              \
        prev = p;                                                                                                     \
    }                                                                                                                 \
    *last = prev;                                                                                                     \
    return 0;                                                                                                         \
}
HEAD(head32, int32_t)
HEAD(head64, int64_t)

/* The ordinals of the steps a mode cannot carry (SIGN, sign != 0: other than +1 and -1; STEP8: -128), at most cap
   written; with `bits` (zeroed by the caller) SIGN's bit k set where steps[k] > 0 (LSB first). Returns their count.
   Eight steps a byte of bits, without a branch on a step's sign (half of them mispredicted otherwise); with AVX2, 32
   steps compared at once, the exceptions looked for only where a compare found one. */
static inline int odd(int8_t s, int sign) { return sign ? (s != 1 && s != -1) : (s == -128); }

static int64_t exceptions_from(const int8_t *steps, int64_t k, int64_t n, int sign, uint8_t *bits, int32_t *ordinals,
                               int64_t cap, int64_t e) {
    for (; k < n; k++) {
        int8_t s = steps[k];
        if (bits) bits[k >> 3] |= (uint8_t)((s > 0) << (k & 7));
        if (odd(s, sign)) {
            if (e < cap) ordinals[e] = (int32_t)k;
            e++;
        }
    }
    return e;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2")))
static int64_t exceptions_avx2(const int8_t *steps, int64_t n, int sign, uint8_t *bits, int32_t *ordinals,
                               int64_t cap) {
    const __m256i plus = _mm256_set1_epi8(1), minus = _mm256_set1_epi8(-1), lowest = _mm256_set1_epi8(-128);
    const __m256i zero = _mm256_setzero_si256();
    int64_t e = 0, k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i s = _mm256_loadu_si256((const __m256i *)(steps + k));
        if (bits) {
            uint32_t up = (uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi8(s, zero));
            bits[(k >> 3)] = (uint8_t)up;
            bits[(k >> 3) + 1] = (uint8_t)(up >> 8);
            bits[(k >> 3) + 2] = (uint8_t)(up >> 16);
            bits[(k >> 3) + 3] = (uint8_t)(up >> 24);
        }
        __m256i fine = sign ? _mm256_or_si256(_mm256_cmpeq_epi8(s, plus), _mm256_cmpeq_epi8(s, minus))
                            : _mm256_xor_si256(_mm256_cmpeq_epi8(s, lowest), _mm256_set1_epi8(-1));
        uint32_t m = ~(uint32_t)_mm256_movemask_epi8(fine);
        for (; m; m &= m - 1) {
            if (e < cap) ordinals[e] = (int32_t)(k + __builtin_ctz(m));
            e++;
        }
    }
    return exceptions_from(steps, k, n, sign, bits, ordinals, cap, e);
}

static int avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
#define exceptions_avx2(steps, n, sign, bits, ordinals, cap) exceptions_from(steps, 0, n, sign, bits, ordinals, cap, 0)
static int avx2(void) { return 0; }
#endif

int64_t exceptions(const int8_t *steps, int64_t n, int sign, uint8_t *bits, int32_t *ordinals, int64_t cap,
                   int simd) {
    if (simd && avx2()) return exceptions_avx2(steps, n, sign, bits, ordinals, cap);
    return exceptions_from(steps, 0, n, sign, bits, ordinals, cap, 0);
}

/* A BLOCK8 delta into `t` (numel elements): the k-th changed element (block by block, the offsets in order) takes
   values[k] (mode 0), its bits plus steps[k] (mode 16, int8) or plus one where bit k of steps is set, minus one where
   not (mode 32), wrapping at the width; the e-th exception (ordinals ascending) exact[e]. Checks first, writes only
   if all hold: returns 0; -1 where the counts do not add up to `count` or a position is past numel; -2 where the
   ordinals are not ascending within count. */
#define APPLY(NAME, T)                                                                                                \
int NAME(T *t, int64_t numel, const uint8_t *counts, const uint8_t *offsets, int64_t count, int mode,              \
         const T *values, const uint8_t *steps, int64_t n_exact, const int32_t *ordinals, const T *exact) {          \
    int64_t blocks = (numel + 255) >> 8, total = 0;                                                                   \
    for (int64_t b = 0; b < blocks; b++) total += counts[b];                                                          \
    if (total != count) return -1;                                                                                    \
    if (blocks && counts[blocks - 1]) {                                                                               \
        for (int64_t k = count - counts[blocks - 1]; k < count; k++)                                                  \
            if (((blocks - 1) << 8) + offsets[k] >= numel) return -1;                                                 \
    }                                                                                                                 \
    for (int64_t e = 0; e < n_exact; e++)                                                                             \
        if (ordinals[e] < 0 || ordinals[e] >= count || (e && ordinals[e] <= ordinals[e - 1])) return -2;             \
    int64_t k = 0, e = 0;                                                                                             \
    for (int64_t b = 0; b < blocks; b++) {                                                                            \
        T *base = t + (b << 8);                                                                                       \
        for (int c = counts[b]; c; c--, k++) {                                                                        \
            T *at = base + offsets[k];                                                                                \
            if (e < n_exact && ordinals[e] == k) { *at = exact[e++]; continue; }                                      \
            if (mode == 0) *at = values[k];                                                                           \
            else if (mode == 16) *at = (T)(*at + (T)(int8_t)steps[k]);                                                \
            else *at = (T)(*at + (((steps[k >> 3] >> (k & 7)) & 1) ? (T)1 : (T)-1));                                  \
        }                                                                                                             \
    }                                                                                                                 \
    return 0;                                                                                                         \
}
APPLY(apply16, uint16_t)
APPLY(apply32, uint32_t)
"""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_HEAD = (_INT, [_P, _I64, _I64, _I64, _P, _P, _P])
_APPLY_ARGS = (_INT, [_P, _I64, _P, _P, _I64, _INT, _P, _P, _I64, _P, _P])
_FUNCTIONS = {"head32": _HEAD, "head64": _HEAD, "exceptions": (_I64, [_P, _I64, _INT, _P, _P, _I64, _INT]),
              "apply16": _APPLY_ARGS, "apply32": _APPLY_ARGS}
_HEADS = {torch.int32: "head32", torch.int64: "head64"}
_APPLY = {2: ("apply16", torch.int16), 4: ("apply32", torch.int32)}


def library() -> Optional[ctypes.CDLL]:
    return compiled("block8", SOURCE, _FUNCTIONS)


class Head(NamedTuple):
    """BLOCK8's positions: ``[ceil(numel / 256)]`` uint8 counts and ``[count]`` uint8 offsets."""

    counts: torch.Tensor
    offsets: torch.Tensor


def head(pieces: Sequence[Tuple[torch.Tensor, int]], numel: int) -> Optional[Head]:
    """The BLOCK8 head of the positions in ``pieces`` (each ``(positions, start)``: int32 or int64 positions,
    ascending, within a part whose first element is at ``start``; the pieces in order), or None where a block has all
    256 elements changed or no C compiler builds the kernel. :class:`ValueError` where the positions are not ascending
    or fall outside ``numel``."""
    lib = library()
    if lib is None or any(p.dtype not in _HEADS or p.device.type != "cpu" for p, _ in pieces):
        return None
    counts = np.zeros(-(-numel // 256), np.uint8)
    offsets = np.empty(sum(p.numel() for p, _ in pieces), np.uint8)
    last, at = np.full(1, -1, np.int64), 0
    for positions, start in pieces:
        positions = positions.contiguous()
        got = getattr(lib, _HEADS[positions.dtype])(positions.data_ptr(), positions.numel(), int(start), numel,
                                                     counts.ctypes.data, offsets[at:].ctypes.data, last.ctypes.data)
        if got == -1:
            return None
        if got:
            raise ValueError(f"positions of a delta not ascending within its {numel} elements (a piece from {start})")
        at += positions.numel()
    return Head(as_tensor(counts), as_tensor(offsets))


def exceptions(steps: torch.Tensor, sign: bool, expected: Optional[int] = None, vectorised: bool = True
               ) -> Optional[Tuple[Optional[torch.Tensor], torch.Tensor]]:
    """The steps' (int8, on the CPU) exceptions to SIGN (``sign``) or STEP8: SIGN's bits (``[ceil(n / 8)]`` uint8, LSB
    first; None for STEP8) and the exceptions' ordinals (int32, ascending); ``expected``: their count where known (the
    room for them); ``vectorised`` False: the scalar loop where AVX2 would run (both give the same). None where no C
    compiler builds the kernel."""
    lib = library()
    if lib is None or steps.dtype != torch.int8 or steps.device.type != "cpu":
        return None
    steps = steps.contiguous()
    n = steps.numel()
    bits = np.zeros(-(-n // 8), np.uint8) if sign else None
    cap = n if expected is None else expected
    ordinals = np.empty(max(cap, 1), np.int32)
    got = lib.exceptions(steps.data_ptr(), n, int(sign), None if bits is None else bits.ctypes.data,
                         ordinals.ctypes.data, cap, int(vectorised))
    if got > cap:  # (a wrong expectation: counted again with room for all)
        return exceptions(steps, sign, None, vectorised)
    return (None if bits is None else as_tensor(bits)), as_tensor(ordinals[:got].copy())


def apply(target: torch.Tensor, head: Head, mode: int, carried: torch.Tensor, ordinals: torch.Tensor,
          exact: torch.Tensor) -> bool:
    """A BLOCK8 delta written into ``target`` (flat, contiguous, on the CPU, of the pushed dtype: the engine's own
    memory): ``mode`` 0 with ``carried`` the values, 16 (STEP8) with int8 steps, 32 (SIGN) with the sign bits;
    ``ordinals`` (int32, ascending) and ``exact`` (values) the exceptions. False where it does not apply (no C
    compiler, another layout or dtype); :class:`ValueError` where the delta does not fit ``target`` (nothing
    written)."""
    lib = library()
    kind = _APPLY.get(target.element_size())
    if (lib is None or kind is None or target.device.type != "cpu" or not target.is_contiguous()
            or not target.dtype.is_floating_point or (mode == 0 and carried.dtype != target.dtype)
            or exact.dtype != target.dtype):
        return False
    name, as_int = kind
    keep: List[torch.Tensor] = [t.contiguous() for t in (head.counts, head.offsets, carried, ordinals, exact)]
    counts, offsets, carried, ordinals, exact = keep
    if counts.numel() != -(-target.numel() // 256) or ordinals.dtype != torch.int32:
        raise ValueError(f"a BLOCK8 delta of {counts.numel()} blocks for a tensor of {target.numel()} elements")
    got = getattr(lib, name)(target.view(as_int).data_ptr(), target.numel(), counts.data_ptr(), offsets.data_ptr(),
                             offsets.numel(), mode, carried.data_ptr(), carried.data_ptr(), ordinals.numel(),
                             ordinals.data_ptr(), exact.data_ptr())
    if got:
        raise ValueError("a BLOCK8 delta's counts do not add up to its offsets or run past its tensor" if got == -1
                         else "a BLOCK8 delta's exceptions are not ascending within its changed elements")
    return True
