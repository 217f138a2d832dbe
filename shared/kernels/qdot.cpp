// Integer-dot matmuls over GGUF blocks for AVX2 CPUs: llama.cpp's scheme, as torch ops (shared/kernels/qdot.py);
// decode attention over the KV cache, one sequence (decode_attention) or a batch (decode_attention_batch); and
// sampling's tempered probabilities (temper), RMSNorm (rms_norm) and the K/V cache's writes (write_kv), at the end.
//
// y [M, N] float32 = x [M, K] float32 @ W^T, W [N, K] kept as the GGUF's own blocks of 32 weights:
//   q4_1: 20 bytes {fp16 d, fp16 m, 16 bytes of nibbles: byte i holds element i (low) and i + 16 (high)}, w = d q + m
//   q8_0: 34 bytes {fp16 d, 32 int8}, w = d q
//   q6_16: 28 bytes {fp16 d, int8 sc0, int8 sc1, 16 bytes of nibbles as q4_1's, 8 bytes of high bits: bits 2j, 2j + 1
//          of byte 4h + b are element 16h + 4j + b's bits 4, 5}, w = d sc0 (q - 32) for elements 0..15, d sc1 (q - 32)
//          for 16..31 (Q6_K's own numbers, its superblock's d repeated per block: linear.py's _rewritten_blocks)
//   q5_0: 22 bytes {fp16 d, 16 bytes of nibbles as q4_1's, 4 bytes: bit i is element i's fifth bit}, w = d (q - 16)
//   q5_1: 24 bytes {fp16 d, fp16 m, the same 20 bytes}, w = d q + m (Q5_0's and Q5_1's own bytes, reordered)
// with the rows taken 8 at a time (N padded with zero rows to a multiple of 8) and each block of the 8 interleaved
// (qdot.py's interleave), the same bytes in another order:
//   q4_1: 160 bytes {8 fp16 d, 8 fp16 m, 4 x 32 bytes: bytes 4n .. 4n+3 of the j-th are row n's bytes 4j .. 4j+3}
//   q8_0: 272 bytes {8 fp16 d, 8 x 32 bytes: bytes 4n .. 4n+3 of the j-th are row n's levels 4j .. 4j+3}
//   q6_16: 224 bytes {8 fp16 d, 8 int8 sc0, 8 int8 sc1, the 4 x 32 bytes of nibbles as q4_1's, 2 x 32 bytes of high
//          bits: byte 4n + b of the h-th holds row n's byte 4h + b}, so that a shift of the h-th 32 bytes puts the high
//          bits of the j-th's low (h = 0) or high (h = 1) nibbles at bits 4, 5 of each byte
//   q5_0 / q5_1: 176 / 192 bytes {8 fp16 d, (8 fp16 m,) the 4 x 32 bytes of nibbles as q4_1's, 32 bytes of fifth
//          bits: bit 2j + h of byte 4n + b is row n's element 16h + 4j + b's, the one at that byte of the j-th 32
//          bytes, in its low (h = 0) or high nibble}, so that a shift of the 32 bytes puts the fifth bits of the
//          j-th's low or high nibbles at bit 4 of each byte
// so one maddubs multiplies 4 levels of each of 8 rows by the same 4 activations (broadcast), and the 8 rows' sums
// build up in the 8 lanes of one register: no horizontal sums, one float scaling per block for 8 outputs.
// Each row of x is quantized first, per block of 32, as ggml's q8_1: q = round(x * 127 / amax) in int8, its scale
// d = amax / 127 and s = d * sum(q) each rounded to fp16, exactly as llama.cpp quantizes activations. A block's dot
// product is then exact in integers (maddubs: u8 x s8 pairs into int16, which cannot saturate for 4-bit levels nor,
// by ggml's sign trick, for 8-bit ones) and scaled in float32, block after block:
//   q4_1: y = sum_b d_w d_x dot(q_w, q_x) + m_w s_x        q8_0: y = sum_b d_w d_x dot(q_w, q_x)
//   q5_0: y = sum_b d_w d_x (dot(q_w, q_x) - 16 sum(q_x)), in integers as llama.cpp's dot of signed levels
//   q5_1: as q4_1, with 5-bit levels (int16 sums widened every 4 maddubs: 4 x 2 x 31 x 127 fits)
//   q6_16: y = sum_b d0_w d0_x dot(q_w, q_x)[0..15] + d1_w d1_x dot(q_w, q_x)[16..31] (d0_w = d sc0 exact in float32,
//          q_w the levels less 32, signed, by ggml's sign trick as q8_0's), the activations quantized
//          per 16 too (d0_x, d1_x: each half's own amax / 127): per 32, Gemma 3's Q6_K ffn_down inputs (a few large
//          values among small ones) cost 2.5 % of perplexity
// The float sums run in one order per output element, whatever M is and however the rows are split over threads:
// a row's result never depends on the rows that came with it (the batch-invariant mode relies on it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights (and activations) per block
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead of the block being multiplied its successors are fetched
enum Layout { Q4_1, Q8_0, Q6_16, Q5_0, Q5_1 };  // the weights' block layouts (above)
constexpr int64_t group_bytes(Layout layout) {  // 8 rows' blocks of 32, interleaved
  constexpr int64_t row_bytes[] = {20, 34, 28, 22, 24};  // per Layout, in its order
  return 8 * row_bytes[layout];
}

// x [M, K] quantized per block of 32: q [M, K] int8, d and s [M, K/32] float (fp16-rounded), sum [M, K/32] the
// levels' sum; for q6_16 weights per half block (16), d and sum [M, K/16] and no s
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

inline float fp16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, 0)); }

inline int32_t load_i32(const int8_t *p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Partial dot products of u8 x s8 bytes, 4 adjacent pairs per int32 lane of the result. Where the library is built
// with AVX512-VNNI (qdot.py's flags, on CPUs that have it), one vpdpbusd adds them into int32 lanes; on AVX2, maddubs
// adds pairs into int16 lanes, which the callers let build up only as far as int16 holds (the bounds beside each) and
// then widen. The integers are exact either way, so both builds give the same numbers.
inline __m256i add_products(__m256i partial, __m256i u, __m256i s) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(partial, u, s);
#else
  return _mm256_add_epi16(partial, _mm256_maddubs_epi16(u, s));
#endif
}

// int32 lanes plus the products (the AVX2 build widens at once: for 8-bit levels a pair's sum is all int16 holds)
inline __m256i add_products_wide(__m256i sums, __m256i u, __m256i s) {
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(sums, u, s);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// a partial sum's int32 lanes (row n's sum in lane n)
inline __m256i widen(__m256i partial) {
#ifdef __AVX512VNNI__
  return partial;
#else
  return _mm256_madd_epi16(partial, _mm256_set1_epi16(1));
#endif
}

inline float hmax8(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

template <bool HALVES>
Q8Rows quantize_rows(const float *x, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / QK);
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<float>(HALVES ? 2 * blocks : blocks),
             std::vector<float>(HALVES ? 0 : blocks), std::vector<int32_t>(HALVES ? 2 * blocks : blocks)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // a prefill's many rows over the threads; a decode step's few blocks inline (under the grain)
  at::parallel_for(0, blocks, 512, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++) {
      const float *xb = x + i * QK;
      __m256 v[4], amax[2];
      for (int j = 0; j < 4; j++) v[j] = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j));
      amax[0] = _mm256_max_ps(v[0], v[1]);
      amax[1] = _mm256_max_ps(v[2], v[3]);
      if constexpr (!HALVES) amax[0] = amax[1] = _mm256_max_ps(amax[0], amax[1]);
      __m256 id[2];
      float d[2];
      for (int h = 0; h < 2; h++) {
        const float mx = hmax8(amax[h]);
        d[h] = mx / 127.0f;
        id[h] = _mm256_set1_ps(mx != 0.0f ? 127.0f / mx : 0.0f);
        out.d[HALVES ? 2 * i + h : i] = fp16_round(d[h]);
      }
      // half to even, as ggml's _MM_ROUND_NEAREST
      constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i q[4];
      for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), id[j / 2]), nearest));
      if constexpr (HALVES) {
        for (int h = 0; h < 2; h++) {
          __m256i sum = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
          __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
          s4 = _mm_hadd_epi32(s4, s4);
          s4 = _mm_hadd_epi32(s4, s4);
          out.sum[2 * i + h] = _mm_cvtsi128_si32(s4);
        }
      } else {
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        out.sum[i] = _mm_cvtsi128_si32(s4);
        out.s[i] = fp16_round(d[0] * static_cast<float>(out.sum[i]));
      }
      // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute puts them back
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(out.q.data() + i * QK), p);
    }
  });
  return out;
}

// `width` bits of each byte from bit `bit` on moved to bit 4 (bit + width <= 8), every other bit 0: a 16-bit shift,
// whose bits crossing into the neighbouring byte land below bit 4 (left, by at most 4) or above bit 4 + width - 1
// (right, by at most 3) and are masked off. q5's fifth bits take width 1, q6_16's high bits width 2.
template <int bit, int width = 1>
inline __m256i bits_to_4(__m256i bits) {
  const __m256i kept = _mm256_set1_epi8(static_cast<char>(((1 << width) - 1) << 4));
  if constexpr (bit <= 4) return _mm256_and_si256(_mm256_slli_epi16(bits, 4 - bit), kept);
  else return _mm256_and_si256(_mm256_srli_epi16(bits, bit - 4), kept);
}

template <int j, int MT>
inline void q5_chunk(const uint8_t *nibbles, __m256i fifth, const int8_t *const *xq, __m256i *sum16) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(nibbles + 32 * j));
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(packed, low), bits_to_4<2 * j>(fifth));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), bits_to_4<2 * j + 1>(fifth));
  for (int t = 0; t < MT; t++) {
    sum16[t] = add_products(sum16[t], lo, _mm256_set1_epi32(load_i32(xq[t] + 4 * j)));
    sum16[t] = add_products(sum16[t], hi, _mm256_set1_epi32(load_i32(xq[t] + 16 + 4 * j)));
  }
}

// q6_16's j-th 32 bytes of nibbles: 4 levels (less 32, signed) of each of 8 rows from the low nibbles (elements
// 4j .. 4j+3) into sum16[0], from the high ones (16+4j ..) into sum16[1]; |w| <= 32 and |x| <= 127, so a lane's 4
// maddubs add 8 products, at most 32512
template <int j, int MT>
inline void q6_chunk(const uint8_t *nibbles, __m256i high0, __m256i high1, const int8_t *const *xq,
                     __m256i (*sum16)[MT]) {
  const __m256i low = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8(32);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(nibbles + 32 * j));
  const __m256i lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(packed, low), bits_to_4<2 * j, 2>(high0)), offset);
  const __m256i hi = _mm256_sub_epi8(
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), bits_to_4<2 * j, 2>(high1)), offset);
  const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
  for (int t = 0; t < MT; t++) {
    const __m256i xlo = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq[t] + 4 * j)), lo);
    const __m256i xhi = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq[t] + 16 + 4 * j)), hi);
    sum16[0][t] = add_products(sum16[0][t], alo, xlo);
    sum16[1][t] = add_products(sum16[1][t], ahi, xhi);
  }
}

// One group of 8 weight rows against MT activation rows -> y[m0..m0+MT, n0..n0+8]. The group's block is loaded once
// and multiplied with each row's; lane n of every vector below is weight row n0 + n.
template <int MT, Layout L>
inline void group_tile(const uint8_t *group, int64_t nb, const Q8Rows &x, int64_t m0, int64_t K, float *y,
                       int64_t N, int64_t n0, bool prefetch) {
  constexpr int64_t bytes = group_bytes(L);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *blk = group + b * bytes;
    if (prefetch)  // the first pass over the weights streams them from memory: ask for them early
      for (int64_t ahead = 0; ahead < bytes; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char *>(blk + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const int8_t *xq[MT];
    for (int t = 0; t < MT; t++) xq[t] = x.q.data() + (m0 + t) * K + b * QK;
    if constexpr (L == Q5_0 || L == Q5_1) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk)));
      const uint8_t *nibbles = blk + (L == Q5_1 ? 32 : 16);
      const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(nibbles + 128));
      __m256i dot[MT], sum16[MT];  // int32 lane n: row n's exact dot product of its unsigned levels with the block
      // int16 sums of 4 maddubs of levels <= 31: a lane adds 8 products, at most 31496; then widened
      for (int t = 0; t < MT; t++) sum16[t] = _mm256_setzero_si256();
      q5_chunk<0, MT>(nibbles, fifth, xq, sum16);
      q5_chunk<1, MT>(nibbles, fifth, xq, sum16);
      for (int t = 0; t < MT; t++) {
        dot[t] = widen(sum16[t]);
        sum16[t] = _mm256_setzero_si256();
      }
      q5_chunk<2, MT>(nibbles, fifth, xq, sum16);
      q5_chunk<3, MT>(nibbles, fifth, xq, sum16);
      for (int t = 0; t < MT; t++) dot[t] = _mm256_add_epi32(dot[t], widen(sum16[t]));
      for (int t = 0; t < MT; t++) {
        const int64_t xb = (m0 + t) * nb + b;
        if constexpr (L == Q5_0) dot[t] = _mm256_sub_epi32(dot[t], _mm256_set1_epi32(16 * x.sum[xb]));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x.d[xb])), _mm256_cvtepi32_ps(dot[t]), acc[t]);
        if constexpr (L == Q5_1) {
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 16)));
          acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[xb]), acc[t]);
        }
      }
      continue;
    }
    if constexpr (L == Q6_16) {
      // lane n: row n's exact dot product over one half of the block (16 levels), scaled by that half's d sc
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk)));
      const __m256 dw[2] = {
          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i *>(blk + 16))))),
          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i *>(blk + 24)))))};
      const uint8_t *nibbles = blk + 32;
      const __m256i high0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(nibbles + 128));
      const __m256i high1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(nibbles + 160));
      __m256i sum16[2][MT];
      for (int t = 0; t < MT; t++) sum16[0][t] = sum16[1][t] = _mm256_setzero_si256();
      q6_chunk<0, MT>(nibbles, high0, high1, xq, sum16);
      q6_chunk<1, MT>(nibbles, high0, high1, xq, sum16);
      q6_chunk<2, MT>(nibbles, high0, high1, xq, sum16);
      q6_chunk<3, MT>(nibbles, high0, high1, xq, sum16);
      for (int half = 0; half < 2; half++)
        for (int t = 0; t < MT; t++)
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw[half], _mm256_set1_ps(x.d[((m0 + t) * nb + b) * 2 + half])),
                                   _mm256_cvtepi32_ps(widen(sum16[half][t])), acc[t]);
      continue;
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk)));
    __m256i dot[MT];  // int32 lane n: row n's exact dot product with the activation row's block
    if constexpr (L == Q4_1) {
      // int16 sums of 8 maddubs: each lane adds 16 products of a level 0..15 and |q| <= 127, at most 30480: no overflow
      __m256i sum16[MT];
      for (int t = 0; t < MT; t++) sum16[t] = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 32 + 32 * j));
        const __m256i lo = _mm256_and_si256(packed, low);                         // elements 4j .. 4j+3
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);   // elements 16+4j .. 16+4j+3
        for (int t = 0; t < MT; t++) {
          const __m256i xlo = _mm256_set1_epi32(load_i32(xq[t] + 4 * j));
          const __m256i xhi = _mm256_set1_epi32(load_i32(xq[t] + 16 + 4 * j));
          sum16[t] = add_products(sum16[t], lo, xlo);
          sum16[t] = add_products(sum16[t], hi, xhi);
        }
      }
      for (int t = 0; t < MT; t++) dot[t] = widen(sum16[t]);
    } else {
      // maddubs takes unsigned bytes first: |w|, its sign moved onto x; a pair's sum fits int16, so widen each
      for (int t = 0; t < MT; t++) dot[t] = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16 + 32 * j));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int t = 0; t < MT; t++) {
          const __m256i xw = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq[t] + 4 * j)), w);
          dot[t] = add_products_wide(dot[t], aw, xw);
        }
      }
    }
    for (int t = 0; t < MT; t++) {
      const int64_t xb = (m0 + t) * nb + b;
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x.d[xb])), _mm256_cvtepi32_ps(dot[t]), acc[t]);
      if constexpr (L == Q4_1) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 16)));
        acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[xb]), acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; t++) {
    float *out = y + (m0 + t) * N + n0;
    if (n0 + 8 <= N) {
      _mm256_storeu_ps(out, acc[t]);
    } else {  // the last group's padding rows are dropped
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[t]);
      std::memcpy(out, lanes, sizeof(float) * (N - n0));
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Two adjacent groups (16 weight rows) against MT activation rows in 512-bit registers: lanes 0..7 are group g's rows,
// 8..15 group g + 1's. One broadcast of 4 activation bytes and one vpdpbusd serve 16 rows where group_tile's serve 8,
// and the float work per output is the same instructions on twice the lanes: each output element takes exactly
// group_tile's integers and float operations in group_tile's order, so the two give the same bits (a row's result
// does not depend on which path its group took). AVX512 has no vpsignb: signed levels are offset to unsigned ones
// (q6_16: q, not q - 32; q8_0: q + 128) and the offset times the activations' sum is subtracted, the same integers.
inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {  // 32 bytes of each group
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b)), 1);
}
inline __m512 halves_pair(const uint8_t *a, const uint8_t *b) {  // 8 fp16 of each group -> 16 floats
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i *>(b)), 1));
}
inline __m512 int8s_pair(const uint8_t *a, const uint8_t *b) {  // 8 int8 scales of each group -> 16 floats
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(a)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both));
}
template <int bit, int width = 1>
inline __m512i bits_to_4_512(__m512i bits) {  // bits_to_4 on 512 bits
  const __m512i kept = _mm512_set1_epi8(static_cast<char>(((1 << width) - 1) << 4));
  if constexpr (bit <= 4) return _mm512_and_si512(_mm512_slli_epi16(bits, 4 - bit), kept);
  else return _mm512_and_si512(_mm512_srli_epi16(bits, bit - 4), kept);
}
inline __m512i bcast4(const int8_t *p) { return _mm512_set1_epi32(load_i32(p)); }

template <int j, int MT>
inline void q6_chunk_pair(const uint8_t *n0, const uint8_t *n1, __m512i high0, __m512i high1,
                          const int8_t *const *xq, __m512i (*sum)[MT]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i packed = load_pair(n0 + 32 * j, n1 + 32 * j);
  const __m512i lo = _mm512_or_si512(_mm512_and_si512(packed, low), bits_to_4_512<2 * j, 2>(high0));
  const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low),
                                     bits_to_4_512<2 * j, 2>(high1));
  for (int t = 0; t < MT; t++) {
    sum[0][t] = _mm512_dpbusd_epi32(sum[0][t], lo, bcast4(xq[t] + 4 * j));
    sum[1][t] = _mm512_dpbusd_epi32(sum[1][t], hi, bcast4(xq[t] + 16 + 4 * j));
  }
}

template <int MT, Layout L>
inline void pair_tile(const uint8_t *group0, const uint8_t *group1, int64_t nb, const Q8Rows &x, int64_t m0,
                      int64_t K, float *y, int64_t N, int64_t n0, bool prefetch) {
  static_assert(L == Q4_1 || L == Q6_16 || L == Q8_0, "pair_tile: q4_1, q6_16 and q8_0 only");
  constexpr int64_t bytes = group_bytes(L);
  __m512 acc[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *b0 = group0 + b * bytes, *b1 = group1 + b * bytes;
    if (prefetch)
      for (int64_t ahead = 0; ahead < bytes; ahead += 64) {
        _mm_prefetch(reinterpret_cast<const char *>(b0 + PREFETCH_BYTES + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(b1 + PREFETCH_BYTES + ahead), _MM_HINT_T0);
      }
    const int8_t *xq[MT];
    for (int t = 0; t < MT; t++) xq[t] = x.q.data() + (m0 + t) * K + b * QK;
    if constexpr (L == Q6_16) {
      const __m512 d = halves_pair(b0, b1);
      const __m512 dw[2] = {_mm512_mul_ps(d, int8s_pair(b0 + 16, b1 + 16)),
                            _mm512_mul_ps(d, int8s_pair(b0 + 24, b1 + 24))};
      const __m512i high0 = load_pair(b0 + 32 + 128, b1 + 32 + 128);
      const __m512i high1 = load_pair(b0 + 32 + 160, b1 + 32 + 160);
      __m512i sum[2][MT];
      for (int t = 0; t < MT; t++) sum[0][t] = sum[1][t] = _mm512_setzero_si512();
      q6_chunk_pair<0, MT>(b0 + 32, b1 + 32, high0, high1, xq, sum);
      q6_chunk_pair<1, MT>(b0 + 32, b1 + 32, high0, high1, xq, sum);
      q6_chunk_pair<2, MT>(b0 + 32, b1 + 32, high0, high1, xq, sum);
      q6_chunk_pair<3, MT>(b0 + 32, b1 + 32, high0, high1, xq, sum);
      for (int half = 0; half < 2; half++)
        for (int t = 0; t < MT; t++) {
          const int64_t xh = ((m0 + t) * nb + b) * 2 + half;
          const __m512i dot = _mm512_sub_epi32(sum[half][t], _mm512_set1_epi32(32 * x.sum[xh]));
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw[half], _mm512_set1_ps(x.d[xh])), _mm512_cvtepi32_ps(dot), acc[t]);
        }
      continue;
    }
    const __m512 dw = halves_pair(b0, b1);
    __m512i dot[MT];
    for (int t = 0; t < MT; t++) dot[t] = _mm512_setzero_si512();
    if constexpr (L == Q4_1) {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; j++) {
        const __m512i packed = load_pair(b0 + 32 + 32 * j, b1 + 32 + 32 * j);
        const __m512i lo = _mm512_and_si512(packed, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        for (int t = 0; t < MT; t++) {
          dot[t] = _mm512_dpbusd_epi32(dot[t], lo, bcast4(xq[t] + 4 * j));
          dot[t] = _mm512_dpbusd_epi32(dot[t], hi, bcast4(xq[t] + 16 + 4 * j));
        }
      }
    } else {  // Q8_0: q + 128 unsigned, less 128 x the block's sum
      const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int j = 0; j < 8; j++) {
        const __m512i w = _mm512_xor_si512(load_pair(b0 + 16 + 32 * j, b1 + 16 + 32 * j), offset);
        for (int t = 0; t < MT; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], w, bcast4(xq[t] + 4 * j));
      }
      for (int t = 0; t < MT; t++)
        dot[t] = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(128 * x.sum[(m0 + t) * nb + b]));
    }
    for (int t = 0; t < MT; t++) {
      const int64_t xb = (m0 + t) * nb + b;
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(x.d[xb])), _mm512_cvtepi32_ps(dot[t]), acc[t]);
      if constexpr (L == Q4_1) acc[t] = _mm512_fmadd_ps(halves_pair(b0 + 16, b1 + 16), _mm512_set1_ps(x.s[xb]), acc[t]);
    }
  }
  for (int t = 0; t < MT; t++) {
    float *out = y + (m0 + t) * N + n0;
    if (n0 + 16 <= N) {
      _mm512_storeu_ps(out, acc[t]);
    } else {  // the second group's padding rows are dropped
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[t]);
      std::memcpy(out, lanes, sizeof(float) * (N - n0));
    }
  }
}
#define STAGEMESH_PAIR_TILES 1
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// ---- AMX: prefill-sized micro-batches on the tile units (Sapphire Rapids and later Xeons) ---------------------------
// y = x @ W^T with W's blocks dequantized to bf16 on the fly, 32 rows (4 groups) at a time, into a buffer each thread
// keeps in its L2, laid out as TDPBF16PS's B operand: two n-tiles, each [K/2][16 rows n][2] bf16 (B row kp holds
// W[n][2kp], W[n][2kp + 1] for the tile's 16 rows n), and x rounded to bf16 [M padded to 16][K]. Each step multiplies
// two 16-row tiles of x by the two n-tiles into four 16 x 16 float32 accumulators (tiles C 0-3, A 4-5, B 6-7), 32 of
// K a step. A weight is its block's w = d q + m (q4_1), d q (q8_0), d sc (q - 32) (q6_16) in float32, rounded to bf16
// once; the products are bf16 x bf16 summed in float32. That is not llama.cpp's 8-bit scheme (x keeps bf16's 8
// significant bits per value, where q8_1 keeps 7 bits of each block's largest), and a row's result depends on that row
// alone for every M the op sends here (M >= tile_rows, qdot.py's amx_rows); below it the integer-dot path runs.
#define STAGEMESH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// The kernel's permission for this process to use the tile data state (Linux 5.16+; a VM's kernel may refuse it),
// asked once: every thread of the process may then configure tiles.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t AMX_ROWS = 32;  // weight rows a buffer holds: two n-tiles of 16
constexpr int64_t B_ROW = 32;     // bf16 in one B row: 16 rows' pairs

// lanes 4n + i of lo (rows n = 0..3) and hi (rows 4..7) = row n's weight k0 + i (i = 0..3), as floats -> bf16 into
// B rows kp = k0 / 2 (i = 0, 1) and kp + 1 (i = 2, 3), at the n-tile's columns col .. col + 7
inline void put_pairs(__m512 lo, __m512 hi, uint16_t *tile, int64_t kp, int col) {
  // dwords (one bf16 pair each) [n][i / 2] -> [i / 2][n]
  const __m512i by_pair = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i bf = _mm512_permutexvar_epi32(by_pair, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(tile + kp * B_ROW + 2 * col), _mm512_castsi512_si256(bf));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(tile + (kp + 1) * B_ROW + 2 * col), _mm512_extracti64x4_epi64(bf, 1));
}

// 8 rows' scales (float) -> lanes 4n + i = row first + n's, n = 0..3
inline __m512 spread4(__m256 scales, int first) {
  const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                       _mm512_set1_epi32(first));
  return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(scales));
}
inline __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
inline __m512 u8_floats(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
inline __m512 i8_floats(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

// 32 bytes of levels (byte 4n + i: row n's level k0 + i) -> w = scale q + low into the B rows of k0
template <bool SIGNED>
inline void put_levels(__m256i levels, __m512 s_lo, __m512 s_hi, __m512 l_lo, __m512 l_hi, uint16_t *tile,
                       int64_t kp, int col) {
  const __m128i a = _mm256_castsi256_si128(levels), b = _mm256_extracti128_si256(levels, 1);
  const __m512 qa = SIGNED ? i8_floats(a) : u8_floats(a), qb = SIGNED ? i8_floats(b) : u8_floats(b);
  put_pairs(_mm512_fmadd_ps(s_lo, qa, l_lo), _mm512_fmadd_ps(s_hi, qb, l_hi), tile, kp, col);
}

template <int j>
inline void q6_levels_bf16(const uint8_t *blk, __m256i high0, __m256i high1, const __m512 (&s)[2][2],
                           const __m512 (&l)[2][2], uint16_t *tile, int64_t kp0, int col) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 32 + 32 * j));
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(packed, low), bits_to_4<2 * j, 2>(high0));
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), bits_to_4<2 * j, 2>(high1));
  put_levels<false>(lo, s[0][0], s[0][1], l[0][0], l[0][1], tile, kp0 + 2 * j, col);
  put_levels<false>(hi, s[1][0], s[1][1], l[1][0], l[1][1], tile, kp0 + 8 + 2 * j, col);
}

// One group's block b (8 rows x 32 weights) -> B rows 16b .. 16b + 15 of its n-tile, columns col .. col + 7
template <Layout L>
inline void block_to_bf16(const uint8_t *blk, uint16_t *tile, int64_t b, int col) {
  const int64_t kp0 = 16 * b;
  const __m256 d = halves8(blk);
  if constexpr (L == Q4_1) {
    const __m256 m = halves8(blk + 16);
    const __m512 d_lo = spread4(d, 0), d_hi = spread4(d, 4), m_lo = spread4(m, 0), m_hi = spread4(m, 4);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 32 + 32 * j));
      put_levels<false>(_mm256_and_si256(packed, low), d_lo, d_hi, m_lo, m_hi, tile, kp0 + 2 * j, col);
      put_levels<false>(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), d_lo, d_hi, m_lo, m_hi, tile,
                        kp0 + 8 + 2 * j, col);
    }
  } else if constexpr (L == Q8_0) {
    const __m512 d_lo = spread4(d, 0), d_hi = spread4(d, 4), zero = _mm512_setzero_ps();
    for (int j = 0; j < 8; j++)
      put_levels<true>(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16 + 32 * j)), d_lo, d_hi, zero,
                       zero, tile, kp0 + 2 * j, col);
  } else {  // Q6_16: w = d sc (q - 32), sc0 for elements 0..15 (the low nibbles), sc1 for 16..31
    __m512 s[2][2], l[2][2];
    for (int h = 0; h < 2; h++) {
      const __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i *>(blk + 16 + 8 * h)))));
      s[h][0] = spread4(sc, 0);
      s[h][1] = spread4(sc, 4);
      l[h][0] = _mm512_mul_ps(s[h][0], _mm512_set1_ps(-32.0f));
      l[h][1] = _mm512_mul_ps(s[h][1], _mm512_set1_ps(-32.0f));
    }
    const __m256i high0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 160));
    const __m256i high1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 192));
    q6_levels_bf16<0>(blk, high0, high1, s, l, tile, kp0, col);
    q6_levels_bf16<1>(blk, high0, high1, s, l, tile, kp0, col);
    q6_levels_bf16<2>(blk, high0, high1, s, l, tile, kp0, col);
    q6_levels_bf16<3>(blk, high0, high1, s, l, tile, kp0, col);
  }
}

// An accumulator tile <-> y[row .. row + 16, col .. col + 16]: move(at, stride) loads or stores the tile (its number
// must be a literal) at `at`; at the edges of y (rows past M, columns past N) through scratch, the rest dropped.
template <bool STORE, class Move>
inline void move_tile(Move move, float *y, int64_t M, int64_t N, int64_t row, int64_t col, float *scratch) {
  if (row + 16 <= M && col + 16 <= N) {
    move(y + row * N + col, N * sizeof(float));
    return;
  }
  const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(16, M - row));
  const int64_t cols = std::max<int64_t>(0, std::min<int64_t>(16, N - col));
  if (!STORE) {
    std::memset(scratch, 0, 16 * 16 * sizeof(float));
    for (int64_t r = 0; r < rows; r++) std::memcpy(scratch + 16 * r, y + (row + r) * N + col, sizeof(float) * cols);
  }
  move(scratch, 16 * sizeof(float));
  if (STORE)
    for (int64_t r = 0; r < rows; r++) std::memcpy(y + (row + r) * N + col, scratch + 16 * r, sizeof(float) * cols);
}

// the bytes of x's bf16 slice [M, k1 - k0] that stay in a core's L2 beside its weight buffer while every 32 weight rows
// of the slice pass over it
constexpr int64_t AMX_SLICE_BYTES = 1 << 20;
// the most blocks of K a thread dequantizes at a time (its buffer: 2 n-tiles x 1024 pairs x 64 bytes, 128 KiB, in L2);
// fewer, with the accumulators reloaded from y between them, measured slower (8: 0.6-0.7x the speed at 128-512 rows)
constexpr int64_t AMX_SUB_BLOCKS = 64;

template <Layout L>
void amx_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t groups, int64_t N, float *y) {
  constexpr int64_t bytes = group_bytes(L);
  const int64_t nb = K / QK, padded_m = (M + 15) / 16 * 16, n_blocks = (groups * 8 + AMX_ROWS - 1) / AMX_ROWS;
  // x in bf16 as A tiles, the padding rows zero: tile (t, c) -- rows 16t .. 16t + 15, columns 32c .. 32c + 31 -- is
  // 1 KiB at xa + (t * kc + c) * 512, row-major, so a tile load reads 16 adjacent lines (rows of x in place, a stride
  // of 2K bytes, put each of a tile's rows in its own 4 KiB page, and in one L1 set where K is a power of 2)
  const int64_t kc = K / 32;
  std::vector<uint16_t> xa(padded_m * K, 0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; m++)
      for (int64_t k = 0; k < K; k += 32) {
        const float *row = x + m * K + k;
        _mm512_storeu_si512(xa.data() + ((m / 16) * kc + k / 32) * 512 + (m % 16) * 32,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)));
      }
  });
  // K in slices whose x stays in L2 (every weight is dequantized once, in its slice); y accumulates over the slices
  const int64_t slice = std::max<int64_t>(QK, AMX_SLICE_BYTES / (padded_m * 2) / QK * QK);
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t k1 = std::min(K, k0 + slice), kb0 = k0 / QK, kb1 = k1 / QK;
    at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
      TileConfig config;
      for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
      _tile_loadconfig(&config);
      // one sub-slice of AMX_SUB_BLOCKS blocks at a time: its two n-tiles' weights stay in L2 while every 32 rows of x
      // pass over them, the accumulators reloaded from y between sub-slices
      std::vector<uint16_t> buffer(2 * AMX_SUB_BLOCKS * 16 * B_ROW);
      uint16_t *const tiles[2] = {buffer.data(), buffer.data() + AMX_SUB_BLOCKS * 16 * B_ROW};
      alignas(64) float scratch[16 * 16];
      for (int64_t blk = begin; blk < end; blk++) {
        const int64_t n0 = blk * AMX_ROWS;
        for (int64_t sb0 = kb0; sb0 < kb1; sb0 += AMX_SUB_BLOCKS) {
          const int64_t sb1 = std::min(kb1, sb0 + AMX_SUB_BLOCKS), sub_pairs = (sb1 - sb0) * QK / 2;
          for (int64_t q = 0; q < 4; q++) {  // group q of the block: n-tile q / 2, columns (q % 2) * 8
            const int64_t g = 4 * blk + q;
            uint16_t *tile = tiles[q / 2];
            const int col = static_cast<int>(q % 2) * 8;
            if (g >= groups) {  // past the matrix: zero weights
              for (int64_t kp = 0; kp < sub_pairs; kp++)
                std::memset(tile + kp * B_ROW + 2 * col, 0, 16 * sizeof(uint16_t));
              continue;
            }
            const uint8_t *group = w + g * nb * bytes;
            for (int64_t b = sb0; b < sb1; b++) block_to_bf16<L>(group + b * bytes, tile, b - sb0, col);
          }
          const int64_t ka = k0 + (sb0 - kb0) * QK;  // x's column of the sub-slice's first weight
          for (int64_t m = 0; m < padded_m; m += 32) {
            const bool two = m + 16 < padded_m;
            const uint16_t *a0 = xa.data() + ((m / 16) * kc + ka / 32) * 512, *a1 = a0 + kc * 512;
            if (ka == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              move_tile<false>([](float *at, int64_t stride) { _tile_loadd(0, at, stride); }, y, M, N, m, n0, scratch);
              move_tile<false>([](float *at, int64_t stride) { _tile_loadd(1, at, stride); }, y, M, N, m, n0 + 16,
                               scratch);
              if (two) {
                move_tile<false>([](float *at, int64_t stride) { _tile_loadd(2, at, stride); }, y, M, N, m + 16, n0,
                                 scratch);
                move_tile<false>([](float *at, int64_t stride) { _tile_loadd(3, at, stride); }, y, M, N, m + 16,
                                 n0 + 16, scratch);
              }
            }
            for (int64_t kp = 0; kp < sub_pairs; kp += 16) {
              _tile_loadd(6, tiles[0] + kp * B_ROW, 64);
              _tile_loadd(7, tiles[1] + kp * B_ROW, 64);
              _tile_loadd(4, a0 + 32 * kp, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              if (two) {
                _tile_loadd(5, a1 + 32 * kp, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
            }
            move_tile<true>([](float *at, int64_t stride) { _tile_stored(0, at, stride); }, y, M, N, m, n0, scratch);
            move_tile<true>([](float *at, int64_t stride) { _tile_stored(1, at, stride); }, y, M, N, m, n0 + 16,
                            scratch);
            if (two) {
              move_tile<true>([](float *at, int64_t stride) { _tile_stored(2, at, stride); }, y, M, N, m + 16, n0,
                              scratch);
              move_tile<true>([](float *at, int64_t stride) { _tile_stored(3, at, stride); }, y, M, N, m + 16,
                              n0 + 16, scratch);
            }
          }
        }
      }
      _tile_release();
    });
  }
}
#endif

bool amx_ready() {  // qdot.py's amx_rows: the library holds the AMX path and this process may use the tiles
#ifdef STAGEMESH_AMX
  return amx_granted();
#else
  return false;
#endif
}

// Rows [m, m_end) of x in tiles, each a call tile(std::integral_constant<int, R>{}, first row): 8 rows a tile where
// AVX512VL's 32 vector registers keep 8 rows' accumulators and partial sums, then 4, then the last 1 to 3 together.
template <class Tile>
inline void row_tiles(int64_t m, int64_t m_end, Tile tile) {
#ifdef __AVX512VL__
  for (; m + 8 <= m_end; m += 8) tile(std::integral_constant<int, 8>{}, m);
#endif
  for (; m + 4 <= m_end; m += 4) tile(std::integral_constant<int, 4>{}, m);
  switch (m_end - m) {
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

template <Layout L>
at::Tensor qdot_mm(const at::Tensor &x, const at::Tensor &blocks, int64_t N, int64_t tile_rows) {
  constexpr int64_t bytes = group_bytes(L);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "qdot: x must be a contiguous float32 CPU matrix [M, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "qdot: the weight must be a contiguous uint8 matrix of row groups [ceil(N/8), K/32 * ", bytes,
              "] (shared.kernels.qdot.interleave)");
  const int64_t M = x.size(0), K = x.size(1), groups = blocks.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && blocks.size(1) == nb * bytes, "qdot: x has K = ", K,
              " columns; the weight's row groups hold ", blocks.size(1), " bytes, not K/32 * ", bytes);
  TORCH_CHECK(N > 8 * (groups - 1) && N <= 8 * groups, "qdot: N = ", N, " rows do not fill ", groups,
              " groups of 8");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef STAGEMESH_AMX
  if constexpr (L == Q4_1 || L == Q6_16 || L == Q8_0)
    if (tile_rows > 0 && M >= tile_rows && amx_granted()) {
      amx_mm<L>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), groups, N, y.data_ptr<float>());
      return y;
    }
#endif
  const Q8Rows q = quantize_rows<L == Q6_16>(x.data_ptr<float>(), M, K);
  const uint8_t *w = blocks.data_ptr<uint8_t>();
  float *out = y.data_ptr<float>();
  // groups of W split over torch's threads (its count, as the stage set it for this micro-batch); within a thread,
  // rows of x in chunks that stay in cache while the chunk's groups pass over them
  constexpr int64_t ROWS = 64;
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    for (int64_t m_chunk = 0; m_chunk < M; m_chunk += ROWS) {
      const int64_t m_end = std::min(M, m_chunk + ROWS);
      int64_t g = begin;
#ifdef STAGEMESH_PAIR_TILES
      if constexpr (L == Q4_1 || L == Q6_16 || L == Q8_0) {
        for (; g + 2 <= end; g += 2) {
          const uint8_t *g0 = w + g * nb * bytes, *g1 = g0 + nb * bytes;
          int64_t m = m_chunk;
          for (; m + 8 <= m_end; m += 8) pair_tile<8, L>(g0, g1, nb, q, m, K, out, N, 8 * g, m == 0);
          for (; m + 4 <= m_end; m += 4) pair_tile<4, L>(g0, g1, nb, q, m, K, out, N, 8 * g, m == 0);
          // the last 1 to 3 rows group by group: with so few rows the pair measured slower (the same bits)
          for (int64_t h = 0; h < 2; h++) {
            const uint8_t *group = h ? g1 : g0;
            switch (m_end - m) {
              case 3: group_tile<3, L>(group, nb, q, m, K, out, N, 8 * (g + h), m == 0); break;
              case 2: group_tile<2, L>(group, nb, q, m, K, out, N, 8 * (g + h), m == 0); break;
              case 1: group_tile<1, L>(group, nb, q, m, K, out, N, 8 * (g + h), m == 0); break;
              default: break;
            }
          }
        }
      }
#endif
      for (; g < end; g++) {
        const uint8_t *group = w + g * nb * bytes;
        row_tiles(m_chunk, m_end, [&](auto rows, int64_t m) {
          group_tile<decltype(rows)::value, L>(group, nb, q, m, K, out, N, 8 * g, m == 0);
        });
      }
    }
  });
  return y;
}

// ---- Q2_K and Q3_K on their own superblocks of 256 (llama.cpp's vec_dot_q2_K_q8_K / q3_K_q8_K) ----------------
// Per row and superblock of 256 (the file's numbers, repacked; qdot.py's interleave, linear.py's _k_low_blocks):
//   q2_k: 84 bytes {fp16 d, fp16 dmin, 16 scale bytes (sub-block j of 16: low nibble sc, high nibble m), 64 bytes of
//         2-bit levels: bits 2i, 2i + 1 of byte 4j + b are element 16j + 4i + b's}, w = d sc_j q - dmin m_j
//   q3_k: 114 bytes {fp16 d, 16 int8 scales (the file's 6-bit ones less 32), 64 bytes of low 2 bits as q2_k's, 32
//         bytes of third bits: bit 4h + i of byte 4p + b is element 32p + 16h + 4i + b's}, w = d sc_j (q - 4), q the
//         3-bit level (low bits + 4 x the third bit: llama.cpp's hmask bit set means no -4)
// interleaved 8 rows at a time as the other layouts (8 rows' d, (dmin,) scale bytes side by side: byte 8j + n is
// row n's scale j; then each 4 bytes of levels of the 8 rows in turn), 672 / 912 bytes a group's superblock.
// The activations are quantized as llama.cpp's q8_K: per 256, d = 1 / iscale with iscale = -127 / (the value of
// largest magnitude), q = min(127, round-half-even(iscale x)), float d (not fp16), the levels' sums per 16. Each
// output then sums, per superblock, exact int32 sums_j sc_j dot_j (and for q2_k sum_j m_j bsum_j), scaled in
// float32 by d_w d_x (and dmin_w d_x) as llama.cpp's AVX2 dot does: the same integers, float sums in another order.
enum KLayout { K2, K3 };
constexpr int64_t QKK = 256;
constexpr int64_t k_group_bytes(KLayout layout) { return layout == K2 ? 8 * 84 : 8 * 114; }

struct Q8KRows {  // x [M, K]: q [M, K] int8, d [M, K/256], bsum [M, K/16]
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bsum;
};

Q8KRows quantize_rows_k(const float *x, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / QKK);
  Q8KRows out{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<int32_t>(blocks * 16)};
  at::parallel_for(0, blocks, 64, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++) {  // ggml's quantize_row_q8_K_ref, step for step
      const float *xb = x + i * QKK;
      int8_t *q = out.q.data() + i * QKK;
      float amax = 0.0f, max = 0.0f;
      for (int j = 0; j < QKK; j++) {
        const float ax = std::fabs(xb[j]);
        if (ax > amax) {
          amax = ax;
          max = xb[j];
        }
      }
      if (amax == 0.0f) {
        out.d[i] = 0.0f;
        std::memset(q, 0, QKK);
        for (int j = 0; j < 16; j++) out.bsum[i * 16 + j] = 0;
        continue;
      }
      const float iscale = -127.0f / max;
      for (int j = 0; j < QKK; j++) q[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
      for (int j = 0; j < 16; j++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += q[16 * j + l];
        out.bsum[i * 16 + j] = s;
      }
      out.d[i] = 1.0f / iscale;
    }
  });
  return out;
}

// the `bit`-th bit of each byte moved to bit 2, every other bit 0 (as bits_to_4: a 16-bit shift, what crosses from
// the neighbouring byte masked off)
template <int bit>
inline __m256i bit_to_2(__m256i bits) {
  const __m256i kept = _mm256_set1_epi8(0x04);
  if constexpr (bit <= 2) return _mm256_and_si256(_mm256_slli_epi16(bits, 2 - bit), kept);
  else return _mm256_and_si256(_mm256_srli_epi16(bits, bit - 2), kept);
}

// sub-block j of 16 of one group's superblock: the 8 rows' levels (unsigned, 0..3 or 0..7) against each activation
// row's 16 -> int32 lane n: row n's exact dot product. AVX2: a lane's 4 maddubs add 8 products of at most 7 x 127.
template <int MT, KLayout L, int h>
inline void k_sub_dots(const uint8_t *low2, const uint8_t *high, const int8_t *const *xq, int j, __m256i *dot) {
  const __m256i three = _mm256_set1_epi8(0x03);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(low2 + 32 * j));
  __m256i hb = _mm256_setzero_si256();
  if constexpr (L == K3) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(high + 32 * (j / 2)));
  __m256i u[4];
  u[0] = _mm256_and_si256(packed, three);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 2), three);
  u[2] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), three);
  u[3] = _mm256_and_si256(_mm256_srli_epi16(packed, 6), three);
  if constexpr (L == K3) {
    u[0] = _mm256_or_si256(u[0], bit_to_2<4 * h + 0>(hb));
    u[1] = _mm256_or_si256(u[1], bit_to_2<4 * h + 1>(hb));
    u[2] = _mm256_or_si256(u[2], bit_to_2<4 * h + 2>(hb));
    u[3] = _mm256_or_si256(u[3], bit_to_2<4 * h + 3>(hb));
  }
  for (int t = 0; t < MT; t++) {
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) s = add_products(s, u[i], _mm256_set1_epi32(load_i32(xq[t] + 16 * j + 4 * i)));
    dot[t] = widen(s);
  }
}

template <int MT, KLayout L>
inline void k_group_tile(const uint8_t *group, int64_t nb, const Q8KRows &x, int64_t m0, int64_t K, float *y,
                         int64_t N, int64_t n0, bool prefetch) {
  constexpr int64_t bytes = k_group_bytes(L);
  constexpr int64_t scales_at = L == K2 ? 32 : 16, levels_at = scales_at + 128;
  __m256 acc[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *blk = group + b * bytes;
    if (prefetch)
      for (int64_t ahead = 0; ahead < bytes; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char *>(blk + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const int8_t *xq[MT];
    for (int t = 0; t < MT; t++) xq[t] = x.q.data() + (m0 + t) * K + b * QKK;
    const uint8_t *low2 = blk + levels_at, *high = low2 + 512;
    __m256i isum[MT], msum[MT], dot[MT];
    for (int t = 0; t < MT; t++) isum[t] = msum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 16; j++) {
      if (j % 2 == 0) k_sub_dots<MT, L, 0>(low2, high, xq, j, dot);
      else k_sub_dots<MT, L, 1>(low2, high, xq, j, dot);
      const __m256i sc8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(blk + scales_at + 8 * j)));
      if constexpr (L == K2) {
        const __m256i sc = _mm256_and_si256(sc8, _mm256_set1_epi32(0x0F)), mn = _mm256_srli_epi32(sc8, 4);
        for (int t = 0; t < MT; t++) {
          const int64_t xb = (m0 + t) * nb + b;
          isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot[t], sc));
          msum[t] = _mm256_add_epi32(msum[t], _mm256_mullo_epi32(mn, _mm256_set1_epi32(x.bsum[xb * 16 + j])));
        }
      } else {  // signed scales; the levels' offset 4 taken off each sub-block's dot
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(blk + scales_at + 8 * j)));
        for (int t = 0; t < MT; t++) {
          const int64_t xb = (m0 + t) * nb + b;
          const __m256i d = _mm256_sub_epi32(dot[t], _mm256_set1_epi32(4 * x.bsum[xb * 16 + j]));
          isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(d, sc));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk)));
    for (int t = 0; t < MT; t++) {
      const __m256 dx = _mm256_set1_ps(x.d[(m0 + t) * nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[t]), acc[t]);
      if constexpr (L == K2) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 16)));
        acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(msum[t]), acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; t++) {
    float *out = y + (m0 + t) * N + n0;
    if (n0 + 8 <= N) {
      _mm256_storeu_ps(out, acc[t]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[t]);
      std::memcpy(out, lanes, sizeof(float) * (N - n0));
    }
  }
}

template <KLayout L>
at::Tensor kquant_mm(const at::Tensor &x, const at::Tensor &blocks, int64_t N) {
  constexpr int64_t bytes = k_group_bytes(L);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "qdot: x must be a contiguous float32 CPU matrix [M, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "qdot: the weight must be a contiguous uint8 matrix of row groups [ceil(N/8), K/256 * ", bytes,
              "] (shared.kernels.qdot.interleave)");
  const int64_t M = x.size(0), K = x.size(1), groups = blocks.size(0), nb = K / QKK;
  TORCH_CHECK(K % QKK == 0 && blocks.size(1) == nb * bytes, "qdot: x has K = ", K,
              " columns (a multiple of 256 for this type); the weight's row groups hold ", blocks.size(1),
              " bytes, not K/256 * ", bytes);
  TORCH_CHECK(N > 8 * (groups - 1) && N <= 8 * groups, "qdot: N = ", N, " rows do not fill ", groups,
              " groups of 8");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Q8KRows q = quantize_rows_k(x.data_ptr<float>(), M, K);
  const uint8_t *w = blocks.data_ptr<uint8_t>();
  float *out = y.data_ptr<float>();
  constexpr int64_t ROWS = 64;
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    for (int64_t m_chunk = 0; m_chunk < M; m_chunk += ROWS) {
      const int64_t m_end = std::min(M, m_chunk + ROWS);
      for (int64_t g = begin; g < end; g++) {
        const uint8_t *group = w + g * nb * bytes;
        row_tiles(m_chunk, m_end, [&](auto rows, int64_t m) {
          k_group_tile<decltype(rows)::value, L>(group, nb, q, m, K, out, N, 8 * g, m == 0);
        });
      }
    }
  });
  return y;
}

// exp on 8 floats (Cephes' expf polynomial, ~1 ulp on the range softmax uses); x <= 0 here, very negative -> 0
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, out);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int64_t ATTN_CHUNK = 256;  // positions per work item of decode attention

// One work item of decode attention: the g queries qv [g, hd] of one kv head against n <= ATTN_CHUNK consecutive
// cached positions K / V [n, hd]. Writes each query's softmax max and sum over the chunk (maxes[qi], sums[qi]) and
// its unnormalized output acc [g, hd]; scores is scratch of QGROUP x (ATTN_CHUNK + 8) floats. Up to QGROUP queries
// go through the chunk together, so each key and value row is loaded once per group; every query's sums still run
// in one fixed order (over d, then over the positions), so its numbers do not depend on the group it is in.
constexpr int64_t QGROUP = 4;

// 8 cached values as float32: a cache of float32, float16 (F16C's conversion, exact) or bfloat16 (its upper half, exact).
template <typename T> inline __m256 load8(const T* p);
template <> inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename T>
void attend_chunk(const float* qv, const T* K, const T* V, int64_t n, int64_t g, int64_t hd, float sc,
                  float* scores, float* maxes, float* sums, float* accs) {
  const int64_t hv = hd / 8, stride = ATTN_CHUNK + 8;
  for (int64_t q0 = 0; q0 < g; q0 += QGROUP) {
    const int64_t w = std::min(QGROUP, g - q0);
    const float* qs = qv + q0 * hd;
    float m[QGROUP] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = K + j * hd;
      __m256 a[QGROUP];
      const __m256 k0 = load8(kr);
      for (int64_t t = 0; t < w; ++t) a[t] = _mm256_mul_ps(_mm256_loadu_ps(qs + t * hd), k0);
      for (int64_t d = 1; d < hv; ++d) {
        const __m256 kd = load8(kr + 8 * d);
        for (int64_t t = 0; t < w; ++t) a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + t * hd + 8 * d), kd, a[t]);
      }
      for (int64_t t = 0; t < w; ++t) {
        const float s = hsum8(a[t]) * sc;
        scores[t * stride + j] = s;
        m[t] = std::max(m[t], s);
      }
    }
    for (int64_t t = 0; t < w; ++t) {
      float* sct = scores + t * stride;
      const __m256 mv = _mm256_set1_ps(m[t]);
      __m256 total = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sct + j), mv));
        _mm256_storeu_ps(sct + j, p);
        total = _mm256_add_ps(total, p);
      }
      float tail = 0.f;
      for (; j < n; ++j) {
        sct[j] = std::exp(sct[j] - m[t]);
        tail += sct[j];
      }
      maxes[q0 + t] = m[t];
      sums[q0 + t] = hsum8(total) + tail;
    }
    for (int64_t d0 = 0; d0 < hv; d0 += 2) {  // 2 registers of each query's output at a time: hd / 8 of them in all
      const int64_t r = std::min<int64_t>(2, hv - d0);
      __m256 o[QGROUP][2];
      for (int64_t t = 0; t < QGROUP; ++t) o[t][0] = o[t][1] = _mm256_setzero_ps();
      for (int64_t jj = 0; jj < n; ++jj) {
        const T* vr = V + jj * hd + 8 * d0;
        const __m256 v0 = load8(vr), v1 = r > 1 ? load8(vr + 8) : v0;
        for (int64_t t = 0; t < w; ++t) {
          const __m256 p = _mm256_set1_ps(scores[t * stride + jj]);
          o[t][0] = _mm256_fmadd_ps(p, v0, o[t][0]);
          o[t][1] = _mm256_fmadd_ps(p, v1, o[t][1]);
        }
      }
      for (int64_t t = 0; t < w; ++t)
        for (int64_t u = 0; u < r; ++u) _mm256_storeu_ps(accs + (q0 + t) * hd + 8 * (d0 + u), o[t][u]);
    }
  }
}

// The merge of one kv head's chunks for its g queries: maxes / sums [chunks, g], accs [chunks, g, hd] -> out [g, hd].
void merge_chunks(int64_t chunks, int64_t g, int64_t hd, const float* maxes, const float* sums, const float* accs,
                  float* out) {
  for (int64_t qi = 0; qi < g; ++qi) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, maxes[c * g + qi]);
    float denom = 0.f;
    float* o = out + qi * hd;
    std::fill(o, o + hd, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t at = c * g + qi;
      const float w = std::exp(maxes[at] - m);
      denom += w * sums[at];
      const float* acc = accs + at * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += w * acc[d];
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= denom;
  }
}

// Decode attention for B sequences, the cache read in place and once (flash-decoding): q [B, H, hd] float32, sequence
// b against the first ctxs[b] positions of row slots[b] of k_cache / v_cache [R, KVH, M, hd] (contiguous float32,
// float16 or bfloat16, each value widened to float32 as it is loaded) ->
// [B, H, hd]; with window > 0 (a sliding layer's) only the last `window` of them, ctxs[b] - window .. ctxs[b] - 1. Query head i reads kv head i / (H / KVH). The work is (sequence, kv head, chunk of ATTN_CHUNK
// positions), split over torch's threads; each item keeps its own softmax max and sum for its queries, merged per
// (sequence, kv head) at the end. A sequence's numbers depend only on its own query, slot and context: never on the
// batch or the thread split. torch's SDPA read the cache at ~9 GB/s at one token (small GEMMs per block): this
// streams each key and value row once per kv head, and reads no position a sequence does not attend to.
at::Tensor attend_batch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const std::vector<int64_t>& slots, const std::vector<int64_t>& ctxs, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  const at::ScalarType kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == kv_type &&
                  (kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16),
              "decode_attention: float32 queries, a float32, float16 or bfloat16 cache");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous");
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t R = k_cache.size(0), KVH = k_cache.size(1), M = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && hd % 8 == 0 && H % KVH == 0, "decode_attention: head dims");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == B && static_cast<int64_t>(ctxs.size()) == B,
              "decode_attention: one slot and one context per sequence");
  TORCH_CHECK(window >= 0, "decode_attention: window ", window, " must be 0 (none) or positive");
  const int64_t g = H / KVH;
  std::vector<int64_t> first_item(B + 1, 0);  // sequence b's items: [first_item[b], first_item[b + 1])
  std::vector<int64_t> starts(B);  // the first position sequence b reads; it reads ctxs[b] - starts[b] of them
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= slots[b] && slots[b] < R, "decode_attention: slot ", slots[b], " is not a row of the cache's ", R);
    TORCH_CHECK(1 <= ctxs[b] && ctxs[b] <= M, "decode_attention: context ", ctxs[b], " is not within 1..", M);
    starts[b] = window > 0 ? std::max<int64_t>(0, ctxs[b] - window) : 0;
    first_item[b + 1] = first_item[b] + KVH * ((ctxs[b] - starts[b] + ATTN_CHUNK - 1) / ATTN_CHUNK);
  }
  const int64_t items = first_item[B];
  // per item and query: running max, sum, and the unnormalized output [hd]
  std::vector<float> maxes(items * g), sums(items * g), accs(items * g * hd);
  const float* qp = q.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto run = [&](auto element) {  // the items over a cache of this element type
    using T = decltype(element);
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(QGROUP * (ATTN_CHUNK + 8));
      int64_t b = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
      for (int64_t item = begin; item < end; ++item) {
        while (item >= first_item[b + 1]) ++b;
        const int64_t chunks = (ctxs[b] - starts[b] + ATTN_CHUNK - 1) / ATTN_CHUNK, local = item - first_item[b];
        const int64_t h = local / chunks, c = local % chunks;
        const int64_t first = starts[b] + c * ATTN_CHUNK, n = std::min(ATTN_CHUNK, ctxs[b] - first);
        const int64_t row = (slots[b] * KVH + h) * M + first;
        attend_chunk<T>(qp + (b * H + h * g) * hd, kp + row * hd, vp + row * hd, n, g, hd, sc, scores.data(),
                        &maxes[item * g], &sums[item * g], &accs[item * g * hd]);
      }
    });
  };
  if (kv_type == at::kHalf) run(at::Half{});
  else if (kv_type == at::kBFloat16) run(at::BFloat16{});
  else run(float{});
  at::Tensor out = at::empty({B, H, hd}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KVH, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH, h = bh % KVH, chunks = (ctxs[b] - starts[b] + ATTN_CHUNK - 1) / ATTN_CHUNK;
      const int64_t item = first_item[b] + h * chunks;  // the first of this kv head's chunks
      merge_chunks(chunks, g, hd, &maxes[item * g], &sums[item * g], &accs[item * g * hd], op + (b * H + h * g) * hd);
    }
  });
  return out;
}

// One sequence (the compiled decode step's op; slot and ctx may be symbolic sizes there): q [H, hd] -> [H, hd].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t slot,
                            int64_t ctx, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 2, "decode_attention: q must be [H, hd]");
  return attend_batch(q.contiguous().unsqueeze(0), k_cache, v_cache, {slot}, {ctx}, scale, window).squeeze(0);
}

// B sequences of one decode step each (the eager batched step): q [B, H, hd], slots / ctxs [B] int64 -> [B, H, hd].
at::Tensor decode_attention_batch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& ctxs, double scale, int64_t window) {
  TORCH_CHECK(slots.dim() == 1 && ctxs.dim() == 1 && slots.scalar_type() == at::kLong &&
                  ctxs.scalar_type() == at::kLong, "decode_attention_batch: slots and ctxs must be [B] int64");
  const at::Tensor s = slots.contiguous(), c = ctxs.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* cp = c.data_ptr<int64_t>();
  return attend_batch(q.contiguous(), k_cache, v_cache, std::vector<int64_t>(sp, sp + s.numel()),
                      std::vector<int64_t>(cp, cp + c.numel()), scale, window);
}

// Sampling's tempered probabilities: probs[r, i] = exp((logits[r, i] - max_r) * inv_t[r]) for logits [M, V] float32,
// so each row's most likely token has 1 (not normalized: the draw scales by the sum). Rows go to torch's threads
// whole, and a row is computed in one fixed order (8 lanes, then a scalar tail at its own end), so its numbers do not
// depend on the other rows of the micro-batch nor on the thread split: a seeded draw must not depend on its company.
at::Tensor temper(const at::Tensor& logits, const at::Tensor& inv_t) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "temper: logits must be a contiguous [M, V] float32 tensor");
  TORCH_CHECK(inv_t.dim() == 1 && inv_t.scalar_type() == at::kFloat && inv_t.size(0) == logits.size(0),
              "temper: one float32 inverse temperature per row");
  const int64_t M = logits.size(0), V = logits.size(1);
  const at::Tensor it = inv_t.contiguous();
  at::Tensor out = at::empty({M, V}, logits.options());
  const float* xp = logits.data_ptr<float>();
  const float* tp = it.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * V;
      float* o = op + r * V;
      __m256 mv = _mm256_set1_ps(-INFINITY);
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
      float lanes[8];
      _mm256_storeu_ps(lanes, mv);
      float m = lanes[0];
      for (int t = 1; t < 8; ++t) m = std::max(m, lanes[t]);
      for (; i < V; ++i) m = std::max(m, x[i]);
      const float t = tp[r];
      const __m256 mb = _mm256_set1_ps(m), tb = _mm256_set1_ps(t);
      for (i = 0; i + 8 <= V; i += 8)
        _mm256_storeu_ps(o + i, exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mb), tb)));
      for (; i < V; ++i) o[i] = std::exp((x[i] - m) * t);
    }
  });
  return out;
}

}  // namespace

// RMSNorm over the last dim: x [..., D] float32 -> x / sqrt(mean(x^2) + eps) * weight [D], a row at a time (8 lanes
// of squares, summed lane by lane in one fixed order, then the scalar tail), so a row's numbers never depend on the
// other rows. One pass and one allocation: torch's rms_norm of one row took ~26 us in six ops, 61 of them a decode
// step of SmolLM2 (about a fifth of the eager step).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "rms_norm: x must be a contiguous float32 tensor");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == D,
              "rms_norm: weight must be a contiguous float32 [D] tensor, D = x's last dim");
  const int64_t M = D ? x.numel() / D : 0;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * D;
      float* o = op + r * D;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= D; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, acc);
      float ss = 0.0f;
      for (int t = 0; t < 8; ++t) ss += lanes[t];
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float scale = 1.0f / std::sqrt(ss / static_cast<float>(D) + e);
      const __m256 sb = _mm256_set1_ps(scale);
      for (i = 0; i + 8 <= D; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), sb), _mm256_loadu_ps(wp + i)));
      for (; i < D; ++i) o[i] = xr[i] * scale * wp[i];
    }
  });
  return out;
}

// A step's keys and values into the cache: k_cache[slots[n], :, positions[n]] = k[n], the same for v, for each of
// the step's N rows (k, v [N, KVH, hd] of the cache's dtype -- float32, float16 or bfloat16, converted by the caller;
// caches [rows, KVH, max_seq, hd] contiguous, written in place). One call for both, where torch's indexed assignment
// took two (~7 us each, twice a layer).
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& positions,
              const at::Tensor& k, const at::Tensor& v) {
  const at::ScalarType kv_type = k_cache.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  v_cache.scalar_type() == kv_type && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "write_kv: the caches must be contiguous float32, float16 or bfloat16 [rows, KVH, max_seq, hd] tensors");
  const int64_t R = k_cache.size(0), KVH = k_cache.size(1), M = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.dim() == 1 &&
                  positions.sizes() == slots.sizes(), "write_kv: slots and positions must be [N] int64");
  const int64_t N = slots.size(0);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous(), pc = positions.contiguous();
  TORCH_CHECK(kc.scalar_type() == kv_type && vc.scalar_type() == kv_type && kc.numel() == N * KVH * hd &&
                  vc.numel() == N * KVH * hd, "write_kv: k and v must be [N, KVH, hd] of the cache's dtype");
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(0 <= sp[n] && sp[n] < R && 0 <= pp[n] && pp[n] < M, "write_kv: row ", n, " (slot ", sp[n],
                ", position ", pp[n], ") is outside the cache's ", R, " x ", M);
  const int64_t width = k_cache.element_size();
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  const size_t bytes = hd * width;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = ((sp[n] * KVH + h) * M + pp[n]) * hd * width, from = (n * KVH + h) * hd * width;
      std::memcpy(kd + at, ks + from, bytes);
      std::memcpy(vd + at, vs + from, bytes);
    }
}

TORCH_LIBRARY(stagemesh_qdot, m) {
  m.def("q4_1(Tensor x, Tensor blocks, int n, int tile_rows=0) -> Tensor");
  m.def("q8_0(Tensor x, Tensor blocks, int n, int tile_rows=0) -> Tensor");
  m.def("q6_16(Tensor x, Tensor blocks, int n, int tile_rows=0) -> Tensor");
  m.def("q5_0(Tensor x, Tensor blocks, int n, int tile_rows=0) -> Tensor");
  m.def("q5_1(Tensor x, Tensor blocks, int n, int tile_rows=0) -> Tensor");
  m.impl("q4_1", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<Q4_1>));
  m.impl("q8_0", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<Q8_0>));
  m.impl("q6_16", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<Q6_16>));
  m.impl("q5_0", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<Q5_0>));
  m.impl("q5_1", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<Q5_1>));
  m.def("amx_ready() -> bool", TORCH_FN(amx_ready));
  m.def("q2_k(Tensor x, Tensor blocks, int n) -> Tensor");
  m.def("q3_k(Tensor x, Tensor blocks, int n) -> Tensor");
  m.impl("q2_k", c10::DispatchKey::CPU, TORCH_FN(kquant_mm<K2>));
  m.impl("q3_k", c10::DispatchKey::CPU, TORCH_FN(kquant_mm<K3>));
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, SymInt slot, SymInt ctx, float scale, "
        "int window=0) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("decode_attention_batch(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctxs, float scale, "
        "int window=0) -> Tensor");
  m.impl("decode_attention_batch", c10::DispatchKey::CPU, TORCH_FN(decode_attention_batch));
  m.def("temper(Tensor logits, Tensor inv_t) -> Tensor");
  m.impl("temper", c10::DispatchKey::CPU, TORCH_FN(temper));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor positions, Tensor k, Tensor v) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
}
