// crc32c (Castagnoli CRC-32) arithmetic shared by the CUDA kernel and its host side.
//
// Convention (ckptq.checksums): the CRC of RFC 3720 §B.4 (iSCSI), polynomial 0x1EDC6F41, used in its
// bit-reflected form 0x82F63B78, register preset to 0xFFFFFFFF and inverted at the end; continuing
// from a previous value v presets the register to ~v. This is the value of the PyPI `crc32c`
// package's crc32c(data, value).
//
// Polynomials are stored reflected: bit 31 holds the coefficient of x^0, bit 0 that of x^31.
// Everything is linear over GF(2):
//   * raw(D) is the register after D when it starts at 0 (no preset, no inversion);
//   * a register r followed by n bytes becomes r * x^(8n) mod P  (the "shift" by n bytes);
//   * so raw(A || B) = shift(raw(A), |B|) ^ raw(B), and crc(D, v) = ~(shift(~v, |D|) ^ raw(D)).
// A long range is therefore hashed as independent pieces: each piece's raw CRC, shifted by the
// number of bytes after it, XORed together (the "CRC combine" of zlib's crc32_combine, Mark Adler,
// zlib 1.2.12 crc32.c, and of Intel's "Fast CRC Computation for iSCSI Polynomial Using CRC32
// Instruction", 2011). x^(8n) is a product of the powers x^(2^k) for the bits of 8n, from a table
// of x^(2^k) for k = 0..63 (each entry the square of the one before).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CKPTQ_HD __host__ __device__ __forceinline__
#else
#define CKPTQ_HD inline
#endif

namespace ckptq {
namespace crc {

constexpr uint32_t kPoly = 0x82F63B78u;  // x^32 + x^28 + ... + 1 (0x1EDC6F41), reflected
constexpr uint32_t kOne = 0x80000000u;   // the polynomial 1, reflected

// a * b mod P (both reflected). Bit by bit, from the x^0 coefficient of a upward, without branches.
CKPTQ_HD uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int i = 0; i < 32; ++i) {
    p ^= (0u - (a >> 31)) & b;  // a's coefficient of x^i set: add b * x^i
    a <<= 1;
    b = (b >> 1) ^ (kPoly & (0u - (b & 1u)));  // b *= x, reduced mod P
  }
  return p;
}

// x2n[k] = x^(2^k) mod P, k = 0..63.
struct X2N {
  uint32_t v[64];
};

inline X2N make_x2n() {
  X2N t{};
  t.v[0] = kOne >> 1;  // x^1
  for (int k = 1; k < 64; ++k) t.v[k] = multmodp(t.v[k - 1], t.v[k - 1]);
  return t;
}

// x^(8 n) mod P: the product of x^(2^(j+3)) over the set bits j of n (n < 2^61).
CKPTQ_HD uint32_t x8n(const uint32_t* x2n, uint64_t n) {
  uint32_t p = kOne;
  for (int k = 3; n != 0; ++k, n >>= 1)
    if (n & 1u) p = multmodp(x2n[k], p);
  return p;
}

// ---------------------------------------------------------------- the split of a byte range
// The range (n bytes at data) is hashed as independent pieces: the bytes before the first
// 16-byte-aligned address ("head", < 16) and after the last whole 16-byte word ("tail", < 16), byte
// by byte; the aligned words between, cut into `nseg` segments of `seg` bytes (a multiple of 64; the
// last one may be shorter), 16 bytes per step (slice-by-16 tables). The CUDA kernel gives each
// segment a thread; the CPU implementation (the same code, a test of it) a loop iteration.
struct Split {
  const uint8_t* data;
  uint64_t n;
  uint64_t head;  // bytes before data + head (min(.., n))
  uint64_t body;  // whole 16-byte words after the head, in bytes
  uint64_t seg;
  uint64_t nseg;
  X2N x2n;
};

// `seg` 0: about `workers` segments of at least 256 bytes; else `seg` rounded up to a multiple of 64.
inline Split make_split(const uint8_t* data, uint64_t n, uint64_t seg, uint64_t workers) {
  static const X2N x2n = make_x2n();
  Split a{};
  a.data = data;
  a.n = n;
  const uint64_t mis = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data) % 16);
  a.head = (16 - mis) % 16 < n ? (16 - mis) % 16 : n;
  a.body = (n - a.head) / 16 * 16;
  if (seg == 0) {
    const uint64_t per = a.body / (workers ? workers : 1);
    seg = per > 256 ? per : 256;
  }
  a.seg = (seg + 63) / 64 * 64;
  a.nseg = (a.body + a.seg - 1) / a.seg;
  a.x2n = x2n;
  return a;
}

// The register's start value: crc(D, v) = ~(x^(8n) * ~v) ^ raw(D), so the result is this XOR the pieces.
inline uint32_t start_value(const Split& a, uint32_t v) { return ~multmodp(x8n(a.x2n.v, a.n), ~v); }

using Tables = uint32_t[16][256];

// T[0][b]: raw CRC of the byte b; T[k][b]: of b followed by k zero bytes. Entries b = first,
// first + step, ... (threads of a block share the work: fill T[0], barrier, then fill_rest).
CKPTQ_HD void fill_first(Tables& T, int first, int step) {
  for (int b = first; b < 256; b += step) {
    uint32_t c = static_cast<uint32_t>(b);
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
    T[0][b] = c;
  }
}
CKPTQ_HD void fill_rest(Tables& T, int first, int step) {
  for (int b = first; b < 256; b += step) {
    uint32_t c = T[0][b];
    for (int k = 1; k < 16; ++k) {
      c = T[0][c & 0xffu] ^ (c >> 8);
      T[k][b] = c;
    }
  }
}

// raw CRC register c continued over len bytes at p, one byte at a time.
CKPTQ_HD uint32_t raw_bytes(const Tables& T, uint32_t c, const uint8_t* p, uint64_t len) {
  for (uint64_t i = 0; i < len; ++i) c = T[0][(c ^ p[i]) & 0xffu] ^ (c >> 8);
  return c;
}

struct W16 {
  uint32_t x, y, z, w;  // 16 bytes as little-endian words
};

// raw CRC register c continued over the 16 bytes of w: byte i is followed by 15 - i more bytes, so
// its lookup is in T[15 - i].
CKPTQ_HD uint32_t raw16(const Tables& T, uint32_t c, W16 w) {
  const uint32_t a = w.x ^ c;
  return T[15][a & 0xffu] ^ T[14][(a >> 8) & 0xffu] ^ T[13][(a >> 16) & 0xffu] ^ T[12][a >> 24] ^
         T[11][w.y & 0xffu] ^ T[10][(w.y >> 8) & 0xffu] ^ T[9][(w.y >> 16) & 0xffu] ^ T[8][w.y >> 24] ^
         T[7][w.z & 0xffu] ^ T[6][(w.z >> 8) & 0xffu] ^ T[5][(w.z >> 16) & 0xffu] ^ T[4][w.z >> 24] ^
         T[3][w.w & 0xffu] ^ T[2][(w.w >> 8) & 0xffu] ^ T[1][(w.w >> 16) & 0xffu] ^ T[0][w.w >> 24];
}

// 16 bytes at a 16-byte-aligned address.
CKPTQ_HD W16 load16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  return W16{v.x, v.y, v.z, v.w};
#else
  W16 w;
  std::memcpy(&w, p, 16);  // little-endian hosts (as ckptq.checksums requires)
  return w;
#endif
}

// Segment s's share of raw(D): its raw CRC times x^(8 * bytes after it).
CKPTQ_HD uint32_t segment_part(const Tables& T, const Split& a, uint64_t s) {
  const uint64_t begin = a.head + s * a.seg;
  const uint64_t stop = a.head + a.body;
  const uint64_t end = begin + a.seg < stop ? begin + a.seg : stop;
  const uint8_t* p = a.data + begin;
  const uint64_t words = (end - begin) / 16;
  uint32_t c = 0;
  uint64_t i = 0;
  for (; i + 4 <= words; i += 4) {  // four loads in flight, then four dependent steps
    const W16 w0 = load16(p + 16 * i), w1 = load16(p + 16 * (i + 1));
    const W16 w2 = load16(p + 16 * (i + 2)), w3 = load16(p + 16 * (i + 3));
    c = raw16(T, c, w0);
    c = raw16(T, c, w1);
    c = raw16(T, c, w2);
    c = raw16(T, c, w3);
  }
  for (; i < words; ++i) c = raw16(T, c, load16(p + 16 * i));
  return multmodp(x8n(a.x2n.v, a.n - end), c);
}

// The head's and the tail's share of raw(D).
CKPTQ_HD uint32_t edges_part(const Tables& T, const Split& a) {
  const uint32_t h = raw_bytes(T, 0, a.data, a.head);
  const uint64_t tail = a.head + a.body;
  return multmodp(x8n(a.x2n.v, a.n - a.head), h) ^ raw_bytes(T, 0, a.data + tail, a.n - tail);
}

}  // namespace crc
}  // namespace ckptq
