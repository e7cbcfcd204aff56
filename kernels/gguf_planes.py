"""GGUF weights repacked once at load for GPU kernels: each block field in a plane of its own,
column-major (one column per output row), so that a warp's threads read neighbouring output rows
and every load is 16 bytes wide, whatever the type's block size; K-quant scales unpacked from
their 6 bits. Every plane is of 32-bit words (one thread layout for every tile a kernel loads);
the bytes are the file's, but for 4 more per 256 values in Q4_K and Q5_K (their 6-bit scales
and minimums in bytes) and 2 more in Q6_K (d in a word of its own).

Planes of a weight [N, K] (K = in_features padded to a multiple of 128; C = N padded to a multiple
of 256; each plane's rows C words wide; padding zero), for the values of one 32-value sub-block s:

    qs  [K/8, C]   4-bit types: word 4s + r holds values 8r..8r+3 of the sub-block in its low
                   nibbles (byte b: value 8r + b) and 8r+4..8r+7 in its high nibbles
        [K/4, C]   Q8_0: word 8s + r holds the signed bytes of values 4r..4r+3
    qh  [K/32, C]  Q5_0, Q5_K: bit 8b + 2r + h of word s is bit 4 of value 8r + 4h + b
        [K/16, C]  Q6_K: bits 8b + 4g + 2h, +1 of word t (16 values) are bits 4-5 of value
                   16t + 8g + 4h + b
    sm  [K/64, C]  Q4_K, Q5_K: bytes 2h, 2h + 1 of word w are sub-block 2w + h's 6-bit scale
                   and minimum; Q6_K: byte b of word w, the int8 scale of values 64w + 16b ..
    d   float16 pairs: K-quants [K/256, C] d | d_min << 16 (Q6_K: d); Q4_1 [K/32, C] d | m << 16;
                   Q4_0, Q5_0, Q8_0 [K/64, C] sub-block 2w's d | 2w + 1's << 16

Value (q the code, from qs and qh): Q8_0 d * q; Q4_0 d * (q - 8); Q5_0 d * (q - 16); Q4_1
d * q + m; Q4_K, Q5_K d * sc * q - d_min * mn; Q6_K d * sc * (q - 32).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import gguf
import torch

Q = gguf.GGMLQuantizationType
ALIGN = 256  # columns (C) a multiple of it: a GEMV program's output rows never pass the end
K_ALIGN = 128  # values: planes hold K padded to a multiple of it with zero codes and scales
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
HIGH_BITS = {Q.Q5_0: 1, Q.Q5_K: 1, Q.Q6_K: 2}
ROW_CHUNK = 8192  # output rows repacked at a time (bounds the temporaries)


def plane_specs(qtype: Q) -> dict[str, int]:
    """name -> values of a row of the weight per plane row (int32 planes)."""
    qtype = Q(qtype)
    specs = {"qs": 4 if qtype == Q.Q8_0 else 8}
    if qtype in HIGH_BITS:
        specs["qh"] = 16 if qtype == Q.Q6_K else 32
    if qtype in K_QUANTS:
        specs["sm"] = 64
    specs["d"] = 256 if qtype in K_QUANTS else (32 if qtype == Q.Q4_1 else 64)
    return specs


def _columns(out_features: int) -> int:
    return -(-out_features // ALIGN) * ALIGN


def padded_in_features(in_features: int) -> int:
    """The values of a row the planes hold (and the GEMV's quantized x): K_ALIGN's multiple."""
    return -(-in_features // K_ALIGN) * K_ALIGN


@functools.cache  # every GEMV call asks (Planes.pointers), for a model's few shapes
def _layout(qtype, out_features: int, in_features: int) -> tuple[dict, int]:
    """name -> (word offset, plane rows), and the total words."""
    columns, offset, layout = _columns(out_features), 0, {}
    padded = padded_in_features(in_features)
    for name, values in plane_specs(qtype).items():
        rows = padded // values
        layout[name] = (offset, rows)
        offset += rows * columns
    return layout, offset


def plane_nbytes(qtype, out_features: int, in_features: int) -> int:
    return 4 * _layout(qtype, out_features, in_features)[1]


class Planes(NamedTuple):
    """A repacked weight: `data` int32 holds every plane; `plane(name)` is one [rows, C] view."""

    qtype: Q
    out_features: int
    in_features: int
    data: torch.Tensor

    @property
    def columns(self) -> int:
        return _columns(self.out_features)

    @property
    def padded_subs(self) -> int:
        """32-value sub-blocks of a padded row (a multiple of 4)."""
        return padded_in_features(self.in_features) // 32

    def plane(self, name: str) -> torch.Tensor:
        layout, _ = _layout(self.qtype, self.out_features, self.in_features)
        if name not in layout:  # kernels take a pointer for every plane; unused ones get qs
            name = "qs"
        offset, rows = layout[name]
        return self.data[offset : offset + rows * self.columns].view(rows, self.columns)

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The planes in the kernels' argument order: qs, qh, sm, d."""
        return tuple(self.plane(name) for name in ("qs", "qh", "sm", "d"))


def empty_planes(qtype, out_features: int, in_features: int, device) -> Planes:
    words = _layout(qtype, out_features, in_features)[1]
    data = torch.zeros(words, dtype=torch.int32, device=device)
    return Planes(Q(qtype), out_features, in_features, data)


def repack(blocks: torch.Tensor, qtype, in_features: int) -> Planes:
    """[N, row_bytes] uint8 GGUF blocks -> Planes on blocks' device."""
    planes = empty_planes(qtype, blocks.shape[0], in_features, blocks.device)
    write_columns(planes, 0, blocks)
    return planes


def write_columns(planes: Planes, start: int, blocks: torch.Tensor) -> None:
    """Repack blocks [n, row_bytes] (any device) into columns start .. start + n of planes."""
    blocks = blocks.to(planes.data.device)
    for first in range(0, blocks.shape[0], ROW_CHUNK):
        chunk = blocks[first : first + ROW_CHUNK]
        column = start + first
        for name, words in _fields(chunk, planes.qtype, planes.in_features).items():
            plane = planes.plane(name)
            plane[: words.shape[1], column : column + chunk.shape[0]] = words.T


def _fields(blocks: torch.Tensor, qtype: Q, in_features: int) -> dict[str, torch.Tensor]:
    """name -> [n, plane rows] int32 words."""
    n = blocks.shape[0]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    per_block = blocks.reshape(n, in_features // block_values, block_bytes)
    codes, scales = _decode(per_block, qtype)
    codes = codes.reshape(n, in_features).to(torch.int32)
    fields = {"d": _scale_words(scales, qtype)}
    if qtype == Q.Q8_0:
        fields["qs"] = _bytes_to_words(codes.to(torch.uint8).view(n, -1, 4))
    else:
        fields["qs"] = _nibble_words(codes & 15)
    if qtype in HIGH_BITS:
        fields["qh"] = _high_words(codes >> 4, HIGH_BITS[qtype])
    if qtype in K_QUANTS:
        if qtype == Q.Q6_K:
            sub_scales = scales["sc"].view(torch.uint8)  # [n, K/16]
        else:  # sc, mn of each sub-block, side by side
            sub_scales = torch.stack((scales["sc"], scales["mn"]), dim=-1).reshape(n, -1)
        fields["sm"] = _bytes_to_words(sub_scales.view(n, -1, 4))
    return fields


def _scale_words(scales: dict, qtype: Q) -> torch.Tensor:
    """The d plane: float16 bits in pairs (the module's doc string)."""
    low = scales["d"].view(torch.int16).to(torch.int32) & 0xFFFF
    if "dm" in scales:
        return low | (scales["dm"].view(torch.int16).to(torch.int32) << 16)
    if qtype == Q.Q6_K:
        return low
    if low.shape[1] % 2:  # an odd count of 32-value blocks: a zero d pairs the last
        low = torch.cat((low, torch.zeros_like(low[:, :1])), dim=1)
    pairs = low.view(low.shape[0], -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 16)


def _bytes_to_words(values: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 -> [...] int32, byte b of each word from values[..., b]."""
    return values.contiguous().view(torch.int32).squeeze(-1)


def _nibble_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[n, K] 4-bit codes -> [n, K/8] words: byte b = value 8r + b | value 8r + 4 + b << 4."""
    groups = nibbles.view(nibbles.shape[0], -1, 2, 4)
    return _bytes_to_words((groups[:, :, 0] | (groups[:, :, 1] << 4)).to(torch.uint8))


def _high_words(high: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, K] high parts of the codes -> qh words (see the module's doc string)."""
    # a word's values 4j + b (j < 32 / (4 * bits) ... ): byte b takes bits `bits` * j
    per_word = 32 // bits
    groups = high.view(high.shape[0], -1, per_word // 4, 4)  # [n, words, j, b]
    shifts = torch.arange(0, 8, bits, device=high.device).view(1, 1, -1, 1)
    packed = (groups << shifts).sum(dim=2)  # disjoint bits: the sum is an OR
    return _bytes_to_words(packed.to(torch.uint8))


def _half(per_block: torch.Tensor, at: int) -> torch.Tensor:
    return per_block[:, :, at : at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[n, blocks, m] bytes -> [n, blocks, 2m]: the low nibbles, then the high ones."""
    return torch.cat((quants & 15, quants >> 4), dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[n, blocks, count / 8] little-endian bytes -> [n, blocks, count] bits (bit i of the
    little-endian integer at position i)."""
    shifts = torch.arange(8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:2], count)


def _decode(per_block: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, dict]:
    """[n, blocks, block_bytes] -> (codes [n, blocks, values] int, scales: d and (Q4_1, Q4_K,
    Q5_K) dm float16 [n, blocks]; K-quants' sc (and mn) per sub-block)."""
    if qtype == Q.Q6_K:
        return _decode_q6_k(per_block)
    b = per_block.to(torch.int32)
    n, blocks = b.shape[:2]
    fields = {"d": _half(per_block, 0)}
    if qtype == Q.Q8_0:
        return b[:, :, 2:34], fields
    if qtype == Q.Q4_0:
        return _nibbles(b[:, :, 2:18]), fields
    if qtype == Q.Q4_1:
        fields["dm"] = _half(per_block, 2)
        return _nibbles(b[:, :, 4:20]), fields
    if qtype == Q.Q5_0:
        return _nibbles(b[:, :, 6:22]) | (_bits(b[:, :, 2:6], 32) << 4), fields
    # Q4_K, Q5_K: d, d_min, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of high
    # bits: bit s of byte l is value 32s + l's), 128 bytes of nibbles in 64-value groups
    fields["dm"] = _half(per_block, 2)
    fields["sc"], fields["mn"] = (
        v.reshape(n, -1).to(torch.uint8) for v in _k_scales(b[:, :, 4:16])
    )
    quants_at = 16 if qtype == Q.Q4_K else 48
    quants = b[:, :, quants_at : quants_at + 128].reshape(n, blocks, 4, 32)
    codes = _nibbles(quants).reshape(n, blocks, 256)
    if qtype == Q.Q5_K:
        high = (
            b[:, :, 16:48].unsqueeze(2) >> torch.arange(8, device=b.device).view(1, 1, 8, 1)
        ) & 1
        codes = codes | (high.reshape(n, blocks, 256) << 4)
    return codes, fields


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, blocks, 12] -> 6-bit scales and minimums [n, blocks, 8] (ggml's get_scale_min_k4)."""
    low, high = scales[:, :, 0:4], scales[:, :, 8:12]
    scale = torch.cat((low & 63, (high & 15) | ((low >> 6) << 4)), dim=-1)
    minimum = torch.cat(
        (scales[:, :, 4:8] & 63, (high >> 4) | ((scales[:, :, 4:8] >> 6) << 4)), dim=-1
    )
    return scale, minimum


def _decode_q6_k(per_block: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d. In each half
    of 128 values: ql[l] low and high nibbles are values l and l + 64, ql[l + 32]'s l + 32 and
    l + 96; qh[l] bits 0-1, 2-3, 4-5, 6-7 are values l, l + 32, l + 64, l + 96's."""
    b = per_block.to(torch.int32)
    n, blocks = b.shape[:2]
    ql = b[:, :, 0:128].reshape(n, blocks, 2, 2, 32)  # [half, l // 32, l % 32]
    qh = b[:, :, 128:192].reshape(n, blocks, 2, 1, 32)
    low = torch.cat((ql & 15, ql >> 4), dim=3)  # [half, 4 quarters (l, l+32, l+64, l+96), 32]
    shifts = (2 * torch.arange(4, device=b.device)).view(1, 1, 1, 4, 1)
    codes = low | (((qh >> shifts) & 3) << 4)
    fields = {"sc": per_block[:, :, 192:208].reshape(n, -1).view(torch.int8),
              "d": _half(per_block, 208)}  # fmt: skip
    return codes.reshape(n, blocks, 256), fields
