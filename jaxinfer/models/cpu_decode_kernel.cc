// Paged decode attention for XLA CPU, reading the page-major KV pool in place (an XLA FFI custom
// call; built and loaded by jaxinfer/models/cpu_decode_kernel.py). The XLA path gathers each work item's
// pages into a transposed copy before two small batched dots; this reads each live page once.
//
// Operands: q f32[Td, K, G, H]; k_pages, v_pages f32[L, P, K, Z, H] (page-major pool);
// block_tables i32[Td, M]; kv_lens i32[Td]; q_pos i32[Td]; layer_window i32[2] (layer, window);
// sinks f32[K * G] attention-sink logits (gpt-oss: one more softmax term per head, no value), or
// f32[0] for none.
// Result: f32[Td, K, G, H]. Attributes: scale, softcap (0: none), threads.
// Row r attends to keys t < kv_lens[r] with t <= q_pos[r] and (window <= 0 or q_pos[r] - t <
// window), in page order, with an online softmax per (head, group) over blocks of one page (Milakov
// & Gimelshein 2018). Rows with no visible key give 0.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Args {
  const float *q, *kp, *vp;
  const int32_t *bt, *lens, *qpos;
  const float* sinks;  // nullptr: none
  float* out;
  int64_t td, kh, g, h, np, z, m;
  int32_t window;
  float scale, softcap;
};

// One row: all its heads and groups. Returns false on a page id outside the pool.
bool Row(const Args& a, int64_t r, float* mx, float* l, float* acc, float* s) {
  const int64_t kg = a.kh * a.g, h = a.h, z = a.z;
  float* o = a.out + r * kg * h;
  const int64_t qp = a.qpos[r];
  int64_t lo = 0;
  if (a.window > 0) lo = std::max<int64_t>(0, qp - a.window + 1);
  const int64_t hi = std::min<int64_t>(a.lens[r], qp + 1);
  if (hi <= lo) {
    std::memset(o, 0, sizeof(float) * kg * h);
    return true;
  }
  std::fill(mx, mx + kg, -INFINITY);
  std::fill(l, l + kg, 0.f);
  std::fill(acc, acc + kg * h, 0.f);
  const float* qr = a.q + r * kg * h;
  for (int64_t j = lo / z; j * z < hi; ++j) {
    const int64_t page = a.bt[r * a.m + j];
    if (page < 0 || page >= a.np) return false;
    const int64_t t0 = std::max(j * z, lo) - j * z, t1 = std::min((j + 1) * z, hi) - j * z;
    for (int64_t k = 0; k < a.kh; ++k) {
      const float* kb = a.kp + (page * a.kh + k) * z * h;
      const float* vb = a.vp + (page * a.kh + k) * z * h;
      for (int64_t gi = 0; gi < a.g; ++gi) {
        const int64_t st = k * a.g + gi;
        const float* qv = qr + st * h;
        float bm = -INFINITY;
        for (int64_t t = t0; t < t1; ++t) {
          const float* kv = kb + t * h;
          float d = 0.f;
#pragma omp simd reduction(+ : d)
          for (int64_t i = 0; i < h; ++i) d += qv[i] * kv[i];
          d *= a.scale;
          if (a.softcap > 0.f) d = std::tanh(d / a.softcap) * a.softcap;
          s[t] = d;
          bm = std::max(bm, d);
        }
        const float nm = std::max(mx[st], bm);
        const float corr = std::exp(mx[st] - nm);
        float* ac = acc + st * h;
        float ls = l[st] * corr;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) ac[i] *= corr;
        for (int64_t t = t0; t < t1; ++t) {
          const float p = std::exp(s[t] - nm);
          ls += p;
          const float* vv = vb + t * h;
#pragma omp simd
          for (int64_t i = 0; i < h; ++i) ac[i] += p * vv[i];
        }
        l[st] = ls;
        mx[st] = nm;
      }
    }
  }
  for (int64_t st = 0; st < kg; ++st) {
    if (a.sinks != nullptr) {  // the sink joins the max and the denominator, with no value
      const float nm = std::max(mx[st], a.sinks[st]);
      const float corr = std::exp(mx[st] - nm);
      l[st] = l[st] * corr + std::exp(a.sinks[st] - nm);
      for (int64_t i = 0; i < h; ++i) acc[st * h + i] *= corr;
    }
    const float inv = 1.f / l[st];  // l >= 1: the max key (or sink) contributes exp(0)
    for (int64_t i = 0; i < h; ++i) o[st * h + i] = acc[st * h + i] * inv;
  }
  return true;
}

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                               ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_pos,
                               ffi::Buffer<ffi::S32> layer_window, ffi::Buffer<ffi::F32> sinks,
                               ffi::ResultBuffer<ffi::F32> out,
                               float scale, float softcap, int64_t threads) {
  auto qd = q.dimensions();
  auto pd = k_pages.dimensions();
  if (qd.size() != 4 || pd.size() != 5 || pd[2] != qd[1] || pd[4] != qd[3] ||
      !std::equal(pd.begin(), pd.end(), v_pages.dimensions().begin(), v_pages.dimensions().end()) ||
      block_tables.dimensions().size() != 2 ||
      block_tables.dimensions()[0] != qd[0]) {
    return ffi::Error::InvalidArgument(
        "cpu decode attention: want q [Td, K, G, H], k/v pages [L, P, K, Z, H], tables [Td, M]");
  }
  const bool has_sinks = sinks.element_count() != 0;
  if (has_sinks && sinks.element_count() != qd[1] * qd[2]) {
    return ffi::Error::InvalidArgument("cpu decode attention: want sinks [K * G] or [0]");
  }
  const int32_t layer = layer_window.typed_data()[0];
  if (layer < 0 || layer >= pd[0]) {
    return ffi::Error::InvalidArgument("cpu decode attention: layer " + std::to_string(layer) +
                                       " outside the pool's " + std::to_string(pd[0]) + " layers");
  }
  const int64_t layer_elems = pd[1] * pd[2] * pd[3] * pd[4];
  Args a{q.typed_data(), k_pages.typed_data() + layer * layer_elems,
         v_pages.typed_data() + layer * layer_elems, block_tables.typed_data(),
         kv_lens.typed_data(), q_pos.typed_data(), has_sinks ? sinks.typed_data() : nullptr,
         out->typed_data(),
         qd[0], qd[1], qd[2], qd[3], pd[1], pd[3], block_tables.dimensions()[1],
         layer_window.typed_data()[1], scale, softcap};
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> bad_row{-1};
  auto work = [&]() {
    const int64_t kg = a.kh * a.g;
    std::vector<float> mx(kg), l(kg), acc(kg * a.h), s(a.z);
    for (int64_t r; (r = next.fetch_add(1)) < a.td;) {
      if (!Row(a, r, mx.data(), l.data(), acc.data(), s.data())) bad_row.store(r);
    }
  };
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, a.td));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (bad_row.load() >= 0) {
    return ffi::Error::InvalidArgument("cpu decode attention: block_tables row " +
                                       std::to_string(bad_row.load()) +
                                       " holds a page id outside the pool");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCpuDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("threads"));
