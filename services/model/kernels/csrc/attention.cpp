// Rope, the V3 router and MLA decode (after linear.cpp and experts.cpp, in one translation unit).
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

// Where mla_decode reads a cache row (flat index r = block * 64 + offset): `F32Rows` in place;
// `Fp8CacheRows` (kv_cache.py's FP8 latent rows: C float8_e4m3fn values, C / 128 fp32 scales, R bf16)
// dequantized into the caller's buffer [C + R], to kv_cache.dequantize_latent_rows's values.
struct F32Rows {
  const float* p; int64_t W;
  const float* row(int64_t r, float*) const { return p + r * W; }
};
struct Fp8CacheRows {
  const uint8_t* p; int64_t stride, C, R;  // stride: the row's bytes, padding (and V3.2's key) included
  const float* row(int64_t r, float* buf) const {
    const uint8_t* b = p + r * stride;
    float scales[64];  // (C / 128 <= 64)
    __builtin_memcpy(scales, b + C, 4 * (C / 128));
    dequant_fp8_row(b, scales, C, 128, buf);
    const uint8_t* rope = b + C + 4 * (C / 128);
    for (int64_t i = 0; i < R; ++i) {
      uint16_t h; __builtin_memcpy(&h, rope + 2 * i, 2);
      const uint32_t bits = (uint32_t)h << 16; __builtin_memcpy(buf + C + i, &bits, 4);
    }
    return buf;
  }
};

// MLA decode attention over the paged latent cache, one query token per sequence, in place
// (no gather, no padding): o[b, h] = sum_l softmax_l(scale * q[b, h] . row_l[:QD]) row_l[:C],
// row_l = cache row of token l < lens[b] through table[b] (read through `rows`). q [B, N, QD]
// (QD = C + R), cache [blocks, 64, 1, W] (fp32 rows, or FP8 rows of W bytes), table [B,
// max_blocks] int64, lens [B] int64; QD, C % 8 == 0. Heads go in groups of 4 that share each
// row's load (the latent is one KV head for all of them).
template <typename Rows>
static torch::Tensor mla_decode_rows(const torch::Tensor& q, const torch::Tensor& cache, const Rows& rows,
                                     const torch::Tensor& table, const torch::Tensor& lens, int64_t C, double scale) {
  constexpr int HG = 4;
  const int64_t B = q.size(0), N = q.size(1), QD = q.size(2), MB = table.size(1);
  const int64_t groups = (N + HG - 1) / HG;
  TORCH_CHECK(QD % 8 == 0 && C % 8 == 0 && C <= QD && cache.dim() == 4 && cache.size(1) == 64 &&
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
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>(); const int64_t* lp = lens.data_ptr<int64_t>();
  float* outp = o.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p, buf(QD);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / groups, h0 = (i % groups) * HG, L = lp[b];
      const int nh = (int)std::min<int64_t>(HG, N - h0);
      const float* qs[HG]; float d[HG], mx[HG], sum[HG];
      for (int j = 0; j < nh; ++j) { qs[j] = qp + (b * N + h0 + j) * QD; mx[j] = -INFINITY; sum[j] = 0.0f; }
      p.resize(HG * L);
      for (int64_t l = 0; l < L; ++l) {
        dots(rows.row(tp[b * MB + l / 64] * 64 + l % 64, buf.data()), qs, nh, QD, d);
        for (int j = 0; j < nh; ++j) { p[j * L + l] = d[j] * sc; mx[j] = std::max(mx[j], p[j * L + l]); }
      }
      for (int j = 0; j < nh; ++j)
        for (int64_t l = 0; l < L; ++l) { p[j * L + l] = std::exp(p[j * L + l] - mx[j]); sum[j] += p[j * L + l]; }
      float* orow = outp + (b * N + h0) * C;
      for (int64_t c = 0; c < nh * C; ++c) orow[c] = 0.0f;
      for (int64_t l = 0; l < L; ++l) {
        const float* row = rows.row(tp[b * MB + l / 64] * 64 + l % 64, buf.data());
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
static torch::Tensor mla_decode_impl(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& table,
                                     const torch::Tensor& lens, int64_t C, double scale) {
  TORCH_CHECK(q.size(2) <= cache.size(-1) && cache.scalar_type() == at::kFloat, "mla_decode: fp32 cache rows");
  return mla_decode_rows(q, cache, F32Rows{cache.data_ptr<float>(), cache.size(-1)}, table, lens, C, scale);
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
// fp8.dequantize_fp8_blocks) for ATen's linear: the bits of `lin` on the dequantized weight.
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

torch::Tensor rope_interleaved(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  NO_GIL;
  return rope_interleaved_impl(x, cos, sin);
}
torch::Tensor mla_decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& table,
                         const torch::Tensor& lens, int64_t C, double scale) {
  NO_GIL;
  return mla_decode_impl(q, cache, table, lens, C, scale);
}
// mla_decode over FP8 latent rows: cache [blocks, 64, 1, W] uint8, each row's first
// C + 4 C / 128 + 2 R bytes read (then padding); C % 128 == 0.
torch::Tensor mla_decode_fp8(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& table,
                             const torch::Tensor& lens, int64_t C, int64_t R, double scale) {
  NO_GIL;
  const int64_t bytes = C + 4 * (C / 128) + 2 * R, W = cache.size(-1);
  TORCH_CHECK(cache.scalar_type() == at::kByte && W >= bytes && C % 128 == 0 && C / 128 <= 64 &&
              q.size(2) == C + R && cache.is_contiguous(), "mla_decode_fp8: FP8 latent rows of ", bytes, "+ bytes");
  return mla_decode_rows(q, cache, Fp8CacheRows{cache.data_ptr<uint8_t>(), W, C, R}, table, lens, C, scale);
}
// DeepSeek-V3.2's lightning-indexer scores, fused (no [Q, Hi, L] temporaries): out[q, l] =
// sum_h w[q, h] * relu(scale * q[q, h] . k[l]) for l < lens[q], -inf beyond. q [Q, Hi, Di],
// w [Q, Hi], keys [Q, L, Di] or [1, L, Di] (one context shared by every query), lens [Q] int64;
// fp32 contiguous, Di % 8 == 0. Heads in groups of 4 per key row; each score sums its heads in order.
torch::Tensor index_scores(const torch::Tensor& q, const torch::Tensor& w, const torch::Tensor& keys,
                           const torch::Tensor& lens, double scale) {
  NO_GIL;
  const int64_t Q = q.size(0), Hi = q.size(1), Di = q.size(2), L = keys.size(1);
  TORCH_CHECK(q.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              q.is_contiguous() && w.is_contiguous() && keys.is_contiguous() && Di % 8 == 0 &&
              w.size(0) == Q && w.size(1) == Hi && keys.size(2) == Di && (keys.size(0) == 1 || keys.size(0) == Q) &&
              lens.scalar_type() == at::kLong && lens.numel() == Q, "index_scores: shapes");
  auto out = torch::empty({Q, L}, q.options());
  const float* qp = q.data_ptr<float>(); const float* wp = w.data_ptr<float>(); const float* kp = keys.data_ptr<float>();
  const int64_t* lp = lens.data_ptr<int64_t>(); float* op = out.data_ptr<float>();
  const int64_t blocks = (L + 63) / 64, kstride = keys.size(0) == 1 ? 0 : L * Di;
  const float sc = (float)scale;
  if (Hi % 8 == 0 && Hi <= 128) {
    // The heads across the vector lanes: each query transposed once to [Di][Hi], then per key
    // Di broadcast FMAs into Hi / 8 accumulators, ReLU, the head weights and one horizontal sum
    // (against a horizontal sum per head: ~4x fewer instructions at V3.2's 64 x 128 and the
    // tiny preset's 32 x 16). Each score is summed in the same order whatever the batch.
    std::vector<float> qt(Q * Di * Hi);
    for (int64_t qi = 0; qi < Q; ++qi)
      for (int64_t h = 0; h < Hi; ++h)
        for (int64_t d = 0; d < Di; ++d) qt[(qi * Di + d) * Hi + h] = qp[(qi * Hi + h) * Di + d];
    const int HV = (int)(Hi / 8);
    at::parallel_for(0, Q * blocks, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t qi = i / blocks, l0 = (i % blocks) * 64, l1 = std::min(L, l0 + 64), seen = lp[qi];
        const float* qq = qt.data() + qi * Di * Hi;
        const float* ww = wp + qi * Hi;
        for (int64_t l = l0; l < l1; ++l) {
          if (l >= seen) { op[qi * L + l] = -INFINITY; continue; }
          const float* k = kp + qi * kstride + l * Di;
          v8 acc[16];
          for (int j = 0; j < HV; ++j) acc[j] = v8{0};
          for (int64_t d = 0; d < Di; ++d) {
            const v8 kd = v8{0} + k[d];
            const float* row = qq + d * Hi;
            for (int j = 0; j < HV; ++j) acc[j] = fma(ld(row + 8 * j), kd, acc[j]);
          }
          v8 s = v8{0};
          const v8 zero = v8{0}, scv = v8{0} + sc;
          for (int j = 0; j < HV; ++j) {
            v8 a = acc[j] * scv;
            a = a > zero ? a : zero;
            s = fma(a, ld(ww + 8 * j), s);
          }
          op[qi * L + l] = hsum(s);
        }
      }
    });
    return out;
  }
  at::parallel_for(0, Q * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t qi = i / blocks, l0 = (i % blocks) * 64, l1 = std::min(L, l0 + 64), seen = lp[qi];
      for (int64_t l = l0; l < l1; ++l) {
        if (l >= seen) { op[qi * L + l] = -INFINITY; continue; }
        const float* k = kp + qi * kstride + l * Di;
        float s = 0.0f;
        for (int64_t h0 = 0; h0 < Hi; h0 += 4) {
          const int nh = (int)std::min<int64_t>(4, Hi - h0);
          const float* qs[4]; float d[4];
          for (int j = 0; j < nh; ++j) qs[j] = qp + (qi * Hi + h0 + j) * Di;
          dots(k, qs, nh, Di, d);
          for (int j = 0; j < nh; ++j) s += wp[qi * Hi + h0 + j] * std::max(0.0f, d[j] * sc);
        }
        op[qi * L + l] = s;
      }
    }
  });
  return out;
}
torch::Tensor absorb_q(const torch::Tensor& q, const torch::Tensor& kv_b3, int64_t D) {
  NO_GIL;
  return absorb_q_impl(q, kv_b3, D);
}
torch::Tensor absorb_o(const torch::Tensor& o_lat, const torch::Tensor& kv_b3, int64_t D) {
  NO_GIL;
  return absorb_o_impl(o_lat, kv_b3, D);
}
