// CPU kernels for decode-sized work (fp32, AVX2-friendly vector extensions), compiled on first
// use by services/model/cpu_kernels.py, which documents them and holds their Python wrappers.
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
// caller's buffer (4 rows of fp32) with checkpoint.dequantize_fp8_blocks's values (defined below).
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
// fp32, with checkpoint.dequantize_fp8_blocks's values: each weight times its block's scale,
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

// Where expert_ffn reads its weight rows: w13 row r (of 2I: gate rows, then up) and w2 row n (of
// H) of slot s. `Packed<W>`: fp32 or bf16 tensors read in place; `Fp8`: FP8 rows dequantized into
// the caller's fp32 buffer (W = float for the dot kernels), with block scales s13 [S, 2I / bn,
// ceil(H / bk)] and s2 [S, ceil(H / bn), ceil(I / bk)].
template <typename WT>
struct Packed {
  using W = WT;
  const W* w13p; const W* w2p; int64_t I, H;
  const W* w13(int64_t s, int64_t r, float*) const { return w13p + (s * 2 * I + r) * H; }
  const W* w2(int64_t s, int64_t n, float*) const { return w2p + (s * H + n) * I; }
  void prefetch13(int64_t s, int64_t r) const { prefetch_row(w13(s, r, nullptr), H); }
  void prefetch2(int64_t s, int64_t n) const { prefetch_row(w2(s, n, nullptr), I); }
};
struct Fp8 {
  using W = float;
  const uint8_t* w13p; const uint8_t* w2p; const float* s13; const float* s2; int64_t I, H, bn, bk;
  const float* w13(int64_t s, int64_t r, float* buf) const {
    const int64_t rows = 2 * I / bn, cols = (H + bk - 1) / bk;
    dequant_fp8_row(w13p + (s * 2 * I + r) * H, s13 + (s * rows + r / bn) * cols, H, bk, buf);
    return buf;
  }
  const float* w2(int64_t s, int64_t n, float* buf) const {
    const int64_t rows = (H + bn - 1) / bn, cols = (I + bk - 1) / bk;
    dequant_fp8_row(w2p + (s * H + n) * I, s2 + (s * rows + n / bn) * cols, I, bk, buf);
    return buf;
  }
  void prefetch13(int64_t, int64_t) const {}
  void prefetch2(int64_t, int64_t) const {}
};

// Routed experts of a few tokens, whole: out[T, H] (fp32) = sum over k of weight[t, k] *
// FFN_{slot[t, k]}(x[t]) with FFN_s(x) = w2[s] (silu(g) * u), [g | u] = w13[s] x (g clamped to
// <= limit, u to [-limit, limit] when limit > 0). x [T, H], slot [T, K] int64 (-1: none),
// weight [T, K], w13 [S, 2I, H], w2 [S, H, I] (read through `src`: Packed or Fp8 above); H, I % 8
// == 0. Each expert weight row is read once for all of its slot's tokens; a token's choices are
// summed in slot order.
template <typename Src>
static torch::Tensor expert_ffn_w(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                                  const Src& src, int64_t S, double limit) {
  using W = typename Src::W;
  const int64_t T = x.size(0), H = src.H, K = slot.size(1), I = src.I;
  TORCH_CHECK(x.size(1) == H && slot.size(0) == T && weight.numel() == T * K && H % 8 == 0 && I % 8 == 0,
              "expert_ffn: shapes");
  const int64_t* sp = slot.data_ptr<int64_t>();
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t p = 0; p < T * K; ++p) {
    TORCH_CHECK(sp[p] < S, "expert slot ", sp[p], " out of range [0, ", S, ")");
    if (sp[p] >= 0) start[sp[p] + 1]++;
  }
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  const int64_t P = start[S];
  std::vector<int64_t> pair(P), fill(start.begin(), start.end() - 1);  // pairs by slot, token order
  for (int64_t p = 0; p < T * K; ++p) if (sp[p] >= 0) pair[fill[sp[p]]++] = p;
  std::vector<int64_t> busy;
  for (int64_t s = 0; s < S; ++s) if (start[s + 1] > start[s]) busy.push_back(s);
  const int64_t B = busy.size();
  auto act = torch::empty({std::max<int64_t>(P, 1), I}, x.options());
  auto ys = torch::empty({std::max<int64_t>(P, 1), H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* ap = act.data_ptr<float>(); float* yp = ys.data_ptr<float>();
  const float lim = (float)limit;
  at::parallel_for(0, B * I, 32, [&](int64_t i0, int64_t i1) {  // (busy slot, intermediate column)
    const float* xs[4]; float gu[8];
    std::vector<float> buf(std::is_same_v<Src, Fp8> ? 2 * H : 0);  // (FP8: the dequantized rows)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = busy[i / I], j = i % I;
      const W* ws[2] = {src.w13(s, j, buf.data()), src.w13(s, I + j, buf.data() + H)};  // gate, up rows
      if (i + 4 < i1) {  // the gate and up rows of the item 4 ahead
        const int64_t s4 = busy[(i + 4) / I], j4 = (i + 4) % I;
        src.prefetch13(s4, j4); src.prefetch13(s4, I + j4);
      }
      for (int64_t p = start[s]; p < start[s + 1]; p += 4) {
        const int c = (int)std::min<int64_t>(4, start[s + 1] - p);
        for (int r = 0; r < c; ++r) xs[r] = xp + (pair[p + r] / K) * H;
        expert_dots<2>(ws, xs, c, H, gu);
        for (int r = 0; r < c; ++r) {
          float gr = gu[r], ur = gu[c + r];
          if (lim > 0) { gr = std::min(gr, lim); ur = std::min(std::max(ur, -lim), lim); }
          ap[(p + r) * I + j] = gr / (1.0f + std::exp(-gr)) * ur;
        }
      }
    }
  });
  at::parallel_for(0, B * H, 32, [&](int64_t i0, int64_t i1) {  // (busy slot, output column)
    const float* as[4]; float d[4];
    std::vector<float> buf(std::is_same_v<Src, Fp8> ? I : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = busy[i / H], n = i % H;
      const W* dw[1] = {src.w2(s, n, buf.data())};
      if (i + 8 < i1) src.prefetch2(busy[(i + 8) / H], (i + 8) % H);  // the row 8 items ahead
      for (int64_t p = start[s]; p < start[s + 1]; p += 4) {
        const int c = (int)std::min<int64_t>(4, start[s + 1] - p);
        for (int r = 0; r < c; ++r) as[r] = ap + (p + r) * I;
        expert_dots<1>(dw, as, c, I, d);
        for (int r = 0; r < c; ++r) yp[(p + r) * H + n] = d[r];
      }
    }
  });
  std::vector<int64_t> first(T + 1, 0), order(P);  // each token's pairs, in slot order
  for (int64_t p = 0; p < P; ++p) first[pair[p] / K + 1]++;
  for (int64_t t = 0; t < T; ++t) first[t + 1] += first[t];
  std::vector<int64_t> at_(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[at_[pair[p] / K]++] = p;
  auto out = torch::zeros({T, H}, x.options());
  float* op = out.data_ptr<float>(); const float* wtp = weight.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t q = first[t]; q < first[t + 1]; ++q) {
        const int64_t p = order[q]; const float wgt = wtp[pair[p]];
        for (int64_t n = 0; n < H; ++n) op[t * H + n] += yp[p * H + n] * wgt;
      }
  });
  return out;
}

template <typename W>
static torch::Tensor expert_ffn_packed(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                                       const torch::Tensor& w13, const torch::Tensor& w2, double limit) {
  const int64_t S = w13.size(0), I = w2.size(2), H = w13.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w2.size(0) == S && w2.size(1) == H, "expert_ffn: shapes");
  return expert_ffn_w(x, slot, weight, Packed<W>{w13.data_ptr<W>(), w2.data_ptr<W>(), I, H}, S, limit);
}
static torch::Tensor expert_ffn_impl(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                                     const torch::Tensor& w13, const torch::Tensor& w2, double limit) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && w13.scalar_type() == w2.scalar_type(),
              "expert_ffn: fp32 x and weight, w13 and w2 of one dtype");
  if (w13.scalar_type() == at::kBFloat16) return expert_ffn_packed<at::BFloat16>(x, slot, weight, w13, w2, limit);
  TORCH_CHECK(w13.scalar_type() == at::kFloat, "expert_ffn: fp32 or bf16 expert weights, got ", w13.scalar_type());
  return expert_ffn_packed<float>(x, slot, weight, w13, w2, limit);
}
torch::Tensor expert_ffn(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                         const torch::Tensor& w13, const torch::Tensor& w2, double limit) {
  NO_GIL;
  return expert_ffn_impl(x, slot, weight, w13, w2, limit);
}
// expert_ffn on FP8 experts kept FP8: w13 [S, 2I, H] / w2 [S, H, I] float8_e4m3fn, their block
// scales w13_scale [S, 2I / bn, ceil(H / bk)] / w2_scale [S, ceil(H / bn), ceil(I / bk)] fp32; bn
// divides I, bk % 16 == 0, H and I % 16 == 0. The bits of expert_ffn on the dequantized weights.
torch::Tensor expert_ffn_fp8(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                             const torch::Tensor& w13, const torch::Tensor& w2, const torch::Tensor& w13_scale,
                             const torch::Tensor& w2_scale, int64_t bn, int64_t bk, double limit) {
  NO_GIL;
  const int64_t S = w13.size(0), I = w2.size(2), H = w13.size(2);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
              w13.scalar_type() == at::kFloat8_e4m3fn && w2.scalar_type() == at::kFloat8_e4m3fn &&
              w13_scale.scalar_type() == at::kFloat && w2_scale.scalar_type() == at::kFloat,
              "expert_ffn_fp8: fp32 x / weight / scales, float8_e4m3fn w13 / w2");
  TORCH_CHECK(bn > 0 && bk > 0 && I % bn == 0 && bk % 16 == 0 && H % 16 == 0 && I % 16 == 0 &&
              w13.dim() == 3 && w13.size(1) == 2 * I && w2.size(0) == S && w2.size(1) == H &&
              w13.is_contiguous() && w2.is_contiguous() && w13_scale.is_contiguous() && w2_scale.is_contiguous() &&
              w13_scale.sizes() == at::IntArrayRef({S, 2 * I / bn, (H + bk - 1) / bk}) &&
              w2_scale.sizes() == at::IntArrayRef({S, (H + bn - 1) / bn, (I + bk - 1) / bk}),
              "expert_ffn_fp8: shapes");
  const Fp8 src{(const uint8_t*)w13.data_ptr(), (const uint8_t*)w2.data_ptr(), w13_scale.data_ptr<float>(),
                w2_scale.data_ptr<float>(), I, H, bn, bk};
  return expert_ffn_w(x, slot, weight, src, S, limit);
}
// A dense SwiGLU MLP (w13 [2I, H]: gate rows then up rows, w2 [H, I]) for a few rows x [T, H]:
// expert_ffn with every row on one slot at weight 1 (its sums, bit for bit).
torch::Tensor dense_ffn(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2) {
  NO_GIL;
  const int64_t T = x.size(0);
  return expert_ffn_impl(x, torch::zeros({T, 1}, x.options().dtype(torch::kInt64)), torch::ones({T, 1}, x.options()),
                         w13.unsqueeze(0), w2.unsqueeze(0), 0.0);
}

// Interleaved-pair rope of one row x [2h] into out, with c = cos[i], s = sin[i]: out[2i] = x[2i] c -
// x[2i+1] s, out[2i+1] = x[2i+1] c + x[2i] s (as layers.Rope).
static inline void rope_row(const float* x, const float* cos, const float* sin, int64_t h, float* out) {
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = x[2 * i], x2 = x[2 * i + 1], c = cos[i], s = sin[i];
    out[2 * i] = x1 * c - x2 * s; out[2 * i + 1] = x2 * c + x1 * s;
  }
}

// rope_row over x [T, N, R] (last dim contiguous) with cos / sin [T, R/2] -> out [T, N, R].
static torch::Tensor rope_interleaved_impl(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t T = x.size(0), N = x.size(1), R = x.size(2), st = x.stride(0), sn = x.stride(1), h = R / 2;
  TORCH_CHECK(x.stride(2) == 1 && R % 2 == 0 && cos.numel() == T * h && sin.numel() == T * h, "rope_interleaved: shapes");
  auto out = torch::empty({T, N, R}, x.options());
  const float* xp = x.data_ptr<float>(); const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t n = 0; n < N; ++n) rope_row(xp + t * st + n * sn, cp + t * h, sp + t * h, h, op + (t * N + n) * R);
  });
  return out;
}

// DeepSeek-V3's router (sigmoid scores, noaux_tc): logits = x [T, H] @ gate_w [E, H]^T, s =
// sigmoid(logits), choice = s + bias [E] (bias may be empty); with G > 1 groups the top
// `topk_group` groups by the sum of their best two choices are kept; the K best choices among
// them are picked (best first; ties: lower expert); weights are their s, divided by (their sum +
// 1e-20) when norm, times scale. Returns [idx [T, K] int64, weight [T, K] fp32].
std::vector<torch::Tensor> route_sigmoid(const torch::Tensor& x, const torch::Tensor& gate_w, const torch::Tensor& bias,
                                         int64_t G, int64_t topk_group, int64_t K, bool norm, double scale) {
  NO_GIL;
  const int64_t T = x.size(0), H = x.size(1), E = gate_w.size(0);
  TORCH_CHECK(G >= 1 && gate_w.size(1) == H && H % 8 == 0 && E % G == 0 && topk_group >= 1 && topk_group <= G &&
              K >= 1 && K <= (G > 1 ? topk_group * (E / G) : E) && (bias.numel() == 0 || bias.numel() == E),
              "route_sigmoid: shapes");
  const int64_t per = E / G;
  auto idx = torch::empty({T, K}, x.options().dtype(torch::kInt64));
  auto wt = torch::empty({T, K}, x.options());
  const float* xp = x.data_ptr<float>(); const float* gp = gate_w.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  int64_t* ip = idx.data_ptr<int64_t>(); float* wp = wt.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(E), choice(E), group(G);
    std::vector<char> allowed(E), taken(G);
    const float* xs[1]; float d[1];
    for (int64_t t = t0; t < t1; ++t) {
      xs[0] = xp + t * H;
      for (int64_t e = 0; e < E; ++e) {
        dots(gp + e * H, xs, 1, H, d);
        score[e] = 1.0f / (1.0f + std::exp(-d[0]));
        choice[e] = bp ? score[e] + bp[e] : score[e];
      }
      std::fill(allowed.begin(), allowed.end(), G > 1 ? 0 : 1);
      if (G > 1) {  // (selection by flags, not by -inf sentinels: a NaN input still picks valid ids)
        for (int64_t g = 0; g < G; ++g) {
          float a = -INFINITY, b = -INFINITY;
          for (int64_t e = g * per; e < (g + 1) * per; ++e) {
            if (choice[e] > a) { b = a; a = choice[e]; } else if (choice[e] > b) b = choice[e];
          }
          group[g] = a + b;
        }
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t k = 0; k < topk_group; ++k) {
          int64_t best = -1;
          for (int64_t g = 0; g < G; ++g)
            if (!taken[g] && (best < 0 || group[g] > group[best])) best = g;
          taken[best] = 1;
          for (int64_t e = best * per; e < (best + 1) * per; ++e) allowed[e] = 1;
        }
      }
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (allowed[e] && (best < 0 || choice[e] > choice[best])) best = e;
        allowed[best] = 0;
        ip[t * K + k] = best; wp[t * K + k] = score[best]; sum += score[best];
      }
      for (int64_t k = 0; k < K; ++k) {
        if (norm && K > 1) wp[t * K + k] = wp[t * K + k] / (sum + 1e-20f);
        wp[t * K + k] = wp[t * K + k] * (float)scale;
      }
    }
  });
  return {idx, wt};
}

// MLA decode attention over the paged latent cache, one query token per sequence, in place
// (no gather, no padding): o[b, h] = sum_l softmax_l(scale * q[b, h] . row_l[:QD]) row_l[:C],
// row_l = cache row of token l < lens[b] through table[b]. q [B, N, QD] (QD = C + R), cache
// [blocks, 64, 1, W] fp32, table [B, max_blocks] int64, lens [B] int64; QD, C % 8 == 0. Heads
// go in groups of 4 that share each row's load (the latent is one KV head for all of them).
static torch::Tensor mla_decode_impl(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& table,
                         const torch::Tensor& lens, int64_t C, double scale) {
  constexpr int HG = 4;
  const int64_t B = q.size(0), N = q.size(1), QD = q.size(2), W = cache.size(-1), MB = table.size(1);
  const int64_t groups = (N + HG - 1) / HG;
  TORCH_CHECK(QD % 8 == 0 && C % 8 == 0 && C <= QD && QD <= W && cache.dim() == 4 && cache.size(1) == 64 &&
              table.size(0) == B && lens.numel() == B && table.scalar_type() == torch::kInt64 &&
              lens.scalar_type() == torch::kInt64, "mla_decode: shapes");
  for (int64_t b = 0; b < B; ++b) {  // every row read must be inside the cache
    const int64_t L = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(L >= 1 && L <= MB * 64, "mla_decode: context length ", L, " outside [1, ", MB * 64, "]");
    for (int64_t j = 0; j < (L + 63) / 64; ++j) {
      const int64_t blk = table.data_ptr<int64_t>()[b * MB + j];
      TORCH_CHECK(blk >= 0 && blk < cache.size(0), "mla_decode: block ", blk, " outside the cache");
    }
  }
  auto o = torch::empty({B, N, C}, q.options());
  const float* qp = q.data_ptr<float>(); const float* cp = cache.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>(); const int64_t* lp = lens.data_ptr<int64_t>();
  float* outp = o.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / groups, h0 = (i % groups) * HG, L = lp[b];
      const int nh = (int)std::min<int64_t>(HG, N - h0);
      const float* qs[HG]; float d[HG], mx[HG], sum[HG];
      for (int j = 0; j < nh; ++j) { qs[j] = qp + (b * N + h0 + j) * QD; mx[j] = -INFINITY; sum[j] = 0.0f; }
      p.resize(HG * L);
      for (int64_t l = 0; l < L; ++l) {
        dots(cp + (tp[b * MB + l / 64] * 64 + l % 64) * W, qs, nh, QD, d);
        for (int j = 0; j < nh; ++j) { p[j * L + l] = d[j] * sc; mx[j] = std::max(mx[j], p[j * L + l]); }
      }
      for (int j = 0; j < nh; ++j)
        for (int64_t l = 0; l < L; ++l) { p[j * L + l] = std::exp(p[j * L + l] - mx[j]); sum[j] += p[j * L + l]; }
      float* orow = outp + (b * N + h0) * C;
      for (int64_t c = 0; c < nh * C; ++c) orow[c] = 0.0f;
      for (int64_t l = 0; l < L; ++l) {
        const float* row = cp + (tp[b * MB + l / 64] * 64 + l % 64) * W;
        for (int j = 0; j < nh; ++j) {
          const float pl = p[j * L + l] / sum[j];
          const v8 pv = {pl, pl, pl, pl, pl, pl, pl, pl};
          float* oj = orow + j * C;
          for (int64_t c = 0; c < C; c += 8) { const v8 v = ld(oj + c) + pv * ld(row + c); __builtin_memcpy(oj + c, &v, 32); }
        }
      }
    }
  });
  return o;
}

// One MLA layer for a decode-only step, whole (the absorbed form of model.mla_forward, the same
// arithmetic in the same order, called from C++: ~35 torch calls from Python cost more than their work
// at batch 1). x [T, H] -> [T, H]; writes each token's [c_kv | k_pe] row at slot_mapping [T].
// Weights as model.MLAWeights (q via q_a/q_b or q_proj; optional biases); cos / sin [T, R/2].
// cpu_kernels.linear from C++: small_linear where it takes the shape (MAX_ROWS = 8 rows with K % 8
// == 0, TILE_ROWS = 32 rows with K % 16 == 0 and K >= 256), ATen's linear otherwise (on a widened
// copy of bf16 weights).
// A linear kept FP8 (w [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)], K and bk % 16 == 0)
// read through Fp8Rows where small_linear takes the shape, else dequantized whole (the values of
// checkpoint.dequantize_fp8_blocks) for ATen's linear: the bits of `lin` on the dequantized weight.
struct Fp8Linear { const torch::Tensor* scale; int64_t bn, bk; };
static torch::Tensor dequant_fp8(const torch::Tensor& w, const Fp8Linear& q) {
  const int64_t N = w.size(0), K = w.size(1), cols = (K + q.bk - 1) / q.bk;
  auto out = torch::empty({N, K}, w.options().dtype(torch::kFloat));
  const uint8_t* wp = (const uint8_t*)w.data_ptr(); const float* sp = q.scale->data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequant_fp8_row(wp + n * K, sp + (n / q.bn) * cols, K, q.bk, op + n * K);
  });
  return out;
}
static torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b,
                         const Fp8Linear* fp8 = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool small = M <= 8 ? K % 8 == 0 : M <= 32 && K % 16 == 0 && K >= 256;
  const auto bias = b.has_value() ? c10::optional<torch::Tensor>(b->contiguous()) : c10::nullopt;
  if (fp8 != nullptr) {  // (register tiles up to 64 rows, as cpu_kernels.fp8_linear: FP8_TILE_ROWS)
    const bool tiles = M <= 8 || (M <= 64 && K >= 256);
    TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && w.is_contiguous() && K % 16 == 0 && fp8->bk % 16 == 0 &&
                fp8->scale->sizes() == at::IntArrayRef({(w.size(0) + fp8->bn - 1) / fp8->bn, (K + fp8->bk - 1) / fp8->bk}),
                "mla_decode_layer: FP8 weight and scale shapes");
    if (!tiles) return at::linear(x, dequant_fp8(w, *fp8), b);
    const Fp8Rows src{(const uint8_t*)w.data_ptr(), fp8->scale->data_ptr<float>(), K, fp8->bn, fp8->bk};
    return small_linear_w(x.contiguous(), src, w.size(0), bias);
  }
  if (!small) return at::linear(x, w.to(x.scalar_type()), b);
  return small_linear_impl(x.contiguous(), w.contiguous(), bias);
}

// The absorbed attention's products with kv_b3 [N, D + V, C] (fp32, contiguous) for a few tokens,
// per head over the head's rows (at::bmm runs a small GEMM per head, slow at decode sizes):
// absorb_q: q_lat[t, n] = q[t, n, :D] @ kv_b3[n, :D] (q [T, N, >= D], last dim contiguous) ->
// [T, N, C], each token's sum over d in order; absorb_o: o[t, n, v] = o_lat[t, n] . kv_b3[n, D + v]
// (o_lat [T, N, C] contiguous) -> [T, N, V].
// (absorb_q writing token t, head n at op + (t * N + n) * so: so >= C)
static void absorb_q_into(const torch::Tensor& q, const torch::Tensor& kv_b3, int64_t D, float* op, int64_t so) {
  const int64_t T = q.size(0), N = q.size(1), C = kv_b3.size(2), W = kv_b3.size(1), st = q.stride(0), sn = q.stride(1);
  TORCH_CHECK(q.stride(2) == 1 && C % 8 == 0 && kv_b3.is_contiguous() && kv_b3.size(0) == N, "absorb_q: layout");
  const float* qp = q.data_ptr<float>(); const float* kp = kv_b3.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t = 0; t < T; ++t) {
        float* o = op + (t * N + n) * so; const float* qr = qp + t * st + n * sn;
        for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qr[d]; const v8 qv = {qd, qd, qd, qd, qd, qd, qd, qd};
          const float* row = kp + (n * W + d) * C;
          for (int64_t c = 0; c < C; c += 8) { const v8 v = fma(qv, ld(row + c), ld(o + c)); __builtin_memcpy(o + c, &v, 32); }
        }
      }
  });
}
static torch::Tensor absorb_q_impl(const torch::Tensor& q, const torch::Tensor& kv_b3, int64_t D) {
  auto out = torch::empty({q.size(0), q.size(1), kv_b3.size(2)}, q.options());
  absorb_q_into(q, kv_b3, D, out.data_ptr<float>(), kv_b3.size(2));
  return out;
}
static torch::Tensor absorb_o_impl(const torch::Tensor& o_lat, const torch::Tensor& kv_b3, int64_t D) {
  const int64_t T = o_lat.size(0), N = o_lat.size(1), C = o_lat.size(2), W = kv_b3.size(1), V = W - D;
  TORCH_CHECK(o_lat.is_contiguous() && C % 8 == 0, "absorb_o: layout");
  auto out = torch::empty({T, N, V}, o_lat.options());
  const float* ap = o_lat.data_ptr<float>(); const float* kp = kv_b3.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    const float* xs[4]; float d[4];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t v = 0; v < V; ++v)
        for (int64_t t = 0; t < T; t += 4) {
          const int c = (int)std::min<int64_t>(4, T - t);
          for (int i = 0; i < c; ++i) xs[i] = ap + ((t + i) * N + n) * C;
          dots(kp + (n * W + D + v) * C, xs, c, C, d);
          for (int i = 0; i < c; ++i) op[((t + i) * N + n) * V + v] = d[i];
        }
  });
  return out;
}

torch::Tensor mla_decode_layer(const torch::Tensor& x, const c10::optional<torch::Tensor>& q_a,
                               const c10::optional<torch::Tensor>& q_a_bias, const c10::optional<torch::Tensor>& q_a_norm,
                               const c10::optional<torch::Tensor>& q_b, const c10::optional<torch::Tensor>& q_proj,
                               const torch::Tensor& kv_a, const c10::optional<torch::Tensor>& kv_a_bias,
                               const torch::Tensor& kv_a_norm, const torch::Tensor& kv_b, const torch::Tensor& o_w,
                               const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& cache, const torch::Tensor& slot_mapping, const torch::Tensor& table,
                               const torch::Tensor& lens, int64_t D, int64_t R, int64_t C, int64_t V, double eps, double scale,
                               const std::vector<torch::Tensor>& fp8_scales, int64_t bn, int64_t bk) {
  NO_GIL;
  const int64_t T = x.size(0), W = cache.size(-1);
  TORCH_CHECK(W == C + R, "mla_decode_layer: cache rows of ", W, " values, expected ", C + R);
  // linears kept FP8: the block scales of q_a, q_b, q_proj, kv_a, o (an empty tensor where absent)
  TORCH_CHECK(fp8_scales.empty() || fp8_scales.size() == 5, "mla_decode_layer: 5 FP8 scales or none");
  Fp8Linear fp8[5];
  for (size_t i = 0; i < fp8_scales.size(); ++i) {
    TORCH_CHECK(fp8_scales[i].scalar_type() == at::kFloat && fp8_scales[i].is_contiguous(), "mla_decode_layer: fp32 scales");
    fp8[i] = {&fp8_scales[i], bn, bk};
  }
  auto q8 = [&](int i) { return fp8_scales.empty() ? nullptr : &fp8[i]; };
  const torch::Tensor q = q_proj.has_value()
      ? lin(x, *q_proj, c10::nullopt, q8(2))
      : lin(rms_norm_impl(lin(x, *q_a, q_a_bias, q8(0)), *q_a_norm, eps), *q_b, c10::nullopt, q8(1));
  const int64_t N = q.size(1) / (D + R), h = R / 2, rows = cache.numel() / W;
  const auto q3 = q.view({T, N, D + R});
  const auto kv = lin(x, kv_a, kv_a_bias, q8(3));  // [T, C+R]
  TORCH_CHECK(kv.size(1) == C + R && kv.is_contiguous() && q.is_contiguous() && slot_mapping.numel() == T &&
              slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_cpu() && slot_mapping.is_contiguous() &&
              cos.numel() == T * h && sin.numel() == T * h && cos.is_contiguous() && sin.is_contiguous() &&
              kv_a_norm.numel() == C && kv_a_norm.is_contiguous() && cache.is_contiguous() && R % 2 == 0 && C % 8 == 0,
              "mla_decode_layer: shapes");
  // q_full [T, N, C+R]: per head the absorbed q_nope (below), then the roped q_pe; each token's
  // cache row: [normed c_kv | roped k_pe], written in place (the small per-token work in one loop)
  auto q_full = torch::empty({T, N, C + R}, x.options());
  const float* qp = q.data_ptr<float>(); const float* kvp = kv.data_ptr<float>(); const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>(); const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  float* qf = q_full.data_ptr<float>(); float* rowp = cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)  // (every slot checked before any row is written)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < rows, "mla_decode_layer: cache slot ", slot[t], " outside [0, ", rows, ")");
  for (int64_t t = 0; t < T; ++t) {
    float* row = rowp + slot[t] * W; const float* kvt = kvp + t * (C + R);
    rms_norm_row(kvt, kv_a_norm.data_ptr<float>(), C, eps, row);
    rope_row(kvt + C, cp + t * h, sp + t * h, h, row + C);
    for (int64_t n = 0; n < N; ++n) rope_row(qp + (t * N + n) * (D + R) + D, cp + t * h, sp + t * h, h, qf + (t * N + n) * (C + R) + C);
  }
  const auto kv_b3 = kv_b.view({N, D + V, C});
  const bool few = T <= 8 && kv_b.is_contiguous();  // per-head dot products, not one small GEMM per head
  if (few) absorb_q_into(q3, kv_b3, D, qf, C + R);
  else q_full.narrow(2, 0, C).copy_(at::bmm(q3.narrow(2, 0, D).transpose(0, 1), kv_b3.narrow(1, 0, D)).transpose(0, 1));
  const auto o_lat = mla_decode_impl(q_full, cache, table, lens, C, scale);  // [T, N, C]
  const auto o = few ? absorb_o_impl(o_lat, kv_b3, D)
                     : at::bmm(o_lat.transpose(0, 1), kv_b3.narrow(1, D, V).transpose(1, 2)).transpose(0, 1);  // [T, N, V]
  return lin(o.reshape({T, N * V}), o_w, o_bias, q8(4));
}

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
torch::Tensor rope_interleaved(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  NO_GIL;
  return rope_interleaved_impl(x, cos, sin);
}
torch::Tensor mla_decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& table,
                         const torch::Tensor& lens, int64_t C, double scale) {
  NO_GIL;
  return mla_decode_impl(q, cache, table, lens, C, scale);
}
torch::Tensor absorb_q(const torch::Tensor& q, const torch::Tensor& kv_b3, int64_t D) {
  NO_GIL;
  return absorb_q_impl(q, kv_b3, D);
}
torch::Tensor absorb_o(const torch::Tensor& o_lat, const torch::Tensor& kv_b3, int64_t D) {
  NO_GIL;
  return absorb_o_impl(o_lat, kv_b3, D);
}
