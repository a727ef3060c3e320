// The library's attention: ops._attention_kernel without faults (the online softmax over a plan's pairs,
// fused) and _Attention.backward's products and sums.
#include "fma_chain.h"
#include "library.h"

namespace {

// row[b] = -inf where hidden[b] (selection), and the row's maximum (NaN if an entry is NaN, as amax).
// A maximum of numbers is exact in any order; only the sign of a zero maximum may differ from amax's,
// which no output sees (it is subtracted and exponentiated, or added to log(l) != -0).
float select_and_max(float* row, const bool* hidden, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t b = 0;
  float m = neg_inf;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(neg_inf);
  const __m512 ninf = _mm512_set1_ps(neg_inf);
  __mmask16 nans = 0;
  for (; b + kLanes <= n; b += kLanes) {
    const __m128i flags = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hidden + b));
    const __mmask16 hide = _mm_test_epi8_mask(flags, flags);
    const __m512 v = _mm512_mask_blend_ps(hide, _mm512_loadu_ps(row + b), ninf);
    _mm512_storeu_ps(row + b, v);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = nans != 0;
#endif
  for (; b < n; ++b) {
    if (hidden[b]) row[b] = neg_inf;
    nan = nan || std::isnan(row[b]);
    if (row[b] > m) m = row[b];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Queries [S, Hq, Tq, D], fp32 or bf16, read through their strides (D's stride 1).
struct Queries {
  const char* data;
  bool bf16;
  int64_t s_q, h_q, t_q;
  explicit Queries(const at::Tensor& q)
      : data(static_cast<const char*>(q.data_ptr())), bf16(q.scalar_type() == at::kBFloat16), s_q(q.stride(0)),
        h_q(q.stride(1)), t_q(q.stride(2)) {
    TORCH_CHECK((q.scalar_type() == at::kFloat || bf16) && q.dim() == 4 && q.stride(3) == 1,
                "attention: queries fp32 or bf16 [S, Hq, Tq, D] with unit stride in D, got ", q.scalar_type(), " ",
                q.sizes(), " strides ", q.strides());
  }
  // dst[d] = fp32 query (s, head, t, d) * scale, for d < D (the torch code's fp32 q * fp32 scaling)
  void scaled(int64_t s, int64_t head, int64_t t, int64_t D, float scale, float* dst) const {
    const int64_t at = s * s_q + head * h_q + t * t_q;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(data) + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * scale;
    } else {
      const auto* src = reinterpret_cast<const float*>(data) + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
};

// The tile rows of query head group h: row = position * rep + head within the group (ops._heads_to_tiles),
// scaled -- zero rows after the real ones.
void scaled_query_rows(const Queries& q, int64_t Tq, int64_t D, int64_t rep, int64_t s, int64_t h,
                       int64_t first_row, int64_t n, float scale, float* dst, int64_t ld) {
  const int64_t rows = Tq * rep;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = first_row + r;
    float* out = dst + r * ld;
    if (row >= rows)
      std::fill(out, out + D, 0.0f);
    else
      q.scaled(s, h * rep + row % rep, row / rep, D, scale, out);
  }
}

}  // namespace

// Attention's keys and values, fp32 or bf16 (widened as read: exact), either [S, Hkv, Tk, D] read through
// their strides, or vLLM's paged cache [blocks, Hkv, block_size, D] (keys and values) where slot t of
// sequence s is the row at element offset slot_rows[s, t] (its block's and its offset's strides).
struct KeyValues {
  const char* k;
  const char* v;
  bool bf16;
  const int64_t* slot_rows = nullptr;
  at::Tensor rows_holder;
  int64_t heads, slots, dim, s_k, s_v, t_k, t_v, h_k, h_v, d_k, d_v;

  KeyValues(const at::Tensor& k_in, const at::Tensor& v_in, const c10::optional<at::Tensor>& slot_rows_in)
      : k(static_cast<const char*>(k_in.data_ptr())), v(static_cast<const char*>(v_in.data_ptr())) {
    TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type() &&
                    (k_in.scalar_type() == at::kFloat || k_in.scalar_type() == at::kBFloat16) && k_in.dim() == 4 &&
                    v_in.dim() == 4,
                "attention: keys and values of one dtype, fp32 or bf16, 4-d; got ", k_in.scalar_type(), " ",
                k_in.sizes(), " and ", v_in.scalar_type(), " ", v_in.sizes());
    bf16 = k_in.scalar_type() == at::kBFloat16;
    heads = k_in.size(1), dim = k_in.size(3);
    s_k = k_in.stride(0), s_v = v_in.stride(0), h_k = k_in.stride(1), h_v = v_in.stride(1);
    t_k = k_in.stride(2), t_v = v_in.stride(2), d_k = k_in.stride(3), d_v = v_in.stride(3);
    slots = k_in.size(2);
    if (slot_rows_in.has_value() && slot_rows_in->defined()) {
      rows_holder = slot_rows_in->contiguous();
      TORCH_CHECK(rows_holder.scalar_type() == at::kLong && rows_holder.dim() == 2 && k_in.strides() == v_in.strides(),
                  "attention: slot_rows int64 [S, Tk] over key and value caches of one layout");
      slot_rows = rows_holder.data_ptr<int64_t>();
      slots = rows_holder.size(1);
    }
  }
  int64_t row(int64_t s, int64_t t, int64_t s_stride, int64_t t_stride) const {
    return slot_rows ? slot_rows[s * slots + t] : s * s_stride + t * t_stride;
  }
  // dst[i * step] = element base + i * stride of data, for i < count (default: D)
  void read(const char* data, int64_t base, int64_t stride, float* dst, int64_t step, int64_t count = -1) const {
    count = count < 0 ? dim : count;
    if (stride == 1 && step == 1) {  // a contiguous run: vectorised copies
      if (bf16) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + base;
        for (int64_t i = 0; i < count; ++i) dst[i] = widen(src[i]);
      } else {
        std::copy_n(reinterpret_cast<const float*>(data) + base, count, dst);
      }
    } else if (bf16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + base;
      for (int64_t i = 0; i < count; ++i) dst[i * step] = widen(src[i * stride]);
    } else {
      const float* src = reinterpret_cast<const float*>(data) + base;
      for (int64_t i = 0; i < count; ++i) dst[i * step] = src[i * stride];
    }
  }
  // kt[d * ldk + b] = key (s, h, t0 + b, d) for b < n, d < D: a block's keys, transposed
  void key_block(int64_t s, int64_t h, int64_t t0, int64_t n, float* kt, int64_t ldk) const {
#if defined(__AVX512F__)
    if (d_k == 1 && dim % kLanes == 0) {  // 16 keys x 16 dims at a time, widened and transposed in registers
      for (int64_t b0 = 0; b0 < n; b0 += kLanes) {
        int64_t at[kLanes];
        const int64_t nb = std::min(kLanes, n - b0);
        for (int64_t i = 0; i < nb; ++i) at[i] = row(s, t0 + b0 + i, s_k, t_k) + h * h_k;
        for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
          __m512i r[16];
          for (int64_t i = 0; i < kLanes; ++i) {
            if (i >= nb)
              r[i] = _mm512_setzero_si512();
            else if (bf16)
              r[i] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                         reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(k) + at[i] + d0))), 16);
            else
              r[i] = _mm512_loadu_si512(reinterpret_cast<const float*>(k) + at[i] + d0);
          }
          transpose_16x16(r);
          for (int64_t d = 0; d < kLanes; ++d)
            _mm512_mask_storeu_epi32(kt + (d0 + d) * ldk + b0, static_cast<__mmask16>((1u << nb) - 1), r[d]);
        }
      }
      return;
    }
#endif
    if (slot_rows) {
      for (int64_t b = 0; b < n; ++b) read(k, row(s, t0 + b, s_k, t_k) + h * h_k, d_k, kt + b, ldk);
    } else {  // strided rows: d outer, so each store run is contiguous
      for (int64_t d = 0; d < dim; ++d) read(k, s * s_k + h * h_k + t0 * t_k + d * d_k, t_k, kt + d * ldk, 1, n);
    }
  }
  void value_row(int64_t s, int64_t h, int64_t t, float* dst, int64_t step) const {
    read(v, row(s, t, s_v, t_v) + h * h_v, d_v, dst, step);
  }
};

// Every one of n flags set (bools are bytes 0 / 1), eight at a time.
bool all_hidden(const bool* flags, int64_t n) {
  constexpr uint64_t kAllSet = 0x0101010101010101ull;
  uint64_t all = kAllSet;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, flags + i, sizeof word);
    all &= word;
  }
  bool hidden = all == kAllSet;
  for (; i < n; ++i) hidden = hidden && flags[i];
  return hidden;
}

// No infinity or NaN among x[0:n] (a branch-free scan of the exponent fields, which the compiler vectorizes).
bool all_finite(const float* x, int64_t n) {
  uint32_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    special |= (u & 0x7F800000u) == 0x7F800000u;
  }
  return special == 0;
}

namespace {

// One work item's scratch: one (s, h)'s blocks as the products read them -- keys transposed [D, B], values
// [B, W16] with invalid slots 0, a ones column (entry D of a PV row is the row's l) and zero lanes, loaded on
// first use -- and one tile's query rows, scores, PV, accumulator and running maxima.
struct AttentionBuffers {
  std::vector<float> kt, vb, idle;
  std::vector<char> loaded, none, idle_done;
  std::vector<float> qr, sc, pv, acc, part, m_prev, m_run, m_ref, alpha;
};

// One call of attention (below): its operands, the plan's lookups, its outputs, and the steps of its work items.
struct Attention {
  at::Tensor q;
  Queries queries;
  at::Tensor pair_t, pair_j, invisible, kv_invalid;
  KeyValues kv;
  int64_t R, B, tiles, live, n_used, k_chunk;
  bool with_probs;
  int64_t S, Hq, Tq, D, Hkv, Tk, rep, rows, P, G, span, W, W16, lanes, parts;
  const int64_t* pt;
  const int64_t* pj;
  const bool* inv;
  const bool* kv_inv;
  float neg_inf, scale;
  at::TensorOptions opts;
  std::vector<int64_t> pair_of, seen, seen_rows, n_keys, items;
  at::Tensor out, probs, out_tiles;
  bool out_bf16;
  std::vector<float> no_keys, zeros, m_pair, l_rows, m_last;

  static at::Tensor checked_queries(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t B,
                                    int64_t k_chunk) {
    TORCH_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu(),
                "attention: CPU tensors only");
    TORCH_CHECK(B <= k_chunk, "attention: a KV block of ", B, " keys exceeds the K chunk ", k_chunk);
    return q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  }

  Attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scaling, int64_t R_,
            int64_t B_, int64_t tiles_, int64_t live_, int64_t n_used_, const at::Tensor& pair_t_in,
            const at::Tensor& pair_j_in, const at::Tensor& invisible_in, const at::Tensor& kv_invalid_in,
            int64_t k_chunk_, bool with_probs_, const c10::optional<at::Tensor>& slot_rows_in)
      : q(checked_queries(q_in, k_in, v_in, B_, k_chunk_)), queries(q), pair_t(pair_t_in.contiguous()),
        pair_j(pair_j_in.contiguous()), invisible(invisible_in.contiguous()), kv_invalid(kv_invalid_in.contiguous()),
        kv(k_in, v_in, slot_rows_in), R(R_), B(B_), tiles(tiles_), live(live_), n_used(n_used_), k_chunk(k_chunk_),
        with_probs(with_probs_) {
    S = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = kv.heads, Tk = kv.slots;
    rep = Hq / Hkv, rows = Tq * rep, P = pair_t.numel(), G = S * Hkv * P, span = kv_invalid.size(1);
    W = D + 1, W16 = round_up(W, kLanes);
    pt = pair_t.data_ptr<int64_t>();
    pj = pair_j.data_ptr<int64_t>();
    inv = invisible.data_ptr<bool>();
    kv_inv = kv_invalid.data_ptr<bool>();
    neg_inf = -std::numeric_limits<float>::infinity();
    scale = static_cast<float>(scaling);
    opts = q.options().dtype(at::kFloat);
    lanes = S * Hkv * tiles;
    plan_skips();
    // the output: in q's dtype in inference (the fp32 result cast once, as the torch code does), fp32 with_probs
    out = at::empty({S, Hq, Tq, D}, with_probs ? opts : q.options());
    out_bf16 = out.scalar_type() == at::kBFloat16;
    no_keys.assign(D + 1, 0.0f);  // acc of a row that sees no key: l = 0
    // with_probs (training): p of every pair in the [G, R, B] layout the torch code saves, each pair's
    // reference maximum, each row's l and final running maximum, the output's tile rows
    probs = with_probs ? at::empty({G, R, B}, opts).narrow(1, 0, live) : at::Tensor();
    out_tiles = with_probs ? at::empty({S, Hkv, tiles, live, D}, opts) : at::Tensor();
    m_pair.resize(with_probs ? G * live : 0), l_rows.resize(with_probs ? lanes * live : 0);
    m_last.resize(with_probs ? lanes * live : 0);
    order_items();
    zeros.assign(std::max(B, W16), 0.0f);  // a zero PV row; the zero probabilities of an idle chain
  }

  // the plan's pair (t, j), -1 where it has none: a block after every row of the tile, which the torch
  // code scatters as -inf scores and zero PV
  void plan_skips() {
    pair_of.assign(tiles * n_used, -1);
    for (int64_t p = 0; p < P; ++p) pair_of[pt[p] * n_used + pj[p]] = p;
    // The plan's pairs are shared by the batch's sequences; a pair with no key visible to any of a
    // sequence's live rows is an exact no-op for that sequence (scores -inf, so m, l and acc stay as
    // they were; its PV is the block's zero-probability chain). And a row that sees no key at all has
    // l = 0, so its output is 0. In inference neither is computed: seen[s * P + p] is 1 + the pair's last
    // row that sees a key (0: the pair is skipped), seen_rows[s * tiles + t] the most of the tile's pairs
    // (the tile's rows from there on are written as 0; a decode step's tile holds one position's rows).
    seen.assign(S * P, live), seen_rows.assign(S * tiles, with_probs ? live : 0);
    if (!with_probs) {
      at::parallel_for(0, S * P, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          int64_t r = live;
          while (r > 0 && all_hidden(inv + (i * live + r - 1) * B, B)) --r;
          seen[i] = r;
        }
      });
      for (int64_t s = 0; s < S; ++s)
        for (int64_t p = 0; p < P; ++p)
          seen_rows[s * tiles + pt[p]] = std::max(seen_rows[s * tiles + pt[p]], seen[s * P + p]);
    }
    // keys at or after a sequence's last valid slot only ever reach a row as -inf: not read (zero)
    n_keys.assign(S, 0);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t t = std::min(Tk, span); t > 0; --t)
        if (!kv_inv[s * span + t - 1]) {
          n_keys[s] = t;
          break;
        }
  }

  // Work items (s, h, part): part k of the (s, h)'s tiles takes tiles k, k + parts, ... (parts > 1 only
  // when there are fewer (s, h) than twice the threads); handed out largest first, each to the next free
  // thread. Every output is written by the one item computing it, in a fixed order: the bits do not
  // depend on which thread runs which item.
  void order_items() {
    const int64_t threads = at::get_num_threads(), heads = S * Hkv;
    parts = std::clamp<int64_t>((2 * threads + heads - 1) / heads, 1, tiles);
    std::vector<int64_t> work(S, 0);
    items.resize(heads * parts);
    for (int64_t s = 0; s < S; ++s) work[s] = std::accumulate(seen.begin() + s * P, seen.begin() + (s + 1) * P, int64_t(0));
    for (int64_t i = 0; i < heads * parts; ++i) items[i] = i;
    std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return work[a / parts / Hkv] > work[b / parts / Hkv]; });
  }

  AttentionBuffers buffers() const {
    return AttentionBuffers{std::vector<float>(n_used * D * B), std::vector<float>(n_used * B * W16),
                            std::vector<float>(n_used * W16), std::vector<char>(n_used), std::vector<char>(n_used),
                            std::vector<char>(n_used), std::vector<float>(live * D), std::vector<float>(live * B),
                            std::vector<float>(live * W16), std::vector<float>(live * W),
                            std::vector<float>(kMaxRows * std::max(B, W16)), std::vector<float>(live),
                            std::vector<float>(live), std::vector<float>(live), std::vector<float>(live)};
  }

  // output row `row` of tile rows (position-major) of (s, h): acc / l, 0 for a row without keys (l = 0)
  void out_row(int64_t s, int64_t h, int64_t row, const float* acc, float l) const {
    const int64_t at = ((s * Hq + h * rep + row % rep) * Tq + row / rep) * D;
    if (out_bf16) {
      thread_local std::vector<float> values;
      values.resize(D);
      for (int64_t d = 0; d < D; ++d) values[d] = l > 0 ? acc[d] / l : 0.0f;
      to_bf16(values.data(), out.data_ptr<at::BFloat16>() + at, D);
    } else {
      float* dst = out.data_ptr<float>() + at;
      for (int64_t d = 0; d < D; ++d) dst[d] = l > 0 ? acc[d] / l : 0.0f;
    }
  }

  // block j of (s, h) loaded into buf once per item; its values, or nullptr if none of its slots is valid
  const float* values(AttentionBuffers& buf, int64_t s, int64_t h, int64_t j) const {
    if (!buf.loaded[j]) {
      buf.loaded[j] = 1;
      const int64_t first = j * B, n_slots = std::clamp<int64_t>(Tk - first, 0, B);
      buf.none[j] = std::all_of(kv_inv + s * span + first, kv_inv + s * span + first + n_slots,
                                [](bool x) { return x; });
      float* kj = buf.kt.data() + j * D * B;
      const int64_t n = std::clamp<int64_t>(n_keys[s] - first, 0, B);
      kv.key_block(s, h, first, n, kj, B);
      for (int64_t d = 0; d < D; ++d) std::fill(kj + d * B + n, kj + (d + 1) * B, 0.0f);
      float* vj = buf.vb.data() + j * B * W16;
      for (int64_t b = 0; b < B; ++b) {
        float* dst = vj + b * W16;
        std::fill(dst + D, dst + W16, 0.0f);
        dst[D] = 1.0f;
        const int64_t slot = first + b;
        if (buf.none[j] || slot >= Tk || kv_inv[s * span + slot])
          std::fill(dst, dst + D, 0.0f);
        else
          kv.value_row(s, h, slot, dst, 1);
      }
    }
    return buf.none[j] ? nullptr : buf.vb.data() + j * B * W16;
  }

  // A computed pair's scores (kept in probs with_probs), the running maximum (cummax: NaN stays) and its
  // reference, p = exp(score - ref), and its PV rows: nullptr where the block has no valid slot (every value
  // 0: each chain is fma(p, 0, +0) = +0).
  const float* computed_pair(AttentionBuffers& buf, int64_t s, int64_t h, int64_t j, int64_t p, int64_t g,
                             int64_t n_rows) {
    auto &m_prev = buf.m_prev, &m_run = buf.m_run, &m_ref = buf.m_ref;
    float* scores = with_probs ? probs.data_ptr<float>() + g * R * B : buf.sc.data();
    const float* vj = values(buf, s, h, j);
    fma_chain_rows(buf.qr.data(), D, 1, n_rows, buf.kt.data() + j * D * B, B, D, B, k_chunk, scores, B,
                   buf.part.data());
    const bool* hidden = inv + (s * P + p) * live * B;
    for (int64_t r = 0; r < n_rows; ++r) m_run[r] = select_and_max(scores + r * B, hidden + r * B, B);
    for (int64_t r = 0; r < n_rows; ++r) {
      if (j > 0 && !(m_run[r] >= m_prev[r]) && !std::isnan(m_run[r])) m_run[r] = m_prev[r];
      m_ref[r] = m_run[r] == neg_inf ? 0.0f : m_run[r];
      float* row = scores + r * B;
      for (int64_t b = 0; b < B; ++b) row[b] = row[b] - m_ref[r];
    }
    exp_in_place(scores, n_rows * B);
    if (vj == nullptr) return nullptr;
    fma_chain_rows(scores, B, 1, n_rows, vj, W16, B, W16, k_chunk, buf.pv.data(), W16, buf.part.data());
    return buf.pv.data();
  }

  // A pair not computed: the running maximum carried over; a planned pair's PV is the block's chain for p = 0,
  // +0 unless a value is not finite, once per block (nullptr: no planned pair, or no valid slot -- zeros).
  const float* skipped_pair(AttentionBuffers& buf, int64_t s, int64_t h, int64_t j, int64_t p, int64_t n_rows) {
    for (int64_t r = 0; r < n_rows; ++r) {
      buf.m_run[r] = j > 0 ? buf.m_prev[r] : neg_inf;
      buf.m_ref[r] = buf.m_run[r] == neg_inf ? 0.0f : buf.m_run[r];
    }
    if (p < 0) return nullptr;
    const float* vj = values(buf, s, h, j);
    if (vj != nullptr && !buf.idle_done[j]) {
      buf.idle_done[j] = 1;
      float* dst = buf.idle.data() + j * W16;
      std::fill(dst, dst + W16, 0.0f);
      if (!all_finite(vj, B * W16))  // fma(0, inf, .) is NaN
        fma_chain_rows(zeros.data(), B, 1, 1, vj, W16, B, W16, k_chunk, dst, W16, buf.part.data());
    }
    return vj != nullptr ? buf.idle.data() + j * W16 : nullptr;
  }

  // acc_j = acc_{j-1} * alpha_j + pv_j in block order, alpha_j = exp(m_{j-1} - ref_j) (pvr's rows pv_step
  // apart; step 0: one row for all); then the running maximum becomes the previous one
  void accumulate(AttentionBuffers& buf, int64_t j, int64_t n_rows, const float* pvr, int64_t pv_step) {
    auto &acc = buf.acc, &alpha = buf.alpha, &m_prev = buf.m_prev;
    if (j == 0) {
      for (int64_t r = 0; r < n_rows; ++r) std::copy(pvr + r * pv_step, pvr + r * pv_step + W, acc.data() + r * W);
    } else {
      for (int64_t r = 0; r < n_rows; ++r) alpha[r] = m_prev[r] - buf.m_ref[r];
      exp_in_place(alpha.data(), n_rows);
      for (int64_t r = 0; r < n_rows; ++r) {
        float* a = acc.data() + r * W;
        const float* add = pvr + r * pv_step;
        for (int64_t d = 0; d < W; ++d) a[d] = a[d] * alpha[r] + add[d];  // two roundings: no fma
      }
    }
    std::copy(buf.m_run.begin(), buf.m_run.begin() + n_rows, m_prev.begin());
  }

  // block j of tile t of (s, h) (sh = s * Hkv + h): the pair's scores and PV, added to the accumulator
  void block_step(AttentionBuffers& buf, int64_t s, int64_t h, int64_t sh, int64_t t, int64_t j, int64_t n_rows) {
    const int64_t p = pair_of[t * n_used + j], g = sh * P + p;
    const float* pvr = zeros.data();  // the PV rows added (step 0: one row for all)
    int64_t pv_step = 0;
    if (p >= 0 && seen[s * P + p] > 0) {
      if (const float* pv = computed_pair(buf, s, h, j, p, g, n_rows)) pvr = pv, pv_step = W16;
    } else if (const float* idle = skipped_pair(buf, s, h, j, p, n_rows)) {
      pvr = idle;
    }
    if (with_probs && p >= 0) std::copy(buf.m_ref.begin(), buf.m_ref.begin() + n_rows, m_pair.begin() + g * live);
    accumulate(buf, j, n_rows, pvr, pv_step);
  }

  // the tile's rows: out = acc / l (0 for a row without keys); with_probs also each row's l, final maximum
  // and tile row (c = sh * tiles + t)
  void finish_tile(const AttentionBuffers& buf, int64_t s, int64_t h, int64_t c, int64_t t, int64_t n_rows) {
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t row = t * R + r;
      const float* a = buf.acc.data() + r * W;
      const float l = a[D];
      float* tile_row = with_probs ? out_tiles.data_ptr<float>() + (c * live + r) * D : nullptr;
      if (with_probs) l_rows[c * live + r] = l, m_last[c * live + r] = buf.m_prev[r];
      if (row >= rows) {
        if (tile_row) std::fill(tile_row, tile_row + D, 0.0f);
        continue;
      }
      out_row(s, h, row, a, l);
      if (tile_row) for (int64_t d = 0; d < D; ++d) tile_row[d] = l > 0 ? a[d] / l : 0.0f;
    }
  }

  // work item `item`: its (s, h)'s tiles first_tile, first_tile + parts, ..., each over its blocks in order
  void run_item(AttentionBuffers& buf, int64_t item) {
    const int64_t it = items[item], sh = it / parts, first_tile = it % parts, s = sh / Hkv, h = sh % Hkv;
    std::fill(buf.loaded.begin(), buf.loaded.end(), 0);
    std::fill(buf.idle_done.begin(), buf.idle_done.end(), 0);
    for (int64_t t = first_tile; t < tiles; t += parts) {
      // inference computes only the tile's real rows; training all live rows, as the torch code saves them
      const int64_t n_rows = seen_rows[s * tiles + t];
      for (int64_t row = t * R + n_rows; !with_probs && row < std::min(rows, (t + 1) * R); ++row)  // rows seeing no key
        out_row(s, h, row, no_keys.data(), 0.0f);
      if (n_rows == 0) continue;
      scaled_query_rows(queries, Tq, D, rep, s, h, t * R, n_rows, scale, buf.qr.data(), D);
      for (int64_t j = 0; j < n_used; ++j) block_step(buf, s, h, sh, t, j, n_rows);
      finish_tile(buf, s, h, sh * tiles + t, t, n_rows);
    }
  }

  // with_probs: lse = m + log(l) (0 where not finite) per row, then probs = p * exp(ref - lse) per pair
  std::vector<at::Tensor> with_probabilities() {
    auto lse = at::empty({lanes, live}, opts);
    float* ls = lse.data_ptr<float>();
    std::copy(l_rows.begin(), l_rows.end(), ls);
    lse.log_();
    for (int64_t i = 0; i < lanes * live; ++i) {
      const float value = m_last[i] + ls[i];
      ls[i] = std::isfinite(value) ? value : 0.0f;
    }
    auto factor = at::empty({G, live}, opts);
    float* fa = factor.data_ptr<float>();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t c = (g / P) * tiles + pt[g % P];
      for (int64_t r = 0; r < live; ++r) fa[g * live + r] = m_pair[g * live + r] - ls[c * live + r];
    }
    factor.exp_();
    float* sc = probs.data_ptr<float>();
    at::parallel_for(0, G, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t g = lo; g < hi; ++g)
        for (int64_t r = 0; r < live; ++r) {
          float* row = sc + g * R * B + r * B;
          const float f = fa[g * live + r];
          for (int64_t b = 0; b < B; ++b) row[b] = row[b] * f;
        }
    });
    return {out, probs, out_tiles};
  }
};

}  // namespace

// ops._attention_kernel without faults, fused: per (sequence, kv head) and query tile, the online softmax
// over the tile's blocks in order -- scores, running maximum, p, PV and the rescaled accumulator of one
// (tile, block) pair at a time, in cache -- each score and PV entry the fma chain MKL computes (above), each
// exp torch's (exp_in_place); keys and values read through their strides once per (sequence, kv head).
// The output is in q's dtype. with_probs (training) also returns the backward's probabilities
// p * exp(ref - lse) per pair [G, R, B] (rows >= live unused), as the torch code saves them, and the
// output's tile rows [S, Hkv, tiles, live, D] (ops._heads_to_tiles of the fp32 output); the output is
// then fp32.
std::vector<at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                  double scaling, int64_t R, int64_t B, int64_t tiles, int64_t live, int64_t n_used,
                                  const at::Tensor& pair_t_in, const at::Tensor& pair_j_in,
                                  const at::Tensor& invisible_in, const at::Tensor& kv_invalid_in, int64_t k_chunk,
                                  bool with_probs, const c10::optional<at::Tensor>& slot_rows_in) {
  Attention call(q_in, k_in, v_in, scaling, R, B, tiles, live, n_used, pair_t_in, pair_j_in, invisible_in, kv_invalid_in,
                 k_chunk, with_probs, slot_rows_in);
  for_each_item(call.S * call.Hkv * call.parts, [&] { return call.buffers(); },
                [&](AttentionBuffers& buf, int64_t item) { call.run_item(buf, item); });
  if (!with_probs) return {call.out};
  return call.with_probabilities();
}

namespace {

// attention_backward's keys and values (fp32), read through their strides: per (s, h) every used block's keys
// [B, D16] (0 past Tk) and values transposed [D, B16] (invalid slots 0); lanes past D and B stay as they are (0)
struct BackwardKeyValues {
  const float* kd;
  const float* vd;
  int64_t ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3;
  explicit BackwardKeyValues(const at::Tensor& k, const at::Tensor& v)
      : kd(k.data_ptr<float>()), vd(v.data_ptr<float>()), ks0(k.stride(0)), ks1(k.stride(1)), ks2(k.stride(2)),
        ks3(k.stride(3)), vs0(v.stride(0)), vs1(v.stride(1)), vs2(v.stride(2)), vs3(v.stride(3)) {}
  void blocks(int64_t s, int64_t h, const bool* kv_inv, int64_t span, int64_t Tk, int64_t n_used, int64_t B, int64_t D,
              int64_t D16, int64_t B16, float* k16, float* vt) const {
    for (int64_t j = 0; j < n_used; ++j)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t slot = j * B + b;
        const bool in_range = slot < Tk, valid = in_range && !kv_inv[s * span + slot];
        const float* key = kd + s * ks0 + h * ks1 + slot * ks2;
        const float* value = vd + s * vs0 + h * vs1 + slot * vs2;
        for (int64_t d = 0; d < D; ++d) {
          k16[(j * B + b) * D16 + d] = in_range ? key[d * ks3] : 0.0f;
          vt[(j * D + d) * B16 + b] = valid ? value[d * vs3] : 0.0f;
        }
      }
  }
};

// The sizes of attention_backward's products: live rows, B keys, D dims, their 16-lane widths, and the "chunk"
// size (whole: every product reduces in one chain).
struct BackwardSizes {
  int64_t live, B, D, B16, D16, whole;
};

// One pair's products and sums (attention_backward): grad_s = (do @ v_j^T - delta) * probs into gs, then
// grad_v_j += probs^T @ do, grad_q_t += grad_s @ k_j^T, grad_k_j += grad_s^T @ q_t (dl: the tile's delta rows).
void backward_pair(const BackwardSizes& z, const float* do16, const float* q16, const float* kj, const float* vj,
                   const float* prb, const float* dl, float* gs, float* prod, float* part, float* gvj, float* gqt,
                   float* gkj) {
  const int64_t live = z.live, B = z.B, D = z.D, B16 = z.B16, D16 = z.D16, whole = z.whole;
  // grad_s = (do @ v^T - delta) * probs
  fma_chain_rows(do16, D16, 1, live, vj, B16, D, B16, whole, gs, B16, part);
  for (int64_t r = 0; r < live; ++r) {
    const float dlr = dl[r];
    for (int64_t b = 0; b < B; ++b) {
      const float diff = gs[r * B16 + b] - dlr;
      gs[r * B16 + b] = diff * prb[r * B + b];
    }
  }
  // grad_v_j += probs^T @ do (probs read transposed in place)
  fma_chain_rows(prb, 1, B, B, do16, D16, live, D16, whole, prod, D16, part);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d) gvj[b * D + d] = gvj[b * D + d] + prod[b * D16 + d];
  // grad_q_t += grad_s @ k_j^T ([B, D] rows of the block's keys)
  fma_chain_rows(gs, B16, 1, live, kj, D16, B, D16, whole, prod, D16, part);
  for (int64_t r = 0; r < live; ++r)
    for (int64_t d = 0; d < D; ++d) gqt[r * D + d] = gqt[r * D + d] + prod[r * D16 + d];
  // grad_k_j += grad_s^T @ q_t (grad_s read transposed in place)
  fma_chain_rows(gs, 1, B16, B, q16, D16, live, D16, whole, prod, D16, part);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d) gkj[b * D + d] = gkj[b * D + d] + prod[b * D16 + d];
}

}  // namespace

// _Attention.backward's products and sums, fused: per pair p (tile t, block j), in pair order,
//   dP = do_t @ v_j^T;  grad_s = (dP - delta_t) * probs_p;
//   grad_v_j += probs_p^T @ do_t;  grad_q_t += grad_s @ k_j^T;  grad_k_j += grad_s^T @ q_t,
// each product entry the fma chain MKL computes for torch.matmul here -- one chain over the whole
// reduced dim, as the torch code does not split it (every product has >= 4 rows, >= 12 columns,
// >= 400 multiply-adds and a reduced dim <= 128: the caller checks) -- and each += the IEEE add
// index_add_ does, starting from 0. q_t, k_j, v_j are the torch code's q_tiles, k_blocks, v_blocks
// (scaled query rows; keys; values with invalid slots 0), built here from q, k, v once per block.
// Returns (grad_q [S, Hkv, tiles, live, D], grad_k, grad_v [S, Hkv, n_blocks, B, D]).
std::vector<at::Tensor> attention_backward(const at::Tensor& do_in, const at::Tensor& delta_in,
                                           const at::Tensor& probs_in, const at::Tensor& q_in,
                                           const at::Tensor& k_in, const at::Tensor& v_in, double scaling, int64_t R,
                                           const at::Tensor& pair_t_in, const at::Tensor& pair_j_in,
                                           const at::Tensor& kv_invalid_in, int64_t n_blocks) {
  const auto dout = do_in.contiguous(), delta = delta_in.contiguous(), probs = probs_in.contiguous();
  const auto pair_t = pair_t_in.contiguous(), pair_j = pair_j_in.contiguous(), kv_invalid = kv_invalid_in.contiguous();
  const auto q = q_in.to(at::kFloat).contiguous(), k = k_in.to(at::kFloat), v = v_in.to(at::kFloat);
  const Queries queries(q);
  const int64_t S = dout.size(0), Hkv = dout.size(1), tiles = dout.size(2), live = dout.size(3), D = dout.size(4);
  const int64_t B = probs.size(-1), P = pair_t.numel(), Hq = q.size(1), Tq = q.size(2), Tk = k.size(2);
  const int64_t rep = Hq / Hkv, span = kv_invalid.size(1);
  const int64_t D16 = round_up(D, kLanes), B16 = round_up(B, kLanes);
  const BackwardSizes sizes{live, B, D, B16, D16, std::max({D, B, live})};
  const int64_t* pt = pair_t.data_ptr<int64_t>();
  const int64_t* pj = pair_j.data_ptr<int64_t>();
  const int64_t n_used = P ? *std::max_element(pj, pj + P) + 1 : 0;
  const float* dd = dout.data_ptr<float>();
  const float* de = delta.data_ptr<float>();
  const float* pr = probs.data_ptr<float>();
  const bool* kv_inv = kv_invalid.data_ptr<bool>();
  const BackwardKeyValues kv(k, v);
  auto opts = dout.options();
  auto grad_q = at::zeros({S, Hkv, tiles, live, D}, opts);
  auto grad_k = at::zeros({S, Hkv, n_blocks, B, D}, opts), grad_v = at::zeros({S, Hkv, n_blocks, B, D}, opts);
  float* gq = grad_q.data_ptr<float>();
  float* gk = grad_k.data_ptr<float>();
  float* gv = grad_v.data_ptr<float>();
  at::parallel_for(0, S * Hkv, 1, [&](int64_t lo, int64_t hi) {
    const int64_t widest = std::max(B16, D16);
    // per (s, h): every used block's keys [B, D16] and values transposed [D, B16] (zero lanes after D, B)
    std::vector<float> k16(n_used * B * D16, 0.0f), vt(n_used * D * B16, 0.0f), do16(live * D16, 0.0f),
        q16(live * D16, 0.0f), gs(live * B16), prod(std::max(live, B) * widest), part(kMaxRows * widest);
    for (int64_t sh = lo; sh < hi; ++sh) {
      const int64_t s = sh / Hkv, h = sh % Hkv;
      kv.blocks(s, h, kv_inv, span, Tk, n_used, B, D, D16, B16, k16.data(), vt.data());
      int64_t loaded_t = -1;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t t = pt[p], j = pj[p];
        if (t != loaded_t) {  // the tile's rows of do and q, zero-padded to 16 columns (pairs come tile by tile)
          const float* dot = dd + ((sh * tiles + t) * live) * D;
          for (int64_t r = 0; r < live; ++r) std::copy(dot + r * D, dot + (r + 1) * D, do16.data() + r * D16);
          scaled_query_rows(queries, Tq, D, rep, s, h, t * R, live, static_cast<float>(scaling),
                            q16.data(), D16);
          loaded_t = t;
        }
        backward_pair(sizes, do16.data(), q16.data(), k16.data() + j * B * D16, vt.data() + j * D * B16,
                      pr + ((sh * P + p) * live) * B, de + (sh * tiles + t) * live, gs.data(), prod.data(), part.data(),
                      gv + (sh * n_blocks + j) * B * D, gq + (sh * tiles + t) * live * D, gk + (sh * n_blocks + j) * B * D);
      }
    }
  });
  return {grad_q, grad_k, grad_v};
}

void register_attention(pybind11::module& m) {
  m.def("attention", &attention, "ops._attention_kernel without faults, for CPU tensors");
  m.def("attention_backward", &attention_backward, "_Attention.backward's products and sums, fused");
}
