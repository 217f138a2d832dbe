// Integer-dot matmuls over GGUF blocks for AVX2 CPUs: llama.cpp's scheme, as torch ops (shared/models/qdot.py).
//
// y [M, N] float32 = x [M, K] float32 @ W^T, W [N, K] kept as the GGUF's own blocks of 32 weights:
//   q4_1: 20 bytes {fp16 d, fp16 m, 16 bytes of nibbles: byte i holds element i (low) and i + 16 (high)}, w = d q + m
//   q8_0: 34 bytes {fp16 d, 32 int8}, w = d q
// Each row of x is quantized first, per block of 32, as ggml's q8_1: q = round(x * 127 / amax) in int8, its scale
// d = amax / 127 and s = d * sum(q) each rounded to fp16, exactly as llama.cpp quantizes activations. A block's dot
// product is then exact in integers (maddubs: u8 x s8 pairs into int16, which cannot saturate for 4-bit levels nor,
// by ggml's sign trick, for 8-bit ones) and scaled in float32:
//   q4_1: sum_b d_w d_x dot(q_w, q_x) + m_w s_x        q8_0: sum_b d_w d_x dot(q_w, q_x)
// The float sums run in one order per output element, whatever M is and however the rows are split over threads:
// a row's result never depends on the rows that came with it (the batch-invariant mode relies on it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights (and activations) per block

struct Q8Rows {  // x [M, K] quantized per block of 32: q [M, K] int8, d and s [M, K/32] float (fp16-rounded)
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

inline float fp16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, 0)); }

inline float fp16_at(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

Q8Rows quantize_rows(const float *x, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / QK);
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < blocks; i++) {
    const float *xb = x + i * QK;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    const float d = mx / 127.0f;
    const __m256 id = _mm256_set1_ps(mx != 0.0f ? 127.0f / mx : 0.0f);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as ggml's _MM_ROUND_NEAREST
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), nearest));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    out.d[i] = fp16_round(d);
    out.s[i] = fp16_round(d * static_cast<float>(_mm_cvtsi128_si32(s4)));
    // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute puts them back
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out.q.data() + i * QK), p);
  }
  return out;
}

// One weight row against MT activation rows: the block is unpacked once and dotted with each of them.
template <int MT, bool Q4>
inline void row_tile(const uint8_t *row, int64_t nb, const Q8Rows &x, int64_t m0, int64_t K, float *y,
                     int64_t N, int64_t n) {
  const int64_t bytes = Q4 ? 20 : 34;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  float summ[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps(), summ[t] = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *blk = row + b * bytes;
    const float dw = fp16_at(blk);
    __m256i qw;
    float mw = 0.0f;
    if constexpr (Q4) {
      mw = fp16_at(blk + 2);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 4));
      qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);  // 0..15, element order
    } else {
      qw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 2));
    }
    const __m256i aw = Q4 ? qw : _mm256_sign_epi8(qw, qw);  // maddubs takes unsigned bytes first: |w|, sign moved to x
    for (int t = 0; t < MT; t++) {
      const int64_t xb = (m0 + t) * nb + b;
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.q.data() + (m0 + t) * K + b * QK));
      if constexpr (!Q4) qx = _mm256_sign_epi8(qx, qw);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, qx), ones);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[xb]), _mm256_cvtepi32_ps(dot), acc[t]);
      if constexpr (Q4) summ[t] += mw * x.s[xb];
    }
  }
  for (int t = 0; t < MT; t++) y[(m0 + t) * N + n] = hsum(acc[t]) + summ[t];
}

template <bool Q4>
at::Tensor qdot_mm(const at::Tensor &x, const at::Tensor &blocks) {
  const int64_t bytes = Q4 ? 20 : 34;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "qdot: x must be a contiguous float32 CPU matrix [M, K], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "qdot: the weight must be a contiguous uint8 matrix of blocks [N, K/32 * ", bytes, "]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && blocks.size(1) == nb * bytes, "qdot: x has K = ", K,
              " columns; the weight's rows hold ", blocks.size(1), " bytes, not K/32 * ", bytes);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Q8Rows q = quantize_rows(x.data_ptr<float>(), M, K);
  const uint8_t *w = blocks.data_ptr<uint8_t>();
  float *out = y.data_ptr<float>();
  // rows of W split over torch's threads (its count, as the stage set it for this micro-batch)
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) {
      const uint8_t *row = w + n * nb * bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) row_tile<4, Q4>(row, nb, q, m, K, out, N, n);
      switch (M - m) {
        case 3: row_tile<3, Q4>(row, nb, q, m, K, out, N, n); break;
        case 2: row_tile<2, Q4>(row, nb, q, m, K, out, N, n); break;
        case 1: row_tile<1, Q4>(row, nb, q, m, K, out, N, n); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(stagemesh_qdot, m) {
  m.def("q4_1(Tensor x, Tensor blocks) -> Tensor");
  m.def("q8_0(Tensor x, Tensor blocks) -> Tensor");
  m.impl("q4_1", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<true>));
  m.impl("q8_0", c10::DispatchKey::CPU, TORCH_FN(qdot_mm<false>));
}
