// CPU kernels for decode-sized work (fp32, AVX2-friendly vector extensions), compiled on first
// use by services/model/kernels/cpu_kernels.py, which documents them and holds their Python wrappers.
// The sources are compiled as one translation unit, in cpu_kernels.SOURCES's order: this file
// (vectors, dot products, the small linear, RMSNorm, FP8 rows), experts.cpp, attention.cpp.
// The linears and the experts also take bf16 weights (fp32 inputs, outputs and sums): a weight
// loaded as bf16 is widened to fp32 in registers, exactly (its 16 bits shifted up), so the results
// are those of the fp32 kernel on the bf16-rounded weights, bit for bit. Products are summed
// with explicit FMAs (`fma`), the same in every loop (the build contracts nothing itself).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>
#define NO_GIL pybind11::gil_scoped_release no_gil  // entry points: other Python threads run meanwhile
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
// bf16 weights at p widened to the fp32 vector V (each value's 16 bits shifted up: exact); H / W
// are V's lanes as uint16 / uint32.
template <typename V, typename H, typename W>
static inline V widen_bf16(const at::BFloat16* p) {
  H h; __builtin_memcpy(&h, p, sizeof(H));
  const W w = __builtin_convertvector(h, W) << 16;
  V v; __builtin_memcpy(&v, &w, sizeof(V)); return v;
}
static inline v8 ld(const float* p) { v8 v; __builtin_memcpy(&v, p, 32); return v; }
static inline v8 ld(const at::BFloat16* p) { return widen_bf16<v8, u16x8, u32x8>(p); }
// a * b + c per lane, rounded once (V: v8 or v16): one FMA instruction where the CPU has it.
template <typename V>
static inline V fma(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  V r;
  for (int l = 0; l < (int)(sizeof(V) / sizeof(float)); ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
}
static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Dot products of one weight row wr [K] with N rows xs[i] [K] (K % 8 == 0), the rows' chains of
// adds side by side (one weight load each step); each row is summed in the same order whatever N
// is: a row's result does not depend on the rows beside it.
template <int N, typename W>
static inline void dots_n(const W* wr, const float* const* xs, int64_t K, float* out) {
  v8 a[N];
  for (int i = 0; i < N; ++i) a[i] = v8{0};
  for (int64_t k = 0; k < K; k += 8) {
    const v8 wv = ld(wr + k);
    for (int i = 0; i < N; ++i) a[i] = fma(ld(xs[i] + k), wv, a[i]);
  }
  for (int i = 0; i < N; ++i) out[i] = hsum(a[i]);
}

// dots_n<4> of two weight rows at once: 8 chains, each x load used twice (same sums, same order);
// the rows 4 ahead are prefetched (a hint, never a fault: it pays here, where each weight load
// feeds 8 chains, and costs up to half the speed in dots_n's 1-3 row loops).
template <typename W>
static inline void dots_4x2(const W* w0, const W* w1, const float* const* xs, int64_t K, float* o0, float* o1) {
  v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
  for (int64_t k = 0; k < K; k += 8) {
    const v8 u = ld(w0 + k), v = ld(w1 + k);
    if ((k & 15) == 0) { __builtin_prefetch(w0 + 4 * K + k, 0, 0); __builtin_prefetch(w1 + 4 * K + k, 0, 0); }
    v8 x = ld(xs[0] + k); a0 = fma(x, u, a0); b0 = fma(x, v, b0);
    x = ld(xs[1] + k); a1 = fma(x, u, a1); b1 = fma(x, v, b1);
    x = ld(xs[2] + k); a2 = fma(x, u, a2); b2 = fma(x, v, b2);
    x = ld(xs[3] + k); a3 = fma(x, u, a3); b3 = fma(x, v, b3);
  }
  o0[0] = hsum(a0); o0[1] = hsum(a1); o0[2] = hsum(a2); o0[3] = hsum(a3);
  o1[0] = hsum(b0); o1[1] = hsum(b1); o1[2] = hsum(b2); o1[3] = hsum(b3);
}

template <typename W>
static inline void dots(const W* wr, const float* const* xs, int n, int64_t K, float* out) {
  switch (n) {
    case 4: dots_n<4>(wr, xs, K, out); break;
    case 3: dots_n<3>(wr, xs, K, out); break;
    case 2: dots_n<2>(wr, xs, K, out); break;
    default: dots_n<1>(wr, xs, K, out);
  }
}

// The experts' dot products: R weight rows ws[r] [K] with N rows xs[i] [K] (K % 32 == 0) in
// 16-lane vectors, two chains per (weight row, x row) over alternate halves of each 32 values,
// out[r * N + i]. Each result is summed in the same order whatever N and R are.
static inline v16 ld16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
static inline v16 ld16(const at::BFloat16* p) { return widen_bf16<v16, u16x16, u32x16>(p); }
static inline float hsum16(v16 c) {
  v8 lo, hi; __builtin_memcpy(&lo, &c, 32); __builtin_memcpy(&hi, (const char*)&c + 32, 32);
  return hsum(lo + hi);
}
template <int R, int N, typename W>
static inline void dots16(const W* const* ws, const float* const* xs, int64_t K, float* out) {
  v16 a[R][N], b[R][N];
  for (int r = 0; r < R; ++r) for (int i = 0; i < N; ++i) a[r][i] = b[r][i] = v16{0};
  for (int64_t k = 0; k < K; k += 32) {
    v16 w0[R], w1[R];  // each weight loaded (and widened) once for the N rows
    for (int r = 0; r < R; ++r) { w0[r] = ld16(ws[r] + k); w1[r] = ld16(ws[r] + k + 16); }
    for (int i = 0; i < N; ++i) {
      const v16 x0 = ld16(xs[i] + k), x1 = ld16(xs[i] + k + 16);
      for (int r = 0; r < R; ++r) { a[r][i] = fma(x0, w0[r], a[r][i]); b[r][i] = fma(x1, w1[r], b[r][i]); }
    }
  }
  for (int r = 0; r < R; ++r) for (int i = 0; i < N; ++i) out[r * N + i] = hsum16(a[r][i] + b[r][i]);
}

// R (1 or 2) weight rows against n <= 4 rows: dots16 where K % 32 == 0, else `dots` per row.
template <int R, typename W>
static inline void expert_dots(const W* const* ws, const float* const* xs, int n, int64_t K, float* out) {
  if (K % 32) { for (int r = 0; r < R; ++r) dots(ws[r], xs, n, K, out + r * n); return; }
  switch (n) {
    case 4: dots16<R, 4>(ws, xs, K, out); break;
    case 3: dots16<R, 3>(ws, xs, K, out); break;
    case 2: dots16<R, 2>(ws, xs, K, out); break;
    default: dots16<R, 1>(ws, xs, K, out);
  }
}

// A register tile for 8 < M <= 32 rows: R weight rows w + r * K against NX x rows x + i * K
// (K % 16 == 0), out[r * NX + i]; one 16-lane FMA chain per (weight row, x row), so each result
// is summed in the same order whatever M is. Not inlined: inside the callers' loops GCC spills
// the accumulators to the stack.
template <int R, int NX, typename W>
__attribute__((noinline)) static void tile_dots(const W* w, const float* x, int64_t K, float* out) {
  v16 a[R][NX];
  for (int r = 0; r < R; ++r) for (int i = 0; i < NX; ++i) a[r][i] = v16{0};
  for (int64_t k = 0; k < K; k += 16) {
    v16 wv[R];  // each weight vector loaded (and widened) once for the NX rows
    for (int r = 0; r < R; ++r) wv[r] = ld16(w + r * K + k);
    for (int i = 0; i < NX; ++i) {
      const v16 xv = ld16(x + i * K + k);
      for (int r = 0; r < R; ++r) a[r][i] = fma(xv, wv[r], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) for (int i = 0; i < NX; ++i) out[r * NX + i] = hsum16(a[r][i]);
}
template <int R, typename W>
static inline void tile_rows(const W* w, const float* x, int nx, int64_t K, float* out) {
  switch (nx) {
    case 4: tile_dots<R, 4>(w, x, K, out); break;
    case 3: tile_dots<R, 3>(w, x, K, out); break;
    case 2: tile_dots<R, 2>(w, x, K, out); break;
    default: tile_dots<R, 1>(w, x, K, out);
  }
}

// Where small_linear reads its weight rows: `count` (<= 4) consecutive rows from row n, each K
// long. `Rows<W>`: an fp32 or bf16 tensor read in place; `Fp8Rows`: FP8 rows dequantized into the
// caller's buffer (4 rows of fp32) with fp8.dequantize_fp8_blocks's values (defined below).
template <typename WT>
struct Rows {
  using W = WT;
  const W* wp; int64_t K;
  const W* rows(int64_t n, int, float*) const { return wp + n * K; }
};
struct Fp8Rows;

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]); K % 8 == 0 (M <= 8) or K % 16 == 0 (M <= 64), x /
// bias / y fp32, w read through `src` (Rows or Fp8Rows), contiguous. Up to 8 rows (a weight read)
// each weight row is streamed once for all rows; beyond (compute), register tiles of 4 weight
// rows x 4 x rows.
template <typename Src>
static torch::Tensor small_linear_w(const torch::Tensor& x, const Src& src, int64_t N, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(src.K == K && (!bias.has_value() || bias->numel() == N) &&
              (M <= 8 ? K % 8 == 0 : M <= 64 && K % 16 == 0), "small_linear: shapes");
  constexpr bool buffered = std::is_same_v<Src, Fp8Rows>;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (M > 8) {
    at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t b0, int64_t b1) {
      float d[16];
      std::vector<float> buf(buffered ? 4 * K : 0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * 4; const int rows = (int)std::min<int64_t>(4, N - n0);
        const auto* wr = src.rows(n0, rows, buf.data());
        for (int64_t m = 0; m < M; m += 4) {
          const int nx = (int)std::min<int64_t>(4, M - m);
          if (rows == 4) tile_rows<4>(wr, xp + m * K, nx, K, d);
          else for (int r = 0; r < rows; ++r) tile_rows<1>(wr + r * K, xp + m * K, nx, K, d + r * nx);
          for (int r = 0; r < rows; ++r)
            for (int i = 0; i < nx; ++i) yp[(m + i) * N + n0 + r] = d[r * nx + i] + (bp ? bp[n0 + r] : 0.0f);
        }
      }
    });
    return y;
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const float* xs[4]; float d[4], e[4];
    std::vector<float> buf(buffered ? 2 * K : 0);
    int64_t n = n0;
    for (; M >= 4 && n + 2 <= n1; n += 2) {  // two weight rows at a time against blocks of 4 x rows
      const float b0 = bp ? bp[n] : 0.0f, b1 = bp ? bp[n + 1] : 0.0f;
      const auto* wr = src.rows(n, 2, buf.data());
      for (int64_t m = 0; m < M; m += 4) {
        const int c = (int)std::min<int64_t>(4, M - m);
        for (int i = 0; i < c; ++i) xs[i] = xp + (m + i) * K;
        if (c == 4) {
          dots_4x2(wr, wr + K, xs, K, d, e);
        } else {
          dots(wr, xs, c, K, d); dots(wr + K, xs, c, K, e);
        }
        for (int i = 0; i < c; ++i) { yp[(m + i) * N + n] = d[i] + b0; yp[(m + i) * N + n + 1] = e[i] + b1; }
      }
    }
    for (; n < n1; ++n) {
      const float b = bp ? bp[n] : 0.0f;
      const auto* wr = src.rows(n, 1, buf.data());
      for (int64_t m = 0; m < M; m += 4) {
        const int c = (int)std::min<int64_t>(4, M - m);
        for (int i = 0; i < c; ++i) xs[i] = xp + (m + i) * K;
        dots(wr, xs, c, K, d);
        for (int i = 0; i < c; ++i) yp[(m + i) * N + n] = d[i] + b;
      }
    }
  });
  return y;
}

static torch::Tensor small_linear_impl(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && (!bias.has_value() || bias->scalar_type() == at::kFloat), "small_linear: fp32 x and bias");
  if (w.scalar_type() == at::kBFloat16) return small_linear_w(x, Rows<at::BFloat16>{w.data_ptr<at::BFloat16>(), w.size(1)}, w.size(0), bias);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "small_linear: fp32 or bf16 weights, got ", w.scalar_type());
  return small_linear_w(x, Rows<float>{w.data_ptr<float>(), w.size(1)}, w.size(0), bias);
}

// RMSNorm of one row xr [K] (K % 8 == 0) into y: w * (xr * rsqrt(mean(xr^2) + eps)).
static inline void rms_norm_row(const float* xr, const float* w, int64_t K, double eps, float* y) {
  v8 a = {0};
  for (int64_t k = 0; k < K; k += 8) { const v8 v = ld(xr + k); a += v * v; }
  const float r = 1.0f / std::sqrt(hsum(a) / (float)K + (float)eps);
  for (int64_t k = 0; k < K; ++k) y[k] = w[k] * (xr[k] * r);
}

// RMSNorm of x [M, K] (fp32), row by row. x's rows may be strided (a column slice), its last dim
// contiguous.
static torch::Tensor rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t M = x.size(0), K = x.size(1), sx = x.stride(0);
  TORCH_CHECK(weight.numel() == K && K % 8 == 0 && x.stride(1) == 1 && weight.is_contiguous(), "rms_norm: shapes");
  auto y = torch::empty({M, K}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = weight.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * sx, wp, K, eps, yp + m * K);
  });
  return y;
}

// A hint to fetch the n weights at p into cache, for bf16 weights only (their widening makes the
// experts compute-bound, and a prefetch ahead keeps memory busy meanwhile; fp32 rows stream at
// the box's read bandwidth without it).
template <typename W>
static inline void prefetch_row(const W* p, int64_t n) {
  if constexpr (std::is_same_v<W, at::BFloat16>)
    for (int64_t b = 0; b < n * (int64_t)sizeof(W); b += 64) __builtin_prefetch((const char*)p + b, 0, 3);
}

// FP8 e4m3fn weights (DeepSeek's checkpoints, kept FP8) are dequantized one row at a time into
// fp32, with fp8.dequantize_fp8_blocks's values: each weight times its block's scale,
// rounded once. 16 at a time through fp16: an e4m3fn's bits moved into an fp16's (sign to bit 15,
// exponent and mantissa to bits 13-7) are the same number / 256, exactly (subnormals included),
// and the 256 goes into the scale (exact: a power of two); 0x7F / 0xFF (NaN) stay NaN.
typedef uint8_t u8x16 __attribute__((vector_size(16)));
static inline v16 fp8x16(const uint8_t* p) {
  u8x16 b; __builtin_memcpy(&b, p, 16);
  const u16x16 w = __builtin_convertvector(b, u16x16), mag = w & 0x7F;
  u16x16 h = ((w & 0x80) << 8) | (mag << 7);
  h = mag == 0x7F ? (h & 0x8000) | 0x7E00 : h;  // NaN
  v16 v;
#if defined(__AVX512F__)
  __m256i hv; __builtin_memcpy(&hv, &h, 32); const __m512 f = _mm512_cvtph_ps(hv); __builtin_memcpy(&v, &f, 64);
#elif defined(__F16C__)
  __m128i h0, h1; __builtin_memcpy(&h0, &h, 16); __builtin_memcpy(&h1, (const char*)&h + 16, 16);
  const __m256 f0 = _mm256_cvtph_ps(h0), f1 = _mm256_cvtph_ps(h1);
  __builtin_memcpy(&v, &f0, 32); __builtin_memcpy((char*)&v + 32, &f1, 32);
#else
  for (int l = 0; l < 16; ++l) {  // (fp16 -> fp32 by hand where the CPU has neither AVX-512 nor F16C)
    const uint32_t sign = (uint32_t)(h[l] & 0x8000) << 16, e = (h[l] >> 10) & 0x1F, m = h[l] & 0x3FF;
    float f = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? NAN : std::ldexp((float)(m | 0x400), (int)e - 25);
    uint32_t bits; __builtin_memcpy(&bits, &f, 4); bits |= sign; __builtin_memcpy(&f, &bits, 4); v[l] = f;
  }
#endif
  return v;
}
static inline void dequant_fp8_row(const uint8_t* w, const float* scale, int64_t K, int64_t bk, float* out) {
  // (K, bk % 16 == 0: each 16 values share a scale; the block is tracked, not divided for)
  int64_t b = 0, end = bk;
  auto scale_at = [&](int64_t k) { while (k >= end) { ++b; end += bk; } return scale[b] * 256.0f; };
  int64_t k = 0;
#if defined(__AVX512BW__)
  // 32 at a time: sign-extend to 16 bits, shift left 7, keep bit 15 and bits 13-7 (0xBF80); NaN
  // (low 7 bits all ones) gets the exponent's top bit too, which makes it an fp16 NaN
  const __m512i keep = _mm512_set1_epi16((short)0xBF80), low7 = _mm512_set1_epi16(0x7F);
  const __m512i nan_bits = _mm512_set1_epi16(0x7E00);
  for (; k + 32 <= K; k += 32) {
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
    __m512i h = _mm512_and_si512(_mm512_slli_epi16(v, 7), keep);
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, low7), low7);
    h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, nan_bits));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_set1_ps(scale_at(k)));
    const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), _mm512_set1_ps(scale_at(k + 16)));
    _mm512_storeu_ps(out + k, lo);
    _mm512_storeu_ps(out + k + 16, hi);
  }
#endif
  for (; k < K; k += 16) {
    const v16 v = fp8x16(w + k) * scale_at(k);
    __builtin_memcpy(out + k, &v, 64);
  }
}

// small_linear's FP8 rows (a linear kept FP8): w [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)].
struct Fp8Rows {
  using W = float;
  const uint8_t* wp; const float* scale; int64_t K, bn, bk;
  const float* rows(int64_t n, int count, float* buf) const {
    const int64_t cols = (K + bk - 1) / bk;
    for (int r = 0; r < count; ++r) dequant_fp8_row(wp + (n + r) * K, scale + ((n + r) / bn) * cols, K, bk, buf + r * K);
    return buf;
  }
};


// Entry points (the Python wrappers: cpu_kernels.py)
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  NO_GIL;
  return small_linear_impl(x, w, bias);
}
// small_linear on a linear kept FP8: w [N, K] float8_e4m3fn with its block scales [ceil(N / bn),
// ceil(K / bk)] fp32; K % 16 == 0, bk % 16 == 0. The bits of small_linear on the dequantized weight.
torch::Tensor small_linear_fp8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale, int64_t bn,
                               int64_t bk, const c10::optional<torch::Tensor>& bias) {
  NO_GIL;
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && (!bias.has_value() || bias->scalar_type() == at::kFloat) &&
              w.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat,
              "small_linear_fp8: fp32 x / bias / scale, float8_e4m3fn w");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && scale.is_contiguous() && bn > 0 && bk > 0 && bk % 16 == 0 &&
              K % 16 == 0 && scale.sizes() == at::IntArrayRef({(N + bn - 1) / bn, (K + bk - 1) / bk}),
              "small_linear_fp8: shapes");
  return small_linear_w(x, Fp8Rows{(const uint8_t*)w.data_ptr(), scale.data_ptr<float>(), K, bn, bk}, N, bias);
}
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  NO_GIL;
  return rms_norm_impl(x, weight, eps);
}
// The residual stream's update and its norm: [h + delta, rms_norm(h + delta)] (h, delta [M, K] fp32).
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& weight,
                                        double eps) {
  NO_GIL;
  TORCH_CHECK(h.dim() == 2 && h.sizes() == delta.sizes(), "add_rms_norm: h and delta of one shape [M, K]");
  const auto sum = at::add(h, delta);
  return {sum, rms_norm_impl(sum, weight, eps)};
}
