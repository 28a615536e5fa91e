// Fused multi-head attention for XLA:CPU, called through XLA's FFI.
//
//   out[b, i, h, :] = softmax_j(scale * q[b,i,h,:] . k[b,j,h,:] + bias[b,j] (+ pos[h,i,j])) . v[b,j,h,:]
//
// Two handlers share the code: JaxserveFusedAttention (a per-key bias [B, S]: padding, ToMe's
// log-sizes) and JaxserveFusedAttentionPosBias, which also adds a per-head [H, S, S] bias
// shared by the batch (MPNet's relative-position bias, one table for every layer): it is
// added to each query block's scores in cache, and the row max is taken again after it.
//
// q, k and v arrive packed as the QKV projection writes them, [B, S, 3, H, D] (BERT's
// and timm's layout), so XLA copies nothing before the call; the result is [B, S, H, D],
// i.e. [B, S, H*D] for the output projection.
//
// Why: XLA:CPU materialises the [B, H, S, S] scores and makes several passes over them
// (bias, max, exp, sum, PV), each a trip to memory once B*H*S*S outgrows the caches (100 MB
// per layer at MiniLM 32x256). Here one (batch, head, 24-query block) is finished while its
// scores (24 x S floats) sit in L1/L2: QK^T with a register-tiled outer-product kernel, the
// row max taken as the scores are written, exp2 and the row sum in one pass, PV with a
// second register tile, then one division per output. S <= a few thousand, so the whole
// key range fits one block and no online (flash) rescaling is needed.
//
// Numerics: float32 throughout, as the XLA form. Scores are kept in log2 units (q and the
// bias are multiplied by log2(e) when packed) so the exponential is exp2 of the reduced
// argument: a degree-6 polynomial on [-0.5, 0.5] (fitted for relative error, 1e-7 in
// float32) times 2^n put into the exponent bits. Arguments below -125 (a padded key's
// -1e9 bias, or a score 86 nats under the row max) give exactly 0, so padding contributes
// nothing and the result does not depend on the bucket a sequence is padded to.
//
// Work: (batch, head, query chunk) items claimed from an atomic counter by the calling
// thread and up to num_threads-1 helpers scheduled on XLA's intra-op pool. The caller
// never waits for an item nobody has claimed, so it cannot deadlock on a busy pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifndef JAXSERVE_VEC_BYTES
#if defined(__AVX512F__)
#define JAXSERVE_VEC_BYTES 64
#else
#define JAXSERVE_VEC_BYTES 32
#endif
#endif

constexpr int W = JAXSERVE_VEC_BYTES / 4;  // float lanes per vector
// Register tiles: R rows x N vectors of accumulators, plus N loads and one broadcast, fill
// the register file without spilling (16 vector registers; 32 with AVX-512). Measured on a
// 2-core Zen 1 (AVX2) at MiniLM 32x256: QK 4x3 took 0.85x the time of 6x2, PV 3x4 the
// fastest of 2x4, 3x4, 4x3.
#if defined(__AVX512F__) && JAXSERVE_VEC_BYTES == 64
constexpr int QK_R = 6, QK_NV = 4, PV_R = 6, PV_DV = 4;
#else
constexpr int QK_R = 4, QK_NV = 3, PV_R = 3, PV_DV = 4;
#endif
constexpr int QB = 24;  // query rows per block: a multiple of QK_R and PV_R
static_assert(QB % QK_R == 0 && QB % PV_R == 0, "query block must hold whole tiles");

typedef float vf __attribute__((vector_size(JAXSERVE_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(JAXSERVE_VEC_BYTES)));
typedef float vf_unaligned __attribute__((vector_size(JAXSERVE_VEC_BYTES), aligned(4)));

static inline vf loadu(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
static inline void storeu(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
static inline vf splat(float x) { return vf{} + x; }
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kLog2e = 1.44269504088896341f;

// 2^t for t <= 0; exactly 0 for t < -125.
static inline vf exp2_nonpositive(vf t) {
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds t to an integer
  vf tm = t + magic;
  vf n = tm - magic;
  vf f = t - n;  // in [-0.5, 0.5]
  vf p = splat(1.5345785e-4f);
  p = p * f + 1.3399931e-3f;
  p = p * f + 9.6184891e-3f;
  p = p * f + 5.5503286e-2f;
  p = p * f + 2.4022646e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  vi n_int = reinterpret_cast<vi&>(tm) - 0x4B400000;  // the integer n, from tm's mantissa
  vi bits = reinterpret_cast<vi&>(p) + (n_int << 23);
  vi kept = bits & ~(vi)(t < -125.0f);
  return reinterpret_cast<vf&>(kept);
}

// P[R x NV*W] = Q[R x D] . KT panel [D x NV*W] + bias; rmax[r] = max(rmax[r], row r).
template <int R, int NV>
static inline void qk_tile(const float* q, int64_t d_len, const float* kt, const float* bias, float* p,
                           int64_t ldp, vf* rmax) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = vf{};
  for (int64_t d = 0; d < d_len; ++d) {
    vf kv[NV];
    for (int n = 0; n < NV; ++n) kv[n] = loadu(kt + d * (NV * W) + n * W);
    for (int r = 0; r < R; ++r) {
      const vf qb = splat(q[r * d_len + d]);
      for (int n = 0; n < NV; ++n) acc[r][n] += qb * kv[n];
    }
  }
  for (int n = 0; n < NV; ++n) {
    const vf bv = loadu(bias + n * W);
    for (int r = 0; r < R; ++r) {
      const vf x = acc[r][n] + bv;
      storeu(p + r * ldp + n * W, x);
      rmax[r] = x > rmax[r] ? x : rmax[r];
    }
  }
}

// O[R x DV*W] = P[R x Sp] . V[Sp x DV*W] (V rows ldv apart).
template <int R, int DV>
static inline void pv_tile(const float* p, int64_t sp, const float* v, int64_t ldv, float* o, int64_t ldo) {
  vf acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < DV; ++n) acc[r][n] = vf{};
  for (int64_t j = 0; j < sp; ++j) {
    vf vv[DV];
    for (int n = 0; n < DV; ++n) vv[n] = loadu(v + j * ldv + n * W);
    for (int r = 0; r < R; ++r) {
      const vf pb = splat(p[r * sp + j]);
      for (int n = 0; n < DV; ++n) acc[r][n] += pb * vv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < DV; ++n) storeu(o + r * ldo + n * W, acc[r][n]);
}

struct Dims {
  int64_t B, S, H, D;
  int64_t Sp, Dp;  // S and D rounded up to whole vectors
  float scale;
};

struct Scratch {
  std::vector<float> kt, v, bias, q, p, o, inv;
};

// One (batch, head) pair, queries [q_begin, q_end).
static void attend(const float* qkv, const float* bias, const float* pos, float* out, const Dims& d, int64_t b,
                   int64_t h, int64_t q_begin, int64_t q_end, Scratch& s) {
  const int64_t S = d.S, D = d.D, Sp = d.Sp, Dp = d.Dp, HD = d.H * d.D, row = 3 * HD;
  constexpr int64_t CB = QK_NV * W;  // key columns per full K^T panel
  const int64_t full = Sp / CB * CB;  // columns in full panels; the rest is one narrower panel
  const float* base = qkv + b * S * row;

  // K^T in column panels ([D x CB] each, contiguous, so a tile streams it), V as [Sp x Dp]
  // rows, the bias in log2 units. Columns S..Sp are padding: zero keys with a bias that
  // makes their weight exactly 0.
  s.kt.assign(D * Sp, 0.0f);
  s.v.assign(Sp * Dp, 0.0f);
  s.bias.assign(Sp, -1e30f);
  for (int64_t j = 0; j < S; ++j) {
    const float* k_row = base + j * row + HD + h * D;
    const float* v_row = base + j * row + 2 * HD + h * D;
    const int64_t p0 = j < full ? j / CB * CB : full, width = j < full ? CB : Sp - full;
    float* panel = &s.kt[p0 * D + (j - p0)];
    for (int64_t e = 0; e < D; ++e) panel[e * width] = k_row[e];
    std::memcpy(&s.v[j * Dp], v_row, D * sizeof(float));
    s.bias[j] = bias[b * S + j] * kLog2e;
  }
  s.q.resize(QB * D);
  s.p.resize(QB * Sp);
  s.o.resize(QB * Dp);
  s.inv.resize(QB);
  const float q_scale = d.scale * kLog2e;

  for (int64_t q0 = q_begin; q0 < q_end; q0 += QB) {
    const int64_t rows = std::min<int64_t>(QB, q_end - q0);
    for (int64_t i = 0; i < QB; ++i) {  // rows past the end are zeros, computed and dropped
      if (i < rows) {
        const float* q_row = base + (q0 + i) * row + h * D;
        for (int64_t e = 0; e < D; ++e) s.q[i * D + e] = q_row[e] * q_scale;
      } else {
        std::memset(&s.q[i * D], 0, D * sizeof(float));
      }
    }
    vf rmax[QB];
    for (int i = 0; i < QB; ++i) rmax[i] = splat(-3e38f);
    for (int64_t j = 0; j < Sp; j += CB) {
      const int64_t nv = std::min<int64_t>(QK_NV, (Sp - j) / W);
      for (int64_t i = 0; i < QB; i += QK_R) {
        const float* q = &s.q[i * D];
        const float* kt = &s.kt[j * D];
        float* p = &s.p[i * Sp + j];
        switch (nv) {
          case 1: qk_tile<QK_R, 1>(q, D, kt, &s.bias[j], p, Sp, &rmax[i]); break;
          case 2: qk_tile<QK_R, 2>(q, D, kt, &s.bias[j], p, Sp, &rmax[i]); break;
          case 3: qk_tile<QK_R, (QK_NV >= 3 ? 3 : 1)>(q, D, kt, &s.bias[j], p, Sp, &rmax[i]); break;
          default: qk_tile<QK_R, QK_NV>(q, D, kt, &s.bias[j], p, Sp, &rmax[i]); break;
        }
      }
    }
    if (pos != nullptr) {  // [H, S, S] bias: add row (q0 + i) of head h, then the row max afresh
      for (int64_t i = 0; i < rows; ++i) {
        float* p_row = &s.p[i * Sp];
        const float* pos_row = pos + (h * S + q0 + i) * S;
        for (int64_t j = 0; j < S; ++j) p_row[j] += pos_row[j] * kLog2e;
        vf m = splat(-3e38f);
        for (int64_t j = 0; j < Sp; j += W) {
          const vf x = loadu(p_row + j);
          m = x > m ? x : m;
        }
        rmax[i] = m;
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* p_row = &s.p[i * Sp];
      float m = rmax[i][0];
      for (int k = 1; k < W; ++k) m = std::max(m, rmax[i][k]);
      vf sum = vf{};
      for (int64_t j = 0; j < Sp; j += W) {
        const vf e = exp2_nonpositive(loadu(p_row + j) - m);
        storeu(p_row + j, e);
        sum += e;
      }
      float total = 0.0f;
      for (int k = 0; k < W; ++k) total += sum[k];
      s.inv[i] = 1.0f / total;  // >= 1: the max term is 2^0
    }
    for (int64_t i = 0; i < QB; i += PV_R)
      for (int64_t e = 0; e < Dp; e += PV_DV * W) {
        const float* p = &s.p[i * Sp];
        const float* v = &s.v[e];
        float* o = &s.o[i * Dp + e];
        switch (std::min<int64_t>((Dp - e) / W, PV_DV)) {
          case 1: pv_tile<PV_R, 1>(p, Sp, v, Dp, o, Dp); break;
          case 2: pv_tile<PV_R, 2>(p, Sp, v, Dp, o, Dp); break;
          case 3: pv_tile<PV_R, 3>(p, Sp, v, Dp, o, Dp); break;
          default: pv_tile<PV_R, PV_DV>(p, Sp, v, Dp, o, Dp); break;
        }
      }
    for (int64_t i = 0; i < rows; ++i) {
      float* out_row = out + ((b * S + q0 + i) * d.H + h) * D;
      const float inv = s.inv[i];
      for (int64_t e = 0; e < D; ++e) out_row[e] = s.o[i * Dp + e] * inv;
    }
  }
}

struct Job {
  const float* qkv;
  const float* bias;
  const float* pos;  // [H, S, S] or nullptr
  float* out;
  Dims d;
  int64_t chunks, q_per_chunk, total;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    thread_local Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      const int64_t pair = i / chunks, c = i % chunks;
      const int64_t q0 = c * q_per_chunk, q1 = std::min(d.S, q0 + q_per_chunk);
      attend(qkv, bias, pos, out, d, pair / d.H, pair % d.H, q0, q1, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& qkv, ffi::Buffer<ffi::F32>& bias,
                      const ffi::Buffer<ffi::F32>* pos, ffi::ResultBuffer<ffi::F32>& out, float scale) {
  const auto dims = qkv.dimensions();
  if (dims.size() != 5 || dims[2] != 3)
    return ffi::Error::InvalidArgument("jaxserve attention: qkv must be [B, S, 3, H, D]");
  const Dims d{dims[0], dims[1], dims[3], dims[4], round_up(dims[1], W), round_up(dims[4], W), scale};
  const auto bias_dims = bias.dimensions();
  if (bias_dims.size() != 2 || bias_dims[0] != d.B || bias_dims[1] != d.S)
    return ffi::Error::InvalidArgument("jaxserve attention: bias must be [B, S]");
  if (pos != nullptr) {
    const auto pos_dims = pos->dimensions();
    if (pos_dims.size() != 3 || pos_dims[0] != d.H || pos_dims[1] != d.S || pos_dims[2] != d.S)
      return ffi::Error::InvalidArgument("jaxserve attention: the position bias must be [H, S, S]");
  }
  const auto out_dims = out->dimensions();
  if (out_dims.size() != 4 || out_dims[0] != d.B || out_dims[1] != d.S || out_dims[2] != d.H || out_dims[3] != d.D)
    return ffi::Error::InvalidArgument("jaxserve attention: out must be [B, S, H, D]");
  if (d.B * d.S * d.H * d.D == 0) return ffi::Error::Success();

  auto job = std::make_shared<Job>();
  job->qkv = qkv.typed_data();
  job->bias = bias.typed_data();
  job->pos = pos != nullptr ? pos->typed_data() : nullptr;
  job->out = out->typed_data();
  job->d = d;
  // Split each (batch, head) pair's queries into chunks until there are >= 4 items per
  // thread (batch 1 with few heads would otherwise leave threads idle).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t pairs = d.B * d.H, blocks = round_up(d.S, QB) / QB;
  int64_t chunks = 1;
  while (pairs * chunks < 4 * threads && chunks < blocks) ++chunks;
  job->q_per_chunk = round_up(blocks, chunks) / chunks * QB;
  job->chunks = (d.S + job->q_per_chunk - 1) / job->q_per_chunk;
  job->total = pairs * job->chunks;
  const int64_t helpers = std::min<int64_t>(threads - 1, job->total - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->run(); });
  job->run();
  while (job->done.load(std::memory_order_acquire) < job->total) std::this_thread::yield();
  return ffi::Error::Success();
}

static ffi::Error FusedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> bias,
                                 ffi::ResultBuffer<ffi::F32> out, float scale) {
  return Run(pool, qkv, bias, nullptr, out, scale);
}

static ffi::Error FusedAttentionPosBias(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> pos,
                                        ffi::ResultBuffer<ffi::F32> out, float scale) {
  return Run(pool, qkv, bias, &pos, out, scale);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFusedAttention, FusedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [B, S, 3, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [B, S]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, S, H, D]
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFusedAttentionPosBias, FusedAttentionPosBias,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [B, S, 3, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [B, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pos [H, S, S] (query, key)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, S, H, D]
                                  .Attr<float>("scale"));
