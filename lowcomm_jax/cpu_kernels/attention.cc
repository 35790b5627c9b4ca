// Causal softmax attention on the CPU as one XLA FFI custom call per direction, for
// lowcomm_jax/cpu_kernels/attention.py (which builds this file with the host's C++ compiler).
//
// Shapes: q, k, v, o, dO are [N, T, H, K] float32 (N = every leading axis: batch, replicas; the
// layout of the projections around the call, so XLA copies none of them), lse is [N, T, H]; T a
// multiple of kRows (the Python side pads). Per (batch, head) slice the forward
// computes each block of kRows query rows' scores against the keys up to the diagonal, the
// softmax, the output and the log-sum-exp L; the backward recomputes P = exp(S − L) row block by
// row block, forms dS = P ⊙ (dP − rowsum(dO ⊙ O)) · scale, and the three gradients from P and dS
// held for that one slice ([T, T] each, in cache), never for the whole batch as XLA's batched
// dots do. Slices are shared out over XLA's CPU thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

// glibc's vector expf (libmvec, linked with -lmvec), which <math.h> declares only under
// -ffast-math: declared here so that the exp loops below vectorize while NaN and inf keep their
// IEEE meaning (the build does not use -ffast-math, which would let the compiler assume neither
// exists). Its special cases are glibc's scalar expf's.
extern "C" float expf(float) __attribute__((simd("notinbranch")));

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // score columns per register tile (2 AVX2 vectors)
constexpr int64_t kRows = 4;   // rows computed together, sharing each loaded tile

// out[c * ldo + j] = x[j * ldx + c]: t rows of k to [k, ldo], columns t.. ldo zero (ldo >= t)
void Transpose(const float* __restrict x, int64_t t, int64_t ldx, int64_t k, int64_t ldo,
               float* __restrict out) {
  for (int64_t j = 0; j < t; ++j)
    for (int64_t c = 0; c < k; ++c) out[c * ldo + j] = x[j * ldx + c];
  for (int64_t c = 0; c < k; ++c)
    for (int64_t j = t; j < ldo; ++j) out[c * ldo + j] = 0.f;
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 floats, unaligned access
static_assert(kTile == 16, "two vectors per tile");

inline v8 Load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void Store(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }

// The one inner product of both directions, a kRows × kTile block held in registers:
// out[r * ldo + u] = alpha * sum_{i<n} w[r * wr + i * wi] * x[i * ldx + u], r < kRows, u < kTile.
inline void Tile(const float* __restrict w, int64_t wr, int64_t wi, const float* __restrict x,
                 int64_t ldx, int64_t n, float alpha, float* __restrict out, int64_t ldo) {
  v8 acc0[kRows] = {}, acc1[kRows] = {};
  for (int64_t i = 0; i < n; ++i) {
    v8 x0 = Load(x + i * ldx), x1 = Load(x + i * ldx + 8);
    // Held in registers: else the compiler folds a reload of x into each of the 2·kRows FMAs,
    // and the loads, not the FMAs, bound the loop.
    asm("" : "+x"(x0), "+x"(x1));
#pragma GCC unroll 4
    for (int64_t r = 0; r < kRows; ++r) {
      const float p = w[r * wr + i * wi];
      acc0[r] += p * x0;
      acc1[r] += p * x1;
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < kRows; ++r) {
    Store(out + r * ldo, alpha * acc0[r]);
    Store(out + r * ldo + 8, alpha * acc1[r]);
  }
}

// rows r < kRows: out[r * ld + j] = alpha * a[r] · bT[:, j] for j < n rounded up to a tile
// (a: kRows rows of K, lda apart; bT: [K, t]).
template <int64_t K>
inline void RowsTimes(const float* __restrict a, int64_t lda, const float* __restrict bT,
                      int64_t t, int64_t n, float alpha, float* __restrict out, int64_t ld) {
  for (int64_t jb = 0; jb < n; jb += kTile) Tile(a, lda, 1, bT + jb, t, K, alpha, out + jb, ld);
}

// rows r < kRows: out[r * ldo + (0..K)] = sum_{j<n} w[r * wr + j * wj] * x[j * ldx + (0..K)]
template <int64_t K>
inline void RowsCombine(const float* __restrict w, int64_t wr, int64_t wj,
                        const float* __restrict x, int64_t ldx, int64_t n,
                        float* __restrict out, int64_t ldo) {
  for (int64_t c0 = 0; c0 < K; c0 += kTile) Tile(w, wr, wj, x + c0, ldx, n, 1.f, out + c0, ldo);
}

template <int64_t K>
void ForwardOne(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                int64_t t, int64_t tp, int64_t ld, int64_t ls, float scale, float* __restrict o,
                float* __restrict lse, float* __restrict kT, float* __restrict s) {
  Transpose(k, t, ld, K, tp, kT);
  for (int64_t i0 = 0; i0 < t; i0 += kRows) {
    const int64_t n = i0 + kRows;
    RowsTimes<K>(q + i0 * ld, ld, kT, tp, n, scale, s, tp);
    for (int64_t r = 0; r < kRows; ++r) {
      float* __restrict sr = s + r * tp;
      const int64_t m_end = i0 + r + 1;
      // The row's max and sum in vector lanes (reordered sums: rounding only; a NaN score still
      // makes its row NaN through exp).
      float m = sr[0];
#pragma omp simd reduction(max : m)
      for (int64_t j = 1; j < m_end; ++j) m = sr[j] > m ? sr[j] : m;
      float l = 0.f;
      for (int64_t j = 0; j < m_end; ++j) sr[j] = expf(sr[j] - m);
#pragma omp simd reduction(+ : l)
      for (int64_t j = 0; j < m_end; ++j) l += sr[j];
      const float inv = 1.f / l;
      for (int64_t j = 0; j < m_end; ++j) sr[j] *= inv;
      for (int64_t j = m_end; j < n; ++j) sr[j] = 0.f;
      lse[(i0 + r) * ls] = m + std::log(l);
    }
    RowsCombine<K>(s, tp, 1, v, ld, n, o + i0 * ld, ld);
  }
}

template <int64_t K>
void BackwardOne(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                 const float* __restrict o, const float* __restrict lse,
                 const float* __restrict d_o, int64_t t, int64_t tp, int64_t ld, int64_t ls,
                 float scale,
                 float* __restrict dq, float* __restrict dk, float* __restrict dv,
                 float* __restrict kT, float* __restrict vT, float* __restrict p,
                 float* __restrict ds) {
  Transpose(k, t, ld, K, tp, kT);
  Transpose(v, t, ld, K, tp, vT);
  // P and dS as [t, tp] matrices (row i valid on j <= i, zero above)
  for (int64_t i0 = 0; i0 < t; i0 += kRows) {
    const int64_t n = i0 + kRows;
    RowsTimes<K>(q + i0 * ld, ld, kT, tp, n, scale, p + i0 * tp, tp);
    RowsTimes<K>(d_o + i0 * ld, ld, vT, tp, n, 1.f, ds + i0 * tp, tp);
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t i = i0 + r, m_end = i + 1;
      float* __restrict pi = p + i * tp;
      float* __restrict dsi = ds + i * tp;
      const float li = lse[i * ls];
      float di = 0.f;
#pragma omp simd reduction(+ : di)
      for (int64_t c = 0; c < K; ++c) di += d_o[i * ld + c] * o[i * ld + c];
      for (int64_t j = 0; j < m_end; ++j) {
        pi[j] = expf(pi[j] - li);
        dsi[j] = pi[j] * (dsi[j] - di) * scale;
      }
      for (int64_t j = m_end; j < tp; ++j) { pi[j] = 0.f; dsi[j] = 0.f; }
    }
    RowsCombine<K>(ds + i0 * tp, tp, 1, k, ld, n, dq + i0 * ld, ld);
  }
  // dK[j] = sum_{i>=j} dS[i, j] q[i], dV[j] = sum_{i>=j} P[i, j] dO[i], kRows columns j at a time
  for (int64_t j0 = 0; j0 < t; j0 += kRows) {
    RowsCombine<K>(ds + j0 * tp + j0, 1, tp, q + j0 * ld, ld, t - j0, dk + j0 * ld, ld);
    RowsCombine<K>(p + j0 * tp + j0, 1, tp, d_o + j0 * ld, ld, t - j0, dv + j0 * ld, ld);
  }
}

// Runs body(i) for i in [0, n) on the caller and XLA's CPU thread pool. The caller takes items
// too and then waits only for items already taken, so a pool of one thread (or none) cannot
// deadlock; the shared state outlives tasks that start after the work is done.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Body body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, body]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Operands [N, T, H, K] (lse [N, T, H]): slice (b, h) starts at b·T·H·K + h·K (its lse at b·T·H + h)
// and its rows are H·K apart (lse H apart).
struct Geometry {
  int64_t n, t, h;
  int64_t t_tiles() const { return (t + kTile - 1) / kTile * kTile; }  // T rounded up to a tile
  int64_t slices() const { return n * h; }
  int64_t offset(int64_t s, int64_t k) const { return (s / h) * t * h * k + (s % h) * k; }
  int64_t lse_offset(int64_t s) const { return (s / h) * t * h + s % h; }
};

template <int64_t K>
void Forward(ffi::ThreadPool& pool, const float* q, const float* k, const float* v, Geometry g,
             float* o, float* lse) {
  const int64_t t = g.t, tp = g.t_tiles(), ld = g.h * K;
  const float scale = 1.f / std::sqrt(static_cast<float>(K));
  ParallelFor(pool, g.slices(), [=](int64_t s) {
    // Per-thread scratch, every element written before it is read (no zero-fill per slice).
    thread_local std::vector<float> kT, rows;
    kT.resize(K * tp);
    rows.resize(kRows * tp);
    const int64_t x = g.offset(s, K);
    ForwardOne<K>(q + x, k + x, v + x, t, tp, ld, g.h, scale, o + x, lse + g.lse_offset(s),
                  kT.data(), rows.data());
  });
}

template <int64_t K>
void Backward(ffi::ThreadPool& pool, const float* q, const float* k, const float* v,
              const float* o, const float* lse, const float* d_o, Geometry g, float* dq,
              float* dk, float* dv) {
  const int64_t t = g.t, tp = g.t_tiles(), ld = g.h * K;
  const float scale = 1.f / std::sqrt(static_cast<float>(K));
  ParallelFor(pool, g.slices(), [=](int64_t s) {
    thread_local std::vector<float> kT, vT, p, ds;
    kT.resize(K * tp);
    vT.resize(K * tp);
    p.resize(t * tp);
    ds.resize(t * tp);
    const int64_t x = g.offset(s, K);
    BackwardOne<K>(q + x, k + x, v + x, o + x, lse + g.lse_offset(s), d_o + x, t, tp, ld, g.h,
                   scale, dq + x, dk + x, dv + x, kT.data(), vT.data(), p.data(), ds.data());
  });
}

// Reads q's [N, T, H, K] (N: every leading axis) and calls body(Geometry, K) with K a compile-time
// head width (std::integral_constant), or returns the error naming what is not supported (the
// Python side pads T to a multiple of kRows and checks the head width first; this guards the
// kernel).
template <typename Body>
ffi::Error Dispatch(const ffi::Buffer<ffi::F32>& q, Body body) {
  auto d = q.dimensions();
  const int64_t r = d.size();
  if (r < 3 || d[r - 3] % kRows)
    return ffi::Error::InvalidArgument("attention: need [..., T, H, K] with T % 4 == 0");
  Geometry g;
  g.t = d[r - 3];
  g.h = d[r - 2];
  g.n = static_cast<int64_t>(q.element_count()) / (g.t * g.h * d[r - 1]);
  switch (d[r - 1]) {
    case 16: body(g, std::integral_constant<int64_t, 16>{}); break;
    case 32: body(g, std::integral_constant<int64_t, 32>{}); break;
    case 64: body(g, std::integral_constant<int64_t, 64>{}); break;
    case 128: body(g, std::integral_constant<int64_t, 128>{}); break;
    default: return ffi::Error::InvalidArgument("attention: head_dim must be 16, 32, 64 or 128");
  }
  return ffi::Error::Success();
}

ffi::Error FfiForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                      ffi::ResultBuffer<ffi::F32> lse) {
  return Dispatch(q, [&](Geometry g, auto K) {
    Forward<K()>(pool, q.typed_data(), k.typed_data(), v.typed_data(), g, o->typed_data(),
                 lse->typed_data());
  });
}

ffi::Error FfiBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o,
                       ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_o,
                       ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                       ffi::ResultBuffer<ffi::F32> dv) {
  return Dispatch(q, [&](Geometry g, auto K) {
    Backward<K()>(pool, q.typed_data(), k.typed_data(), v.typed_data(), o.typed_data(),
                  lse.typed_data(), d_o.typed_data(), g, dq->typed_data(), dk->typed_data(),
                  dv->typed_data());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowcommAttentionForward, FfiForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowcommAttentionBackward, FfiBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
