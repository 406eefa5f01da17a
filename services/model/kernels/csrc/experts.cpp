// The routed experts and dense MLPs (after linear.cpp, in one translation unit with it).
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
// `sp`: the [T, K] slots; `into`: an fp32 [T, H] tensor to write the sums into (else a new one).
template <typename Src>
static torch::Tensor expert_ffn_w(const torch::Tensor& x, const int64_t* sp, int64_t K, const torch::Tensor& weight,
                                  const Src& src, int64_t S, double limit, const torch::Tensor* into = nullptr) {
  using W = typename Src::W;
  const int64_t T = x.size(0), H = src.H, I = src.I;
  TORCH_CHECK(x.size(1) == H && weight.numel() == T * K && H % 8 == 0 && I % 8 == 0, "expert_ffn: shapes");
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
  auto out = into ? into->zero_() : torch::zeros({T, H}, x.options());
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
static torch::Tensor expert_ffn_packed(const torch::Tensor& x, const int64_t* sp, int64_t K, const torch::Tensor& weight,
                                       const torch::Tensor& w13, const torch::Tensor& w2, double limit,
                                       const torch::Tensor* into) {
  const int64_t S = w13.size(0), I = w2.size(2), H = w13.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w2.size(0) == S && w2.size(1) == H, "expert_ffn: shapes");
  return expert_ffn_w(x, sp, K, weight, Packed<W>{w13.data_ptr<W>(), w2.data_ptr<W>(), I, H}, S, limit, into);
}
static torch::Tensor expert_ffn_slots(const torch::Tensor& x, const int64_t* sp, int64_t K, const torch::Tensor& weight,
                                      const torch::Tensor& w13, const torch::Tensor& w2, double limit,
                                      const torch::Tensor* into = nullptr) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && w13.scalar_type() == w2.scalar_type(),
              "expert_ffn: fp32 x and weight, w13 and w2 of one dtype");
  if (w13.scalar_type() == at::kBFloat16) return expert_ffn_packed<at::BFloat16>(x, sp, K, weight, w13, w2, limit, into);
  TORCH_CHECK(w13.scalar_type() == at::kFloat, "expert_ffn: fp32 or bf16 expert weights, got ", w13.scalar_type());
  return expert_ffn_packed<float>(x, sp, K, weight, w13, w2, limit, into);
}
static torch::Tensor expert_ffn_impl(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                                     const torch::Tensor& w13, const torch::Tensor& w2, double limit) {
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.dim() == 2 && slot.size(0) == x.size(0), "expert_ffn: slot");
  return expert_ffn_slots(x, slot.data_ptr<int64_t>(), slot.size(1), weight, w13, w2, limit);
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
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.dim() == 2 && slot.size(0) == x.size(0), "expert_ffn: slot");
  return expert_ffn_w(x, slot.data_ptr<int64_t>(), slot.size(1), weight, src, S, limit);
}
// An expert worker's Dispatch at decode sizes, checked and counted in one call: out [T, H] fp32 =
// expert_ffn(x, slot, weight) for slot [T, K] int32 local slots (-1: none) straight from the request;
// counts [S] int64 (the caller's own, zeroed: it adds them to shared counters under its lock) = the
// pairs each slot computed. ValueError (nothing written) for a slot outside
// [-1, S) or a weight that is not finite. False (nothing done) when the slots' rows are too many
// for this kernel (more than `max_rows` tokens and more than `max_rows` rows per busy slot on
// average): the caller's grouped matmuls take those.
bool expert_dispatch(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight,
                     const torch::Tensor& w13, const torch::Tensor& w2, const torch::Tensor& out,
                     const torch::Tensor& counts, const torch::Tensor& rows, int64_t max_rows, double limit) {
  NO_GIL;
  // S slots (counts [S]); rows [S] int64: the row of w13 / w2 [P, ...] each slot reads (empty: slot s is row s)
  const int64_t T = x.size(0), K = slot.size(1), S = counts.size(0), P = w13.size(0);
  const bool mapped = rows.numel() > 0;
  TORCH_CHECK(slot.scalar_type() == at::kInt && slot.dim() == 2 && slot.size(0) == T && slot.is_contiguous() &&
              weight.sizes() == slot.sizes() && weight.is_contiguous() && x.is_contiguous() &&
              out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && out.is_contiguous() &&
              counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.is_contiguous() &&
              (mapped ? rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == S && rows.is_contiguous()
                      : S == P),
              "expert_dispatch: shapes / dtypes");
  const int64_t* rp = mapped ? rows.data_ptr<int64_t>() : nullptr;
  if (mapped)
    for (int64_t s = 0; s < S; ++s) TORCH_CHECK(rp[s] >= 0 && rp[s] < P, "expert_dispatch: row ", rp[s], " of ", P);
  const int32_t* s32 = slot.data_ptr<int32_t>(); const float* wp = weight.data_ptr<float>();
  std::vector<int64_t> sp(T * K), per_slot(S, 0);
  int64_t pairs = 0, busy = 0;
  for (int64_t p = 0; p < T * K; ++p) {
    const int64_t s = s32[p];
    TORCH_CHECK_VALUE(s >= -1 && s < S, "slot ", s, " out of range: ", S, " slots on this worker (-1 = none)");
    TORCH_CHECK_VALUE(std::isfinite(wp[p]), "weight has NaN or infinite values");
    sp[p] = s < 0 || !mapped ? s : rp[s];
    if (s >= 0) { busy += per_slot[s]++ == 0; ++pairs; }
  }
  if (T > max_rows && pairs > max_rows * busy) return false;
  expert_ffn_slots(x, sp.data(), K, weight, w13, w2, limit, &out);
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) cp[s] = per_slot[s];
  return true;
}
// A dense SwiGLU MLP (w13 [2I, H]: gate rows then up rows, w2 [H, I]) for a few rows x [T, H]:
// expert_ffn with every row on one slot at weight 1 (its sums, bit for bit).
torch::Tensor dense_ffn(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2) {
  NO_GIL;
  const int64_t T = x.size(0);
  return expert_ffn_impl(x, torch::zeros({T, 1}, x.options().dtype(torch::kInt64)), torch::ones({T, 1}, x.options()),
                         w13.unsqueeze(0), w2.unsqueeze(0), 0.0);
}

// The dispatch client's per-worker requests for one MoE layer, built in one pass each (instead of
// ~10 torch ops per worker). slot [T, K] int64 global slots (-1: none); worker w holds slots
// [w * S, (w + 1) * S). dispatch_rows: rows per worker [W] int64 (a row counts for a worker when
// any of its pairs is there).
torch::Tensor dispatch_rows(const torch::Tensor& slot, int64_t S, int64_t W) {
  NO_GIL;
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.dim() == 2 && slot.is_contiguous() && S > 0 && W > 0,
              "dispatch_rows: slot [T, K] int64");
  const int64_t T = slot.size(0), K = slot.size(1);
  const int64_t* sp = slot.data_ptr<int64_t>();
  auto counts = torch::zeros({W}, slot.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> seen(W, -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = sp[t * K + k];
      if (s < 0) continue;
      const int64_t w = s / S;
      TORCH_CHECK(w < W, "dispatch_rows: slot ", s, " beyond ", W, " workers of ", S);
      if (seen[w] != t) { seen[w] = t; ++cp[w]; }
    }
  return counts;
}
// pack_share: worker w's request, written into its views: hidden [Tw, H] (the rows of x [T, H]
// with a pair on w, in order), local [Tw, K] int32 (slot - w * S there, else -1), weights [Tw, K]
// fp32 (weight [T, K] there, else 0); returns their row indices [Tw] int64. Any dtype for x /
// hidden (one, the same); rows are copied whole.
torch::Tensor pack_share(const torch::Tensor& x, const torch::Tensor& slot, const torch::Tensor& weight, int64_t S,
                         int64_t w, const torch::Tensor& hidden, const torch::Tensor& local, const torch::Tensor& weights) {
  NO_GIL;
  const int64_t T = x.size(0), H = x.size(1), K = slot.size(1), Tw = hidden.size(0);
  TORCH_CHECK(x.is_contiguous() && hidden.is_contiguous() && x.scalar_type() == hidden.scalar_type() &&
              hidden.size(1) == H && slot.scalar_type() == at::kLong && slot.is_contiguous() && slot.size(0) == T &&
              weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.sizes() == slot.sizes() &&
              local.scalar_type() == at::kInt && local.is_contiguous() && local.size(0) == Tw && local.size(1) == K &&
              weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == local.sizes(),
              "pack_share: shapes / dtypes");
  const int64_t* sp = slot.data_ptr<int64_t>(); const float* wp = weight.data_ptr<float>();
  const char* xp = (const char*)x.data_ptr(); char* hp = (char*)hidden.data_ptr();
  int32_t* lp = local.data_ptr<int32_t>(); float* op = weights.data_ptr<float>();
  const int64_t row_bytes = H * x.element_size(), lo = w * S, hi = lo + S;
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < T; ++t) {
    bool mine = false;
    for (int64_t k = 0; k < K; ++k) mine |= sp[t * K + k] >= lo && sp[t * K + k] < hi;
    if (!mine) continue;
    const int64_t r = (int64_t)rows.size();
    TORCH_CHECK(r < Tw, "pack_share: more rows for worker ", w, " than its request holds (", Tw, ")");
    std::memcpy(hp + r * row_bytes, xp + t * row_bytes, row_bytes);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = sp[t * K + k];
      const bool here = s >= lo && s < hi;
      lp[r * K + k] = here ? (int32_t)(s - lo) : -1;
      op[r * K + k] = here ? wp[t * K + k] : 0.0f;
    }
    rows.push_back(t);
  }
  TORCH_CHECK((int64_t)rows.size() == Tw, "pack_share: ", rows.size(), " rows for worker ", w, ", the request holds ", Tw);
  auto out = torch::empty({Tw}, slot.options());
  std::memcpy(out.data_ptr<int64_t>(), rows.data(), Tw * sizeof(int64_t));
  return out;
}
