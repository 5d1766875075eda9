// codraft's CPU kernels for rollout forwards (AVX-512), loaded by cpu_kernels.py. Each computes a row's output the
// same way whatever other rows share its call, so a decode step and a verify forward compute a token alike.
//
// fp32_gemm / bf16w_gemm: y[M, N] = x[M, K] @ W^T (+ bias), x and y fp32, for one to a few thousand rows. W is
// packed once into panels of 32 output channels, [P][K][32] with P = ceil(N / 32) (channels past N are zero), so
// each panel streams from memory in order: fp32, or bf16 (half the bytes), whose 32 values at each k are stored
// interleaved (0, 16, 1, 17, ...) so that one 64-byte load widens to the two fp32 vectors by a shift and a mask.
// A tile of up to 12 input rows x one panel keeps 24 accumulators in registers: per k, the panel's 2 weight
// vectors are loaded once and used by every row of the tile. Panels are split between the threads (SmolLM2's
// widths, 576 to 49152, are all an even number of panels). Every output is one fused-multiply-add chain over
// k = 0..K-1 in fp32 from zero, then + bias: nothing in it depends on M, the tile a row falls in, or its thread.
//
// bf16_gemm: the same with x rounded to bf16 (to nearest even) and AVX-512 BF16 dot products: panels [P][K/2][32][2]
// hold each channel's weights at k and k + 1 side by side, and one vdpbf16ps adds both products of a pair to a
// channel's fp32 sum, twice the multiply-adds of an fma per instruction and no widening. Each output is one chain
// of such pair steps over k = 0, 2, ..., K-2 from zero, then + bias.
//
// cache_attention: softmax(q k^T * scale) v of each query over the keys its mask lets it see, in fp32, one query at
// a time in a fixed order: scores over the visible keys in ascending position, their exponentials, then one fma
// chain over the visible keys for the weighted values and one sum for the normaliser. A query's output depends on
// its own values and those keys only, not on the call's other queries, rows or cache columns it cannot see.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPanel = 32;  // output channels per panel: 2 AVX-512 vectors
constexpr int kTileRows = 12;  // 12 rows x 2 vectors = 24 accumulators (of 32 registers)

// The panel's 32 weights at k as two fp32 vectors (channels 0-15, 16-31).
inline void load_weights(const float* panel, long k, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(panel + k * kPanel);
  w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
}

// bf16 stored as (channel 16 + j) << 16 | channel j in each 32-bit lane j: a bf16 is an fp32's high half.
inline void load_weights(const uint16_t* panel, long k, __m512& w0, __m512& w1) {
  const __m512i pairs = _mm512_loadu_si512(panel + k * kPanel);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

// y[i][0, valid) = acc[i] + bias for the tile's R rows.
template <int R>
inline void store_tile(const __m512 (&acc)[R][2], float* y, long ldy, int valid, const float* bias) {
  for (int j = 0; j < 2 && valid > 16 * j; ++j) {
    const int left = valid - 16 * j;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, _mm512_add_ps(acc[i][j], b));
  }
}

// R rows of fp32 x [R][K] through one panel of fp32 or bf16 weights: one fma per row, channel and k.
template <int R, typename W>
void tile(const float* x, long K, const W* panel, float* y, long ldy, int valid, const float* bias) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (long k = 0; k < K; ++k) {
    __m512 w0, w1;
    load_weights(panel, k, w0, w1);
    for (int i = 0; i < R; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * K + k]);
      acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  store_tile<R>(acc, y, ldy, valid, bias);
}

// R rows of bf16 x as pairs [R][K/2] through one panel of weight pairs: one vdpbf16ps (acc += x[k] w[k] +
// x[k+1] w[k+1]) per row, channel and pair.
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void pair_tile(const uint32_t* x, long K2, const uint32_t* panel,
                                                              float* y, long ldy, int valid, const float* bias) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (long k = 0; k < K2; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * kPanel + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32((int)x[i * K2 + k]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
    }
  }
  store_tile<R>(acc, y, ldy, valid, bias);
}

template <typename X, typename W>
using Tile = void (*)(const X*, long, const W*, float*, long, int, const float*);

template <typename W>
constexpr Tile<float, W> kWidenTiles[kTileRows + 1] = {
    nullptr,     tile<1, W>, tile<2, W>, tile<3, W>, tile<4, W>,  tile<5, W>,  tile<6, W>,
    tile<7, W>, tile<8, W>, tile<9, W>, tile<10, W>, tile<11, W>, tile<12, W>};

constexpr Tile<uint32_t, uint32_t> kPairTiles[kTileRows + 1] = {
    nullptr,       pair_tile<1>, pair_tile<2>, pair_tile<3>,  pair_tile<4>,  pair_tile<5>, pair_tile<6>,
    pair_tile<7>, pair_tile<8>, pair_tile<9>, pair_tile<10>, pair_tile<11>, pair_tile<12>};

// x [M][depth] through panels [P][depth][32], `depth` steps of X (a value or a pair) per row and panel column.
template <typename X, typename W>
void gemm(const X* x, long M, long depth, const W* panels, long N, const float* bias, float* y, int threads,
          const Tile<X, W>* tiles) {
  const long P = (N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long p = 0; p < P; ++p) {
    const int valid = (int)std::min<long>(kPanel, N - p * kPanel);
    const W* panel = panels + p * depth * kPanel;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (long m = 0; m < M; m += kTileRows)
      tiles[std::min<long>(kTileRows, M - m)](x + m * depth, depth, panel, y + m * N + p * kPanel, N, valid, b);
  }
}

// exp of 16 lanes: 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-7 Taylor polynomial (its
// truncation error under 1e-8, 0.35^8 / 8!, below fp32's rounding). Lane by lane: a value's exp never depends on its
// neighbours.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

extern "C" void fp32_gemm(const float* x, long M, long K, const float* panels, long N, const float* bias, float* y,
                          int threads) {
  gemm(x, M, K, panels, N, bias, y, threads, kWidenTiles<float>);
}

extern "C" void bf16w_gemm(const float* x, long M, long K, const uint16_t* panels, long N, const float* bias,
                           float* y, int threads) {
  gemm(x, M, K, panels, N, bias, y, threads, kWidenTiles<uint16_t>);
}

// x fp32 [M][K] (K even), rounded to bf16 to nearest even, through bf16 weight pairs [P][K/2][32][2].
extern "C" __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void bf16_gemm(
    const float* x, long M, long K, const uint16_t* panels, long N, const float* bias, float* y, int threads) {
  std::vector<uint16_t> rounded(M * K);
  for (long i = 0; i < M * K; i += 16) {
    const __mmask16 mask = M * K - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (M * K - i)) - 1);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(rounded.data() + i, mask, (__m256i)b);
  }
  gemm(reinterpret_cast<const uint32_t*>(rounded.data()), M, K / 2, reinterpret_cast<const uint32_t*>(panels), N,
       bias, y, threads, kPairTiles);
}

extern "C" int has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// out = softmax(q k^T * scale) v per query, over the keys `visible` lets it see. q [B][H][S][D], keys and values
// [B][Hkv][L][D] (the same strides), visible [B][S or 1][L] (bytes), out [B][H][S][D]: each given by its strides in
// elements (D contiguous; a stride of 0 broadcasts, as visible's over S). D at most 256; query
// head h reads KV head h / (H / Hkv). A query that sees no key gets NaN, as SDPA gives.
extern "C" void cache_attention(const float* q, long qb, long qh, long qs, const float* keys, const float* values,
                                long kb, long kh, long kl, const uint8_t* visible, long vb, long vs, float* out,
                                long ob, long oh, long os, long B, long H, long S, long Hkv, long L, long D,
                                float scale, int threads) {
  const long groups = H / Hkv, tasks = B * H * S, chunks = (D + 15) / 16;
  const auto lanes = [&](long c) {  // the head dims of chunk c (the last one may be partial)
    return D - 16 * c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - 16 * c)) - 1);
  };
#pragma omp parallel num_threads(threads) if (tasks > 1)
  {
    std::vector<float> weights(L);
#pragma omp for schedule(static)
    for (long task = 0; task < tasks; ++task) {
      const long b = task / (H * S), h = task / S % H, s = task % S;
      const float* qv = q + b * qb + h * qh + s * qs;
      const float *k = keys + b * kb + h / groups * kh, *v = values + b * kb + h / groups * kh;
      const uint8_t* seen = visible + b * vb + s * vs;
      float top = -INFINITY;
      for (long l = 0; l < L; ++l) {  // scores, in weights
        if (!seen[l]) continue;
        __m512 dot = _mm512_setzero_ps();
        for (long c = 0; c < chunks; ++c)
          dot = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes(c), qv + 16 * c),
                                _mm512_maskz_loadu_ps(lanes(c), k + l * kl + 16 * c), dot);
        weights[l] = _mm512_reduce_add_ps(dot) * scale;
        top = std::max(top, weights[l]);
      }
      for (long l = 0; l < L; l += 16) {  // their exponentials (lanes no query reads are computed and left unread)
        const __mmask16 mask = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, weights.data() + l), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(weights.data() + l, mask, e);
      }
      __m512 acc[16];  // D <= 256
      for (long c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
      float total = 0.0f;
      for (long l = 0; l < L; ++l) {
        if (!seen[l]) continue;
        const __m512 w = _mm512_set1_ps(weights[l]);
        total += weights[l];
        for (long c = 0; c < chunks; ++c)
          acc[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(lanes(c), v + l * kl + 16 * c), acc[c]);
      }
      float* o = out + b * ob + h * oh + s * os;
      const __m512 norm = _mm512_set1_ps(1.0f / total);
      for (long c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(o + 16 * c, lanes(c), _mm512_mul_ps(acc[c], norm));
    }
  }
}

// y[M, D] = x * w / sqrt(mean(x^2) + eps) per row, in fp32 (RMSNorm of a rollout forward). The sum of squares is
// one fma chain per lane over the row's 16-wide chunks, then the lanes' sum: a row's output does not depend on M.
extern "C" void rms_norm(const float* x, long M, long D, const float* w, float eps, float* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * D >= (1 << 16))
  for (long m = 0; m < M; ++m) {
    const float* xm = x + m * D;
    float* ym = y + m * D;
    __m512 squares = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) {
      const __mmask16 mask = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, xm + d);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / (float)D + eps));
    for (long d = 0; d < D; d += 16) {
      const __mmask16 mask = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xm + d), scale);
      _mm512_mask_storeu_ps(ym + d, mask, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, w + d)));
    }
  }
}
