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
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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
  for (int j = 0; j < 2 && valid > 16 * j; ++j) {
    const int left = valid - 16 * j;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, _mm512_add_ps(acc[i][j], b));
  }
}

template <typename W>
void gemm(const float* x, long M, long K, const W* panels, long N, const float* bias, float* y, int threads) {
  using Tile = void (*)(const float*, long, const W*, float*, long, int, const float*);
  static constexpr Tile tiles[kTileRows + 1] = {nullptr,    tile<1, W>, tile<2, W>,  tile<3, W>,  tile<4, W>,
                                                tile<5, W>, tile<6, W>, tile<7, W>,  tile<8, W>,  tile<9, W>,
                                                tile<10, W>, tile<11, W>, tile<12, W>};
  const long P = (N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long p = 0; p < P; ++p) {
    const int valid = (int)std::min<long>(kPanel, N - p * kPanel);
    const W* panel = panels + p * K * kPanel;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (long m = 0; m < M; m += kTileRows)
      tiles[std::min<long>(kTileRows, M - m)](x + m * K, K, panel, y + m * N + p * kPanel, N, valid, b);
  }
}

}  // namespace

extern "C" void fp32_gemm(const float* x, long M, long K, const float* panels, long N, const float* bias, float* y,
                          int threads) {
  gemm(x, M, K, panels, N, bias, y, threads);
}

extern "C" void bf16w_gemm(const float* x, long M, long K, const uint16_t* panels, long N, const float* bias,
                           float* y, int threads) {
  gemm(x, M, K, panels, N, bias, y, threads);
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
